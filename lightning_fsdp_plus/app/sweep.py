"""Sweep summary: one row per job's ``metrics.json``, written as CSV, Markdown and a PNG bar chart.

Runs automatically at the end of a multirun (``SweepSummary``, a Hydra callback set in
``conf/hydra/default.yaml``) and by hand: ``python -m lightning_fsdp_plus.app.sweep SWEEP_DIR``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

COLUMNS = (
    "job",
    "strategy_preset",
    "sharding_strategy",
    "world_size",
    "peak_bytes_per_rank",
    "model_state_bytes_per_rank",
    "step_time_s_median",
    "tokens_per_s",
    "train_loss",
    "val_loss",
    "val_perplexity",
)
"""Columns of the summary, in order."""
CHARTED = (
    ("peak_bytes_per_rank", "peak bytes / rank"),
    ("model_state_bytes_per_rank", "model-state bytes / rank"),
    ("step_time_s_median", "step time (s, median)"),
    ("val_loss", "validation loss"),
)


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory that holds a ``metrics.json``, in job order."""
    rows = []
    for path in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: _job_number(p.parent.name)):
        metrics = json.loads(path.read_text())
        row = {"job": path.parent.name, **{k: metrics.get(k) for k in COLUMNS if k != "job"}}
        rows.append({**row, "overrides": metrics.get("overrides") or []})
    return rows


def job_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Short labels: the overrides that differ between jobs (else the job directory name)."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    labels = [",".join(o for o in r["overrides"] if o not in common) for r in rows]
    return [label or r["job"] for label, r in zip(labels, rows, strict=True)]


def _job_number(name: str) -> tuple[int, str]:
    head = name.split("_", 1)[0]
    return (int(head), name) if head.isdigit() else (sys.maxsize, name)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def write_summary(sweep_dir: str | Path) -> list[Path]:
    """Write ``sweep_summary.csv``, ``.md`` and ``.png`` into ``sweep_dir``; returns their paths."""
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir)
    if not rows:
        raise FileNotFoundError(f"no */{'metrics.json'} under {sweep_dir}: did any job finish?")
    csv_path, md_path, png_path = (sweep_dir / f"sweep_summary.{ext}" for ext in ("csv", "md", "png"))
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    _plot(rows, png_path)
    return [csv_path, md_path, png_path]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = job_labels(rows)
    fig, axes = plt.subplots(1, len(CHARTED), figsize=(4.2 * len(CHARTED), 3.6))
    for ax, (key, title) in zip(axes, CHARTED, strict=True):
        values = [float(r[key]) if r[key] is not None else 0.0 for r in rows]
        ax.bar(range(len(rows)), values, color="#4C72B0")
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SweepSummary(Callback):
    """Hydra callback: writes the sweep summary when a multirun ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Summarise the jobs that wrote metrics (failed jobs are left out)."""
        try:
            paths = write_summary(config.hydra.sweep.dir)
        except FileNotFoundError as err:
            print(f"sweep summary: {err}", file=sys.stderr)
            return
        print(f"sweep summary: {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    for directory in sys.argv[1:] or ["."]:
        print("\n".join(map(str, write_summary(directory))))
