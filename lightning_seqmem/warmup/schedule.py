"""Sequence-length warmup: the schedule.

Pure functions of (progress, total): the sequence length grows from ``min_seq_length`` to ``max_seq_length`` over
the first ``duration`` of training, along a linear curve (Composer's) or DeepSpeed's ``fixed_root`` curve, rounded
down to a multiple of ``step_size``, and is ``max_seq_length`` from the end of warmup on. Progress is usually the
optimizer step, but any monotone count works (tokens, for a token budget). No Lightning import.

Unlike Composer's schedule it never divides by zero (short runs, ``duration=0``, ``min == max``) and it reaches
``max_seq_length`` exactly when warmup ends even when ``max - min`` is not a multiple of ``step_size``.
"""

from __future__ import annotations

import math

__all__ = ["CURVES", "check_schedule_args", "seq_length_at", "warmup_lengths", "warmup_steps"]

CURVES = ("linear", "fixed_root")


def check_schedule_args(
    duration: float,
    min_seq_length: int,
    max_seq_length: int,
    step_size: int,
    curve: str = "linear",
    root_degree: int = 2,
) -> None:
    """Raise a clear error for schedule arguments that make no sense.

    Raises:
        ValueError: ``duration`` outside ``[0, 1]``, ``min_seq_length < 1``, ``min_seq_length > max_seq_length``,
            ``step_size < 1``, an unknown ``curve`` or ``root_degree < 1``.
        TypeError: a length or ``step_size`` that is not an int.

    Example::

        check_schedule_args(0.3, 8, 1024, 8)  # fine
    """
    for name, value in (
        ("min_seq_length", min_seq_length),
        ("max_seq_length", max_seq_length),
        ("step_size", step_size),
        ("root_degree", root_degree),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not 0.0 <= duration <= 1.0:
        raise ValueError(
            f"duration is the fraction of training spent warming up and must be in [0, 1], got {duration!r}. "
            "Use e.g. duration=0.3 (Composer's default), or 0 to switch warmup off."
        )
    if min_seq_length < 1:
        raise ValueError(f"min_seq_length must be >= 1, got {min_seq_length}. Use e.g. min_seq_length=8.")
    if min_seq_length > max_seq_length:
        raise ValueError(
            f"min_seq_length ({min_seq_length}) must be <= max_seq_length ({max_seq_length}); swap them, or set "
            "max_seq_length to the longest sequence your loader yields."
        )
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}. Use a multiple of 8, e.g. step_size=8.")
    if curve not in CURVES:
        raise ValueError(f"curve must be one of {CURVES}, got {curve!r}.")
    if root_degree < 1:
        raise ValueError(f"root_degree must be >= 1 (2 is DeepSpeed's default), got {root_degree}.")


def warmup_steps(total: int, duration: float) -> int:
    """Number of progress units spent warming up: ``ceil(duration * total)``, robust to float noise.

    Example::

        warmup_steps(10, 0.7)  # 7, although 0.7 * 10 == 7.000000000000001
    """
    return math.ceil(round(duration * total, 9))


def seq_length_at(
    step: int,
    total_steps: int,
    duration: float,
    min_seq_length: int,
    max_seq_length: int,
    step_size: int = 8,
    curve: str = "linear",
    root_degree: int = 2,
) -> int:
    """Sequence length at ``step`` of ``total_steps``.

    Inside warmup (``step < ceil(duration * total_steps)``) the length is ``min + f(step / warmup) * (max - min)``
    rounded down to a multiple of ``step_size`` but never below ``min_seq_length``, with ``f(x) = x`` (``linear``)
    or ``f(x) = x ** (1 / root_degree)`` (DeepSpeed's ``fixed_root``). From the end of warmup on it is
    ``max_seq_length``. The result never decreases with ``step`` and is ``min_seq_length`` at step 0 whenever
    warmup lasts at least one step.

    Args:
        step: progress so far (optimizer steps, or tokens for a token budget), ``>= 0``.
        total_steps: progress at the end of training, ``>= 1``, in the same unit.
        duration: fraction of training spent warming up, in ``[0, 1]``.
        min_seq_length: length at step 0.
        max_seq_length: length from the end of warmup on.
        step_size: lengths inside warmup are multiples of it (8 suits tensor cores).
        curve: ``"linear"`` or ``"fixed_root"``.
        root_degree: root of the ``fixed_root`` curve.

    Raises:
        ValueError: bad schedule arguments (see :func:`check_schedule_args`), ``step < 0`` or ``total_steps < 1``.

    Example::

        [seq_length_at(s, 10, 0.5, 8, 64) for s in range(7)]  # [8, 16, 24, 40, 48, 64, 64]
    """
    check_schedule_args(duration, min_seq_length, max_seq_length, step_size, curve, root_degree)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}.")
    if total_steps < 1:
        raise ValueError(
            f"total_steps must be >= 1, got {total_steps}. Set Trainer(max_steps=...) or max_epochs with a sized "
            "train loader, or give a token budget."
        )
    warmup = warmup_steps(total_steps, duration)
    if step >= warmup or min_seq_length == max_seq_length:
        return max_seq_length
    fraction = step / warmup
    if curve == "fixed_root":
        fraction = fraction ** (1.0 / root_degree)
    length = min_seq_length + fraction * (max_seq_length - min_seq_length)
    length = int(length) // step_size * step_size
    return min(max(length, min_seq_length), max_seq_length)


def warmup_lengths(min_seq_length: int, max_seq_length: int, step_size: int = 8) -> list[int]:
    """Every length :func:`seq_length_at` can return, in increasing order, whatever the run length and curve.

    Example::

        warmup_lengths(5, 30, 8)  # [5, 8, 16, 24, 30]
    """
    first_multiple = -(-min_seq_length // step_size) * step_size
    inner = range(max(first_multiple, step_size), max_seq_length, step_size)
    return sorted({min_seq_length, *inner, max_seq_length})
