"""``SeqMemSettings``: ``SeqMemDataModule``'s arguments as one frozen, validated object, built once in ``__init__``.

Two concerns composed: :class:`DataSettings` (where documents come from and how they are read) and
``batching.settings.BatchingSettings`` (how they become rows and batches: what the strategies, the planner and the
resume signature read). Every default and check is resolved in the ``__post_init__`` of the class that owns the
field; the rest of the package reads these objects, never the raw arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_seqmem.batching.fields import check_flags, check_integers, integer
from lightning_seqmem.batching.options import Batching, Pack, as_batching
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.data.conversations import ConversationSettings
from lightning_seqmem.data.token_cache import default_cache_dir
from lightning_seqmem.messages import check_choice

RESUME_MISMATCH = ("error", "restart_epoch")


@dataclass(frozen=True)
class DataSettings:
    """Where the documents come from and how they are read (``SeqMemDataModule``'s data arguments, same meaning)."""

    text_column: str = "text"
    """The column holding the text."""
    num_workers: int = integer(0, 0)
    """DataLoader worker processes."""
    streaming: bool = False
    """Serve the dataset as a stream (``data.sources.open_stream``: files and hub names read lazily)."""
    streaming_buffer_size: int = integer(1000, 1)
    """Streaming datasets: documents held in the best-fit window."""
    streaming_validation_documents: int = integer(100, 0)
    """A stream without a ``validation`` split gives its first this many documents to validation."""
    streaming_shuffle_buffer: int = integer(0, 0)
    """Streams: documents each reader draws from at random (seeded by ``seed``) before packing; 0 reads in order."""
    num_proc: int | None = integer(None, 1, " or None (automatic)", optional=True)
    """Processes for tokenization; ``None``: chosen from the dataset's size."""
    cache_dir: str | os.PathLike | None = None
    """Where tokenized datasets (and packing plans) are cached; ``None``: the default cache folder."""
    pad_token_id: int | None = integer(None, 0, " or None (from the tokenizer)", optional=True)
    """Pre-tokenized data: the pad id, when no tokenizer gives it."""
    eos_token_id: int | None = integer(None, 0, " or None (from the tokenizer)", optional=True)
    """Pre-tokenized data: the EOS id, when no tokenizer gives it."""
    on_resume_mismatch: str = "error"
    """A checkpoint saved with other data: ``"error"`` or ``"restart_epoch"``."""

    def __post_init__(self) -> None:
        check_integers(self)
        check_flags(self)
        check_choice("on_resume_mismatch", self.on_resume_mismatch, RESUME_MISMATCH)

    @property
    def plan_cache(self) -> str:
        """Where packing plans of large datasets are kept: ``cache_dir``, else the default cache folder."""
        return str(self.cache_dir) if self.cache_dir is not None else str(default_cache_dir())


@dataclass(frozen=True)
class SeqMemSettings:
    """Everything ``SeqMemDataModule`` was configured with, checked: ``batching``, ``data`` and ``conversation``
    (how conversations become training tokens: ``train_on``, ``train_field``, ``on_empty_labels``).

    Example::

        settings = SeqMemSettings.from_arguments(max_length=512, strategy="pack", num_workers=2)
        settings.batching.batching  # Pack(method='bfd')
    """

    batching: BatchingSettings
    data: DataSettings
    conversation: ConversationSettings = field(default_factory=ConversationSettings)

    def hyperparameters(self) -> dict[str, Any]:
        """The settings as plain values, as loggers and checkpoints record them (``save_hyperparameters``): each
        loader's strategy options as a dict; the special ids only as given (the tokenizer's are not known yet, and a
        logged ``None`` would collide with a user's LightningModule that saves its own ``pad_token_id``: Lightning
        refuses a key logged with two values); ``cache_dir`` as a string (a ``Path`` fails
        ``torch.load(weights_only=True)``, as the Tuner loads its checkpoint)."""
        b = self.batching
        data = {k: v for k, v in vars(self.data).items() if v is not None or k not in ("pad_token_id", "eos_token_id")}
        if data["cache_dir"] is not None:
            data["cache_dir"] = os.fspath(data["cache_dir"])
        return dict(
            vars(b),
            **data,
            **vars(self.conversation),
            batching=b.batching.as_dict(),
            eval_batching=b.batching_for("validation").as_dict(),
        )

    @classmethod
    def from_arguments(cls, **arguments: Any) -> SeqMemSettings:
        """The settings of ``SeqMemDataModule(**arguments)`` (its arguments other than ``dataset`` and
        ``tokenizer``); each goes to the class that declares it (batching first, as the arguments are listed).
        The shorthands ``strategy``/``eval_strategy`` (``"pad"``, ``"truncate"``, ``"pack"``) become
        ``batching``/``eval_batching`` objects with their defaults; with neither ``batching`` nor ``strategy``,
        ``Pack()``, as the main job (``seqmem-train``'s ``batching=pack_bfd``): no token is lost, long text documents
        are split."""
        for option, shorthand in (("batching", "strategy"), ("eval_batching", "eval_strategy")):
            arguments[option] = _batching(arguments.get(option), arguments.pop(shorthand, None), option, shorthand)
        if arguments["batching"] is None:  # neither given: the main job's (conf batching=pack_bfd), nothing lost
            arguments["batching"] = Pack()
        parts, concerns = (
            {},
            (("batching", BatchingSettings), ("data", DataSettings), ("conversation", ConversationSettings)),
        )
        for name, part in concerns:
            mine = {f.name for f in fields(part)}
            parts[name] = part(**{k: v for k, v in arguments.items() if k in mine})
        unknown = set(arguments) - {f.name for _, part in concerns for f in fields(part)}
        if unknown:
            raise TypeError(f"Unknown settings {sorted(unknown)}.")
        return cls(**parts)


def _batching(given: Any, name: str | None, option: str, shorthand: str) -> Batching | None:
    """``option`` (an object) or its ``shorthand`` (a name), not both."""
    if name is None:
        return given
    if given is not None:
        raise ValueError(
            f"Give {option}={given!r} or {shorthand}={name!r}, not both: {shorthand} is the shorthand for "
            f"{option} with its defaults ({shorthand}={name!r} is {option}={as_batching(name, shorthand)!r})."
        )
    return as_batching(name, shorthand)
