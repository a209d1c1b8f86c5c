"""Pictures of the planner and the sweep report: pure functions from their numbers to a matplotlib ``Figure``.

Each function takes what ``plan.py`` or ``report.py`` computed and returns a ``Figure`` drawn on its own Agg canvas
(no ``pyplot``: no global state, no display), laid out once so that what a test reads from it (axis scales, label
texts, label boxes) is what the saved PNG shows; :func:`save` writes it. matplotlib is imported only when a picture
is drawn (``pip install 'lightning_seqmem[plot]'``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_seqmem.batching.truncation import count_truncated

__all__ = ["length_histogram", "memory_bars", "save", "strategy_bars", "sweep_curves"]

LINE_COLOUR = "#c44e52"  # candidate max_length lines and their labels
CATEGORIES = (
    ("parameters", "#4c72b0"),
    ("gradients", "#dd8452"),
    ("optimizer_state", "#55a868"),
    ("activations", "#8172b3"),
)


def _figure(width: float, height: float, rows: int = 1, cols: int = 1):
    """A constrained-layout figure on an Agg canvas and its ``[rows][cols]`` axes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("The pictures need matplotlib: pip install 'lightning_seqmem[plot]'.") from error
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _freeze_layout(fig) -> None:
    """Run the constrained layout once and keep it: labels placed after it stay where they were checked."""
    fig.canvas.draw()
    fig.set_layout_engine("none")


def save(fig, path: str, dpi: int = 120) -> str:
    """Write ``fig`` to ``path`` (the format from its suffix) and return the path."""
    fig.savefig(path, dpi=dpi)
    return path


# ------------------------------------------------------------------------------------------------ length histogram
def _place_labels(ax, xs: Sequence[float], texts: Sequence[str], colour: str = LINE_COLOUR) -> list:
    """One label per vertical line at ``xs``, at the top of ``ax``; a label that would touch one already placed
    moves down a row, and one that would leave the axes on the right is right-aligned to its line."""
    from matplotlib.transforms import blended_transform_factory

    renderer = ax.figure.canvas.get_renderer()
    box_ax = ax.get_window_extent(renderer)
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    placed, labels = [], []
    for x, text in sorted(zip(xs, texts)):
        label = ax.text(
            x,
            0.98,
            text,
            transform=transform,
            va="top",
            ha="left",
            fontsize=8,
            color=colour,
            bbox=dict(facecolor="white", alpha=0.85, edgecolor="none", pad=1.0),
            zorder=5,
        )
        if label.get_window_extent(renderer).x1 > box_ax.x1:
            label.set_horizontalalignment("right")
        y = 0.98
        while True:
            box = label.get_window_extent(renderer).expanded(1.04, 1.08)
            if not any(box.overlaps(other) for other in placed) or y < 0.05:
                break
            y -= (box.height + 3) / box_ax.height
            label.set_y(y)
        placed.append(label.get_window_extent(renderer))
        labels.append(label)
    return labels


def length_histogram(
    panels: Mapping[str, np.ndarray] | np.ndarray,
    max_lengths: Sequence[int] = (),
    title: str = "Train document lengths and candidate max_length",
):
    """Token counts per document on logarithmic bins, with the cumulative share of documents and of tokens.

    Args:
        panels: ``[documents]`` token counts, or name -> counts for one panel each (``{"prompt": ...,
            "completion": ...}``); empty documents are left out.
        max_lengths: candidates, drawn as labelled lines with the share of the panel's tokens past each.
        title: the figure's title.
    """
    panels = {"documents": panels} if not isinstance(panels, Mapping) else dict(panels)
    fig, axes = _figure(8, 3.6 * len(panels) + 0.6, rows=len(panels))
    twins = []
    for ax, (name, lengths) in zip(axes[:, 0], panels.items()):
        lengths = np.asarray(lengths, dtype=np.int64)
        lengths = lengths[lengths > 0]
        if lengths.size == 0:
            raise ValueError(f"No non-empty {name} to draw: the histogram needs at least one length > 0.")
        low = min(int(lengths.min()), *max_lengths) if max_lengths else int(lengths.min())
        high = max(int(lengths.max()), *max_lengths) if max_lengths else int(lengths.max())
        low, high = max(low / 1.15, 0.8), high * 1.15
        # Log-spaced edges between whole token counts, so no bin of short documents falls between two integers.
        edges = np.geomspace(low, high, int(np.clip(12 * np.log10(high / low), 10, 80)) + 1)
        bins = np.unique(np.concatenate([np.round(edges[edges < high / 1.15]) + 0.5, [low, high]]))
        ax.hist(lengths, bins=bins, color="#4c72b0", alpha=0.75, label="documents per bin")
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ax.set_xlabel(f"tokens per {'document' if name == 'documents' else name} (log scale)")
        ax.set_ylabel("documents")
        ax.set_title(
            f"{name}: {lengths.size:,}, {int(lengths.sum()):,} tokens, median "
            f"{int(np.median(lengths))}, longest {int(lengths.max()):,}",
            fontsize=9,
        )
        values, counts = np.unique(lengths, return_counts=True)
        share = ax.twinx()
        share.step(
            values,
            100 * np.cumsum(counts) / lengths.size,
            where="post",
            color="#333333",
            label="cumulative share of documents",
        )
        share.step(
            values,
            100 * np.cumsum(values * counts) / lengths.sum(),
            where="post",
            color="#dd8452",
            linestyle="--",
            label="cumulative share of tokens",
        )
        share.set_ylim(0, 105)
        share.set_ylabel("cumulative share (%)")
        for m in max_lengths:
            ax.axvline(m, color=LINE_COLOUR, linestyle=":", linewidth=1.2)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # head room for the labels
        twins.append((ax, share, lengths))
    handles = [h for ax in (axes[0, 0], twins[0][1]) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    _freeze_layout(fig)
    for _, share, lengths in twins:  # on the twin axes: drawn last, the labels stay above the curves
        total = int(lengths.sum())
        _place_labels(
            share,
            list(max_lengths),
            [f"{m:,}\n{count_truncated(lengths, m) / total:.1%} of tokens past" for m in max_lengths],
        )
    return fig


# ------------------------------------------------------------------------------------------------- strategy bars
def strategy_bars(plans: Sequence[Any], recommended: tuple[str, int] | None = None):
    """Token efficiency and share of tokens lost, one group of bars per strategy, one bar per max_length.

    ``plans`` are :class:`~lightning_seqmem.apps.planner.StrategyPlan` (``strategy``, ``max_length``,
    ``token_efficiency``, ``lost_share``); the ``recommended`` ``(strategy, max_length)`` bar is hatched.
    """
    strategies = list(dict.fromkeys(p.strategy for p in plans))
    lengths = sorted({p.max_length for p in plans})
    by_key = {(p.strategy, p.max_length): p for p in plans}
    fig, axes = _figure(9, 5.6, rows=2)
    width = 0.8 / len(lengths)
    shades = [f"C{i % 10}" for i in range(len(lengths))]
    for ax, (what, value) in zip(
        axes[:, 0],
        (
            ("token efficiency: real tokens / slots (%)", "token_efficiency"),
            ("tokens lost: truncated or dropped (%)", "lost_share"),
        ),
    ):
        for i, (length, colour) in enumerate(zip(lengths, shades)):
            xs = [s + (i - (len(lengths) - 1) / 2) * width for s in range(len(strategies))]
            ys = [100 * getattr(by_key[(s, length)], value) if (s, length) in by_key else np.nan for s in strategies]
            bars = ax.bar(xs, ys, width * 0.95, color=colour, label=f"max_length {length:,}")
            ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
            for bar, strategy in zip(bars, strategies):
                if recommended == (strategy, length):
                    bar.set_hatch("///")
                    bar.set_edgecolor("black")
        ax.set_ylabel(what, fontsize=9)
        ax.set_ylim(0, 110)
        ax.set_xticks(range(len(strategies)), strategies)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(
        *axes[0, 0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=min(len(lengths), 6),
        fontsize=8,
        frameon=False,
    )
    title = "Strategy x max_length on the train documents"
    if recommended is not None:
        title += f" (hatched: recommended, {recommended[0]} at {recommended[1]:,})"
    fig.suptitle(title)
    _freeze_layout(fig)
    return fig


# --------------------------------------------------------------------------------------------------- memory bars
def _unit(value: float) -> tuple[str, float]:
    """GiB from 4 GiB up, else MiB: bar labels of two or three digits, not 0.0598."""
    return ("GiB", 2**30) if value >= 4 * 2**30 else ("MiB", 2**20)


def memory_bars(memory: Any):
    """Peak training memory per micro_batch_size as stacked bars of what is live at the peak, one panel without
    and one with gradient checkpointing, with the budget and the margin kept back from it.

    ``memory`` is a :class:`~lightning_seqmem.apps.planner.MemoryPlan` (``estimates`` checkpointing -> rows ->
    ``MemoryEstimate``, ``budget``, ``usable``, ``margin``, ``length``, ``fits``).
    """
    from lightning_seqmem.memory.stats import format_bytes

    panels = [(ckpt, by_rows) for ckpt, by_rows in memory.estimates.items() if by_rows]
    top = max([e.peak for _, by_rows in panels for e in by_rows.values()] + [memory.budget or 0])
    unit, scale = _unit(top)
    fig, axes = _figure(5 * len(panels) + 1, 4.6, cols=len(panels))
    for ax, (checkpointing, by_rows) in zip(axes[0], panels):
        rows = sorted(by_rows)
        bottom = np.zeros(len(rows))
        for category, colour in CATEGORIES:
            heights = np.array([getattr(by_rows[r], category) for r in rows]) / scale
            bars = ax.bar(range(len(rows)), heights, 0.7, bottom=bottom, color=colour, label=category.replace("_", " "))
            bottom += heights
        over = [memory.usable is not None and by_rows[r].peak > memory.usable for r in rows]
        ax.bar_label(bars, [f"{h:.3g}" + (" too big" if o else "") for h, o in zip(bottom, over)], fontsize=7)
        if memory.budget is not None:
            ax.axhline(
                memory.budget / scale, color="black", linewidth=1.2, label=f"budget {format_bytes(memory.budget)}"
            )
            ax.axhspan(
                memory.usable / scale,
                memory.budget / scale,
                color="grey",
                alpha=0.25,
                label=f"margin: {memory.margin:.0%} of the budget kept back (allocator, CUDA context)",
            )
        ax.set_xticks(range(len(rows)), [f"{r}\n{by_rows[r].peak_phase}" for r in rows], fontsize=8)
        ax.set_ylim(0, 1.1 * top / scale)
        ax.set_xlabel("micro_batch_size / where the peak falls")
        ax.set_ylabel(f"live at the peak ({unit})")
        fits = memory.fits.get(checkpointing)
        ax.set_title(
            f"gradient checkpointing {'on' if checkpointing else 'off'}"
            + (
                f": largest that fits {fits}"
                if fits is not None
                else (": none fits" if memory.budget is not None else "")
            ),
            fontsize=9,
        )
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    early = any(e.peak_phase == "backward" and not e.gradients for _, by_rows in panels for e in by_rows.values())
    fig.suptitle(
        f"Peak training memory at length {memory.length:,}, split into what is live at the peak"
        + ("\n(no gradients at a peak early in backward: this step has written none yet)" if early else ""),
        fontsize=10,
    )
    _freeze_layout(fig)
    return fig


# ------------------------------------------------------------------------------------------------- sweep curves
def _mean_band(curves: list[list[dict]], x: str, y: str):
    """Mean, min and max of ``y`` over the curves on the ``x`` range every curve covers (linear interpolation)."""
    low, high = max(c[0][x] for c in curves), min(c[-1][x] for c in curves)
    if high < low:
        return None
    grid = np.unique(np.concatenate([[r[x] for r in c if low <= r[x] <= high] for c in curves] + [[low, high]]))
    values = np.array([np.interp(grid, [r[x] for r in c], [r[y] for r in c]) for c in curves])
    return grid, values.mean(axis=0), values.min(axis=0), values.max(axis=0)


def sweep_curves(
    groups: Mapping[str, Sequence[Any]], time_key: str, target: float, clock: str = "wall-clock", per_job: bool = False
):
    """Validation loss (and training loss, when recorded) against time and against tokens.

    Args:
        groups: setting -> its jobs (the seeds of one configuration; one job each without seeds). A job has
            ``rows`` (``val_loss``), ``train_rows`` (``train_loss``), ``finished`` and ``status``.
        time_key: the time column (``wall_clock_s`` or ``cpu_s``).
        target: the target validation loss, drawn as a line.
        clock: how to name the time axis.
        per_job: one line per job (seeds of a setting share its colour) instead of the mean over its seeds with
            a min-max band.
    """
    with_train = any(job.train_rows for jobs in groups.values() for job in jobs)
    seeds = max(len(jobs) for jobs in groups.values())
    fig, axes = _figure(12, 9 if with_train else 4.8, rows=2 if with_train else 1, cols=2)
    for index, (name, jobs) in enumerate(groups.items()):
        colour = f"C{index % 10}"
        done = [job for job in jobs if job.finished] or list(jobs)
        for row, (attr, loss) in enumerate((("rows", "val_loss"), ("train_rows", "train_loss"))[: len(axes)]):
            for ax, x in zip(axes[row], (time_key, "tokens_seen")):
                curves = [getattr(job, attr) for job in (jobs if per_job else done)]
                curves = [c for c in curves if c and x in c[0]]
                band = None if per_job or len(curves) < 2 else _mean_band(curves, x, loss)
                if band is not None:
                    grid, mean, low, high = band
                    point = "o" if len(grid) == 1 else None  # one point: a line of one point is not drawn
                    label = f"{name} (mean of {len(curves)})"
                    ax.plot(grid, mean, color=colour, marker=point, markersize=4, linewidth=1.6, label=label)
                    ax.fill_between(grid, low, high, color=colour, alpha=0.2, linewidth=0)
                    continue
                for i, job in enumerate(jobs if per_job else done):
                    curve = getattr(job, attr)
                    if not curve or x not in curve[0]:
                        continue
                    tag = "" if job.finished else f" ({job.status})"
                    tag += " (1 seed)" if seeds > 1 and not per_job and len(curves) == 1 else ""
                    ax.plot(
                        [r[x] for r in curve],
                        [r[loss] for r in curve],
                        "-" if job.finished else ":",
                        color=colour,
                        marker="o" if loss == "val_loss" or len(curve) == 1 else None,  # one point: a marker
                        markersize=3,
                        linewidth=1,
                        label=(name + tag) if i == 0 or not per_job else None,
                    )
    for row, what in enumerate(("validation loss", "training loss")[: len(axes)]):
        for ax, xlabel in zip(axes[row], (f"training {clock} (s, validation excluded)", "real tokens trained on")):
            if row == 0:
                ax.axhline(target, color="black", linestyle="--", linewidth=0.9, label=f"target {target:.4g}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(
        "one line per job" if per_job or seeds < 2 else "one line per setting: mean over its seeds, band min-max",
        fontsize=10,
    )
    _freeze_layout(fig)
    return fig
