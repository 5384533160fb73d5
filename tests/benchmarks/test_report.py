"""benchmarks/report.py's Markdown: the header says where, how and how long; the notes point somewhere else."""

from __future__ import annotations

from benchmarks.harness import PHASES
from benchmarks.report import NO_GRAD_NORM, to_markdown

META = {"date": "2026-12-01", "machine": "x86_64, 2 cores, 1 thread(s)/rank", "world_size": 2, "backend": "gloo",
        "repetitions": 5, "command": "python -m benchmarks.run", "wall_s": 930.0}  # fmt: skip


def _ratio(median: float, *, heaviest: str) -> dict:
    return {
        "median": median,
        "min": median,
        "max": median,
        "phase_delta_s": {p: 0.004 * (p == heaviest) for p in PHASES},
    }


def test_an_optimizer_excess_points_to_the_no_grad_norm_row_never_to_itself():
    ratios = {"FULL_SHARD": _ratio(1.08, heaviest="optimizer"), NO_GRAD_NORM: _ratio(1.07, heaviest="optimizer")}
    text = to_markdown({"cases": {}, "overhead_vs_fsdp2_loop": ratios}, META)
    notes = {line.split(":")[0]: line for line in text.splitlines() if "above the 1.05 target" in line}
    assert set(notes) == {"FULL_SHARD", NO_GRAD_NORM}
    assert f"compare {NO_GRAD_NORM}" in notes["FULL_SHARD"] and "compare" not in notes[NO_GRAD_NORM]
    alone = to_markdown({"cases": {}, "overhead_vs_fsdp2_loop": {"FULL_SHARD": ratios["FULL_SHARD"]}}, META)
    assert "compare" not in alone  # a run without that case points nowhere
    assert text.splitlines()[0].endswith("`python -m benchmarks.run` (15.5 min)")
