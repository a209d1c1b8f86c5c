"""The markdown tables of ``seqmem-report``: one row per job, and one row per configuration (mean ± sd over its
seeds) when the sweep varies a seed.

They format what :func:`lightning_seqmem.apps.report.build_report` computed (a plain dict) and compute nothing
themselves, so the numbers have one owner and the tables can change without touching it. Plain Python.
"""

from __future__ import annotations

import math

from lightning_seqmem.apps.sweep_jobs import label

__all__ = ["markdown", "seeds_markdown"]


def _fmt(value, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "x":
        return f"{value:.2f}×"
    if kind == "loss":
        return f"{value:.4f}"
    if kind == "s":
        return f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _pm(mean, sd, kind: str = "") -> str:
    if mean is None:
        return "—"
    if kind == "int":
        return f"{mean:,.0f}" + (f" ± {sd:,.0f}" if sd is not None else "")
    digits = 4 if kind == "loss" else 1
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def seeds_markdown(report: dict) -> str:
    """The per-group table (mean ± sd over seeds); empty when the sweep has no seed dimension."""
    if not report["groups"]:
        return ""
    clock = "wall-clock" if report["clock"] == "wall" else "CPU time"
    head = [
        "configuration",
        "seeds",
        "final val loss",
        f"{clock} to target (s)",
        "tokens to target",
        "speed-up (time)",
        "speed-up (tokens)",
    ]
    lines = [
        f"Mean ± sd over {report['seed_key']} (sample sd) of the finished jobs; times and tokens to target over "
        "those that reached it (k/n reached when not all did). "
        "A gain is *beyond noise* when the means differ by more than twice the standard error of the "
        "difference, else *within noise*.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 1 else "---:" for i in range(len(head))) + "|",
    ]
    for g in report["groups"]:
        reached = f" ({g['reached']}/{g['finished']} reached)" if g["reached"] < g["finished"] else ""

        def speed(what: str) -> str:
            value = g[f"speedup_{what}"]
            if g["baseline"]:
                return "1.00× (baseline)"
            return _fmt(value, "x") + (f" ({g[f'{what}_noise']})" if value is not None else "")

        cells = [
            g["group"] + (" (baseline)" if g["baseline"] else ""),
            f"{g['finished']}/{g['seeds']} finished",
            _pm(g["final_val_loss_mean"], g["final_val_loss_sd"], "loss"),
            _pm(g["time_to_target_s_mean"], g["time_to_target_s_sd"]) + reached,
            _pm(g["tokens_to_target_mean"], g["tokens_to_target_sd"], "int") + reached,
            speed("time"),
            speed("tokens"),
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    """The report in markdown: the target and baseline, the per-configuration table (with seeds), the per-job
    table and the notes (jobs that did not finish, overrides every job shares)."""
    base = report["baseline"]
    if report["target_given"]:
        source = "given"
    elif report["groups"]:
        source = f"the highest final val loss among the baseline's {report['seed_key']}s"
    else:
        source = "baseline's final val loss"
    clock = "wall-clock" if report["clock"] == "wall" else "CPU time"
    head = [
        "job",
        "overrides",
        "status",
        "steps",
        "final val loss",
        f"{clock} (s)",
        "tokens seen",
        "time to target (s)",
        "tokens to target",
        "speed-up (time)",
        "speed-up (tokens)",
    ]
    baseline_text = (
        f"baseline: {next(g['group'] for g in report['groups'] if g['baseline'])}, each job against "
        f"the baseline job of its {report['seed_key']}"
        if report["groups"]
        else f"baseline: job {base.name} ({label(base, report['keys'])})"
    )
    lines = [
        f"Target val loss: **{report['target']:.4f}** ({source}); {baseline_text}. Times are training {clock}, "
        "validation excluded.",
        "",
    ]
    if report["groups"]:
        lines += [seeds_markdown(report), "Every job:", ""]
    lines += [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|",
    ]
    for r in report["rows"]:
        cells = [
            r["job"] + (" (baseline)" if r["baseline"] else ""),
            r["overrides"],
            r["status"],
            _fmt(r["steps"]),
            _fmt(r["final_val_loss"], "loss"),
            _fmt(r["time_s"], "s"),
            _fmt(r["tokens_seen"]),
            _fmt(r["time_to_target_s"], "s") if r["time_to_target_s"] is not None else "not reached",
            _fmt(r["tokens_to_target"]) if r["tokens_to_target"] is not None else "not reached",
            _fmt(r["speedup_time"], "x"),
            _fmt(r["speedup_tokens"], "x"),
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    lines += sources_markdown(report)
    if report["notes"]:
        lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def sources_markdown(report: dict) -> list[str]:
    """A mix's sources: each job's final validation loss per source (none when no job mixed sources)."""
    names = report.get("sources") or []
    if not names:
        return []
    lines = ["", "Final validation loss per source (a Mix: `val/loss/<name>`):", ""]
    lines += ["| job | overrides | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for r in report["rows"]:
        cells = [r["job"], r["overrides"], *(_fmt(r[f"final_val_loss/{n}"], "loss") for n in names)]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return lines
