"""What the chunked causal-LM loss costs a step on the shipped examples (issue 44): the medical and legal LoRA
experiments as users run them (``scripts/run fsdp-plus-train experiment=...``: 2 CPU ranks, tcmalloc), with the
chunked loss (the default) and with the model's own (``model.chunked_loss=false``), interleaved, ``--repeats``
times each. Per run it reads the median step time from ``metrics.json``; the table gives each pair's medians and
their ratio.

    python -m benchmarks.loss_step_time --out outputs/measured/loss_step_time [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.app_run import run_train

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("medical_lora", "legal_lora")
LOSSES = {"chunked": "true", "model's own": "false"}


def run_once(*, experiment: str, chunked: str, steps: int, out: Path) -> float:
    """One run's median step time (seconds)."""
    overrides = [f"experiment={experiment}", f"model.chunked_loss={chunked}", f"trainer.max_steps={steps}",
                 "generate.num_prompts=0", "trainer.enable_progress_bar=false"]  # fmt: skip
    return float(run_train(overrides, out=out)["step_time_s_median"])


def main(argv: list[str] | None = None) -> None:
    """Run the pairs interleaved and write ``results.json`` and ``results.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "loss_step_time")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    times: dict[str, dict[str, list[float]]] = {e: {k: [] for k in LOSSES} for e in EXPERIMENTS}
    for repeat in range(args.repeats):
        for experiment in EXPERIMENTS:
            for name, flag in LOSSES.items():
                out = args.out / f"{experiment}-{flag}-{repeat}"
                times[experiment][name].append(run_once(experiment=experiment, chunked=flag, steps=args.steps, out=out))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(times, indent=1))
    (args.out / "results.md").write_text(report(times, steps=args.steps))
    print(report(times, steps=args.steps))


def report(times: dict[str, dict[str, list[float]]], *, steps: int) -> str:
    """Medians per experiment and loss, and the chunked loss's ratio."""
    lines = [f"| experiment | chunked loss, s/step | model's own loss, s/step | ratio | runs ({steps} steps each) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for experiment, pair in times.items():
        chunked, own = (statistics.median(pair[k]) for k in LOSSES)
        runs: Any = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(*pair.values(), strict=True))
        lines.append(f"| {experiment} | {chunked:.3f} | {own:.3f} | {chunked / own:.3f} | {runs} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
