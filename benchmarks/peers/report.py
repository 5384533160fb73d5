"""``docs/measured/peers.md`` and its plot, generated from ``benchmarks/results/peers.json`` (never typed)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.peers.plan import REPO

PAGE = REPO / "docs" / "measured" / "peers.md"
PLOT = REPO / "docs" / "measured" / "peers.svg"


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per system (in first-seen order), the medians of its successful runs' figures and their count."""
    by_system: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_system.setdefault(run["system"], []).append(run)
    figures = ("useful_tokens_per_s", "peak_rss_added_mb", "heldout_loss", "step_s_median")
    result = {}
    for system, rows in by_system.items():
        ok = [r for r in rows if "error" not in r]
        result[system] = {
            "runs": len(ok),
            "failed": len(rows) - len(ok),
            **{f: statistics.median(r[f] for r in ok) for f in figures if ok},
        }
    return result


def conditions(results: dict[str, Any]) -> list[str]:
    """The paragraph above the tables: what every system trained and how it was measured."""
    s = results["settings"]
    return [
        f"Measured {results['machine']}: `{results['command'].strip()}`.",
        "",
        f"Every system trains the same {s['steps']} steps of the same tokenized examples in the same order"
        f" ({s['examples']} shipped medical examples through the model's chat template, prompt out of the loss,"
        f" {s['per_rank_batch']} a rank on {s['ranks']} ranks: a global batch of"
        f" {s['per_rank_batch'] * s['ranks']}, each micro-batch padded to its longest), base `{s['base']}`,"
        f" LoRA r={s['lora_r']} alpha={s['lora_alpha']} dropout={s['lora_dropout']} on"
        f" {', '.join(s['target_modules'])}, AdamW lr {s['lr']} betas {tuple(s['betas'])} eps {s['eps']} weight decay"
        f" {s['weight_decay']}, {s['schedule']} schedule, no clipping, {s['precision']}. Useful tokens/s: tokens in the"
        f" loss per second per rank over the steps after the first {s['warmup']}; peak memory added: the highest"
        " resident memory of a process above its own after imports and before the model loads; held-out loss: the"
        f" {s['heldout_examples']} held-out examples, one evaluator for every adapter. Rounds run every system once,"
        " in turn; medians over the rounds.",
    ]


def table(results: dict[str, Any]) -> list[str]:
    """The medians per system, then every run."""
    runs = results["runs"]
    lines = [
        "| system | runs | useful tokens/s a rank | step (s) | peak memory added (MB) | held-out loss |",
        "|---|---|---|---|---|---|",
    ]
    labels = {r["system"]: r["label"] for r in runs}
    for system, m in medians(runs).items():
        if not m["runs"]:
            lines.append(f"| {labels[system]} | 0 of {m['failed']} | - | - | - | - |")
            continue
        lines.append(
            f"| {labels[system]} | {m['runs']} | {m['useful_tokens_per_s']:.1f} | {m['step_s_median']:.2f} |"
            f" {m['peak_rss_added_mb']:.0f} | {m['heldout_loss']:.4f} |"
        )
    lines += [
        "",
        "Every run:",
        "",
        "| round | system | how it ran | useful tokens/s | step (s) | memory added (MB) | held-out loss |"
        " same batches as the plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['round']} | {r['label']} | could not run: {r['error']} | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['round']} | {r['label']} | {r['setting']['distributed']} | {r['useful_tokens_per_s']:.1f}"
            f" | {r['step_s_median']:.2f} | {r['peak_rss_added_mb']:.0f} | {r['heldout_loss']:.4f} |"
            f" {'yes' if r['same_batches_as_plan'] else 'NO'} |"
        )
    return lines


def plot(results: dict[str, Any], path: Path = PLOT) -> Path:
    """Bars of the medians: useful tokens/s a rank and peak memory added, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = {s: v for s, v in medians(results["runs"]).items() if v["runs"]}
    labels = {r["system"]: r["label"] for r in results["runs"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(m) + 1.5))
    names = [labels[s] for s in m]
    axes[0].barh(names, [v["useful_tokens_per_s"] for v in m.values()])
    axes[0].set_xlabel("useful tokens/s a rank (median)")
    axes[1].barh(names, [v["peak_rss_added_mb"] for v in m.values()])
    axes[1].set_xlabel("peak memory added a process, MB (median)")
    axes[1].set_yticks([])
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def page(results: dict[str, Any]) -> str:
    """The whole docs page."""
    lines = [
        "# Side by side: ours, TRL + PEFT + Accelerate, Lightning's ModelParallelStrategy, plain PEFT",
        "",
        "Generated by `python -m benchmarks.peers` from `benchmarks/results/peers.json`; never edited by hand.",
        "",
        *conditions(results),
        "",
        f"![medians]({PLOT.name})",
        "",
        *table(results),
    ]
    return "\n".join(lines) + "\n"


def render(results: dict[str, Any]) -> None:
    """Write the page and its plot."""
    plot(results)
    PAGE.write_text(page(results))
    print(f"wrote {PAGE} and {PLOT}")
