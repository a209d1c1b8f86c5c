"""The planner's pictures, drawn from real data, read back from the Figure the way a person reads the PNG:
axis scales, label texts and where the labels sit (never on top of each other), bars and lines that match the
numbers the planner prints."""

import functools
import itertools

import numpy as np
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.apps import plots
from lightning_seqmem.apps.plan_lengths import column_lengths
from lightning_seqmem.apps.planner import (
    STRATEGIES,
    default_max_lengths,
    length_distribution,
    plan_memory,
    plan_strategies,
    recommend_data,
)
from lightning_seqmem.batching.settings import BatchingSettings

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.filterwarnings("ignore:.*never reach the model.*")


def _labels(fig):
    """The candidate max_length labels of every panel: texts drawn on the twin (cumulative share) axes."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        texts = [t for t in ax.texts if "of tokens past" in t.get_text()]
        if texts:
            out.append((ax, [(t.get_text(), t.get_window_extent(renderer)) for t in texts]))
    return out


def _check_apart_and_inside(ax, labels, renderer):
    frame = ax.get_window_extent(renderer)
    for (_, a), (_, b) in itertools.combinations(labels, 2):
        assert not a.overlaps(b), f"labels overlap: {a} and {b}"
    for text, box in labels:
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1 and frame.y0 <= box.y0, text


def test_histogram_of_the_builtin_corpus_is_log_scaled_with_readable_labels(tmp_path):
    """The reported case: median ~30 tokens, longest ~16 k, candidates 64-512 once printed as '6425612'."""
    dm = SeqMemDataModule()
    lengths = column_lengths(dm)
    candidates = default_max_lengths(dm.max_length)
    fig = plots.length_histogram(lengths, candidates)
    bars, share = fig.axes[0], fig.axes[1]
    assert bars.get_xscale() == "log" and share.get_xscale() == "log"
    assert bars.get_xlim()[0] <= lengths["documents"].min() and bars.get_xlim()[1] >= lengths["documents"].max()
    assert {line.get_label() for line in share.lines} == {"cumulative share of documents", "cumulative share of tokens"}
    assert all(max(line.get_ydata()) == pytest.approx(100) for line in share.lines)
    # One dotted line and one label per candidate, with the share of tokens the planner prints for it.
    assert sorted(line.get_xdata()[0] for line in bars.lines) == candidates
    over = length_distribution(lengths["documents"], candidates)["over"]
    [(ax, labels)] = _labels(fig)
    assert sorted(text for text, _ in labels) == sorted(
        f"{m:,}\n{over[m]['tokens']:.1%} of tokens past" for m in candidates
    )
    _check_apart_and_inside(ax, labels, fig.canvas.get_renderer())
    assert plots.save(fig, str(tmp_path / "lengths.png")) and (tmp_path / "lengths.png").stat().st_size > 10_000


def test_heavy_tailed_lengths_with_crowded_candidates_keep_labels_apart():
    rng = np.random.default_rng(0)
    lengths = np.ceil(rng.lognormal(4.0, 1.8, 50_000)).astype(np.int64)  # median 55, p99.9 in the tens of thousands
    candidates = [96, 100, 128, 130, 256, 512, 4096, 200_000]  # neighbours a few pixels apart; one past the data
    fig = plots.length_histogram(lengths, candidates)
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_xlim()[1] >= 200_000
    [(ax, labels)] = _labels(fig)
    assert len(labels) == len(candidates)
    _check_apart_and_inside(ax, labels, fig.canvas.get_renderer())
    past = length_distribution(lengths, [200_000])["over"][200_000]["tokens"]
    assert f"200,000\n{past:.1%} of tokens past" in [text for text, _ in labels]


def test_prompt_completion_data_gets_two_panels():
    import datasets

    rng = np.random.default_rng(1)
    words = lambda n: " ".join(["word"] * int(n))  # noqa: E731
    ds = datasets.Dataset.from_dict(
        {
            "prompt": [words(n) for n in rng.lognormal(3, 1, 120)],
            "completion": [words(n) for n in rng.lognormal(2, 1, 120)],
        }
    )
    dm = SeqMemDataModule(ds, max_length=64)
    panels = column_lengths(dm)
    assert set(panels) == {"prompt", "completion"} and panels["prompt"].mean() > panels["completion"].mean()
    fig = plots.length_histogram(panels, [16, 32, 64])
    main = [ax for ax in fig.axes if ax.get_ylabel() == "documents"]
    assert [ax.get_title().split(":")[0] for ax in main] == ["prompt", "completion"]
    assert all(ax.get_xscale() == "log" for ax in main)
    found = _labels(fig)
    assert len(found) == 2
    for ax, labels in found:
        _check_apart_and_inside(ax, labels, fig.canvas.get_renderer())


def test_no_lengths_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one length > 0"):
        plots.length_histogram({"prompt": np.array([0, 0])}, [8])


def test_strategy_chart_shows_the_planners_table():
    lengths = {"train": column_lengths(SeqMemDataModule())["documents"], "validation": np.array([5])}
    plans = plan_strategies(lengths, list(STRATEGIES), [64, 256], BatchingSettings())
    best, _ = recommend_data(plans, 256)
    fig = plots.strategy_bars(plans, (best.strategy, best.max_length))
    efficiency, lost = fig.axes
    assert [t.get_text() for t in efficiency.get_xticklabels()] == [s.spelling for s in STRATEGIES]
    for ax, value in ((efficiency, "token_efficiency"), (lost, "lost_share")):
        heights = sorted(round(p.get_height(), 6) for p in ax.patches)
        assert heights == sorted(round(100 * getattr(p, value), 6) for p in plans)
    hatched = [p for p in efficiency.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_height() == pytest.approx(100 * best.token_efficiency)
    assert "recommended, pack_bfd" in fig._suptitle.get_text()


@pytest.mark.slow
def test_memory_chart_stacks_what_is_live_at_the_peak_under_the_budget():
    from lightning_seqmem.memory.estimate import estimate_training_memory
    from lightning_seqmem.training.building import MODEL_PRESETS, build_model_config

    # one decoder layer: what the chart draws (bars, budget, margin, phases) does not depend on depth
    cfg = build_model_config({**MODEL_PRESETS["tiny_llama"], "num_hidden_layers": 1}, 512, 0)

    @functools.cache  # one trace per shape: the budget below and the planner ask for the same one
    def estimate(rows, length, checkpointing):
        return estimate_training_memory(cfg, rows, length, device="cuda", gradient_checkpointing=checkpointing)

    budget = int(estimate(1, 128, False).peak / 0.9) + 1  # 1 row fits; 2 do not
    memory = plan_memory(estimate, 128, [1, 2], budget=budget, margin=0.1)
    fig = plots.memory_bars(memory)
    off, on = fig.axes
    assert "largest that fits 1" in off.get_title() and "checkpointing on" in on.get_title()
    rows = sorted(memory.estimates[False])
    assert len(off.patches) == 4 * len(rows) + 1  # four categories per bar, and the margin band
    scale = {"(MiB)": 2**20, "(GiB)": 2**30}[off.get_ylabel().split()[-1]]
    tops = {}
    for bar in off.patches[:-1]:
        tops[round(bar.get_x(), 3)] = max(tops.get(round(bar.get_x(), 3), 0), bar.get_y() + bar.get_height())
    assert sorted(tops.values()) == pytest.approx(sorted(memory.estimates[False][r].peak / scale for r in rows))
    [budget_line] = [line for line in off.lines if line.get_label().startswith("budget")]
    assert budget_line.get_ydata()[0] == pytest.approx(budget / scale)
    ticks = [t.get_text() for t in off.get_xticklabels()]
    assert ticks == [f"{r}\n{memory.estimates[False][r].peak_phase}" for r in rows]
    assert sum("too big" in t.get_text() for t in off.texts) == 1  # 2 rows, past the usable budget
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"parameters", "gradients", "optimizer state", "activations"} <= set(legend)
    assert any(text.startswith("margin: 10% of the budget") for text in legend)


@pytest.mark.parametrize("per_job", [False, True])
def test_sweep_training_loss_panels_show_jobs_with_one_point(per_job):
    """Each job logged its training loss once: a line of one point draws nothing, so the panels were empty."""
    from types import SimpleNamespace

    def job(seed):
        val = [{"wall_clock_s": 1.0 + t + seed, "tokens_seen": 100 * (t + 1), "val_loss": 3.0 - t} for t in range(2)]
        train = [{"wall_clock_s": 1.5 + seed, "tokens_seen": 150, "train_loss": 3.2 + seed}]
        return SimpleNamespace(rows=val, train_rows=train, finished=True, status="finished")

    groups = {"a": [job(0)], "b": [job(0.1), job(0.2)]}  # b: the mean over two seeds, also one point
    fig = plots.sweep_curves(groups, "wall_clock_s", target=2.5, per_job=per_job)
    axes = fig.axes
    assert len(axes) == 4
    for ax in axes[2:]:  # the training-loss row
        points = ax.get_lines()  # one point each: every one must be seen
        assert {line.get_color() for line in points} == {"C0", "C1"} and len(points) >= 2, ax.get_ylabel()
        for line in points:
            assert len(line.get_xdata()) == 1
            assert line.get_marker() not in (None, "None", "", " ") and line.get_markersize() > 0
            assert line.get_visible() and np.isfinite(line.get_ydata()).all()
