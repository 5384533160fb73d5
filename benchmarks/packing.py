"""What packing buys (issue 47): useful tokens per second and the padding share, packed vs one example per row, and
the held-out perplexity after one epoch, on the app as users run it (``scripts/run fsdp-plus-train``: 2 CPU ranks,
tcmalloc).

* **The shipped experiments** (``experiment=medical_lora``, ``legal_lora``) at ``data.max_seq_len=256``, so that no
  example is cut (the longest has 222 tokens), one epoch a run. One example per row: micro-batches of 8, padded to
  their longest. Packed: rows of 256, two ways:

  - *throughput*: as many rows per micro-batch as the unpacked micro-batch has positions on average (the same
    memory and work a step: ``round(8 x E[longest of 8] / 256)``, from the data's lengths);
  - *one epoch*: as many rows per optimizer step as hold the unpacked step's 16 examples (``16 / examples per
    row``, rounded to whole micro-batches on 2 ranks): the same training per step, so the held-out perplexity after
    one epoch compares the models and not the number of optimizer steps.

* **A wide length spread**: synthetic instruction files (words of the medical set, so the tiny Llama's tokenizer
  reads them as it reads real text) whose examples have 20 to 500 tokens, rows of 512, ``--steps`` steps,
  micro-batches of 8 unpacked and of the same positions packed. Two length distributions: log-uniform (most
  examples short, a long tail: the shape of real instruction sets, whose padding share is 50-70% unpacked) and
  uniform.

Per case: the padding share and useful (in-loss) tokens per second from each run's ``metrics.json``, medians over
``--repeats`` interleaved runs, the gain against the bound ``0.9 / (1 - unpacked padding share)``, and the held-out
perplexity (deterministic: one run). The gain is measured in useful tokens per CPU-second of a rank (each rank's
process CPU time per step): on a shared virtual machine the wall clock also counts the time the hypervisor gives
other guests (steal: 13-40% of this machine's time while it was measured, so that wall-clock step times of the same
run varied by 2x); the wall-clock gain is reported beside it.

    python -m benchmarks.packing --out outputs/measured/packing [--repeats 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.app_run import run_train

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("medical_lora", "legal_lora")
SPREADS = ("log-uniform", "uniform")
COMMON = ("generate.num_prompts=0", "trainer.enable_progress_bar=false", "validate_before=false")


def synthetic_files(out: Path, *, spread: str, n: int = 480, seed: int = 0) -> tuple[Path, Path, list[int]]:
    """Train and held-out JSONL files of ``n`` and ``n // 8`` instruction records whose tokenized lengths run from
    20 to 500 (``spread``: log-uniform or uniform); returns them and the training lengths."""
    from lightning_fsdp_plus.app.data import encode_record
    from lightning_fsdp_plus.app.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(REPO / "examples" / "assets" / "tiny-llama"))
    text = (REPO / "examples" / "medical_lora" / "data" / "train.jsonl").read_text()
    words = re.findall(r"[A-Za-z]+", " ".join(json.loads(line)["response"] for line in text.splitlines()))
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths, lengths = [], []
    for name, count in (("train", n), ("val", n // 8)):
        records = []
        for _ in range(count):
            target = round(math.exp(rng.uniform(math.log(20), math.log(500)))) if spread == "log-uniform" else (
                rng.randint(20, 500))  # fmt: skip
            record = {"instruction": rng.choice(words), "response": rng.choice(words)}
            while True:  # grow the response a word at a time up to the target's tokens
                size = len(encode_record(record, tokenizer, max_seq_len=10_000)["input_ids"])
                if size >= target:
                    break
                record["response"] += f" {rng.choice(words)}"
            records.append(record)
            if name == "train":
                lengths.append(size)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1], lengths


def training_lengths(train_file: Path, *, max_seq_len: int) -> list[int]:
    """The tokenized lengths of a training file's examples, as the app tokenizes them."""
    from lightning_fsdp_plus.app.data import InstructionDataModule

    data = InstructionDataModule(tokenizer=str(REPO / "examples" / "assets" / "tiny-llama"),
                                 train_files=[str(train_file)], val_files=[str(train_file)],
                                 max_seq_len=max_seq_len)  # fmt: skip
    return [len(r["input_ids"]) for r in data.train_set.rows]


def same_positions(lengths: list[int], *, batch: int, row_len: int, seed: int = 0) -> int:
    """Packed rows per micro-batch with the positions of an unpacked micro-batch of ``batch`` examples padded to
    their longest (the mean over 1,000 random batches)."""
    rng = random.Random(seed)
    widest = statistics.mean(max(rng.sample(lengths, batch)) for _ in range(1000))
    return max(1, round(batch * widest / row_len))


def same_examples(lengths: list[int], *, examples_per_step: int, row_len: int, world: int = 2) -> int:
    """Packed rows per micro-batch (on ``world`` ranks) whose optimizer step holds about ``examples_per_step``."""
    from lightning_fsdp_plus.app.packing import pack_rows

    per_row = len(lengths) / len(pack_rows(lengths, row_len=row_len))
    return max(1, round(examples_per_step / per_row / world))


def cases(out: Path, *, steps: int) -> dict[str, dict[str, list[str]]]:
    """Each case's overrides per mode (``unpacked``, ``packed``, and for the shipped experiments ``epoch``: packed
    rows holding the unpacked step's examples)."""
    plan = {}
    for experiment in EXPERIMENTS:
        lengths = training_lengths(REPO / "examples" / experiment / "data" / "train.jsonl", max_seq_len=256)
        common = [f"experiment={experiment}", "data.max_seq_len=256", "trainer.max_steps=-1", "trainer.max_epochs=1"]
        plan[experiment] = {
            "unpacked": [*common, "data.pack=false", "data.batch_size=8"],
            "packed": [*common, "data.pack=true", f"data.batch_size={same_positions(lengths, batch=8, row_len=256)}"],
            "epoch": [*common, "data.pack=true",
                      f"data.batch_size={same_examples(lengths, examples_per_step=16, row_len=256)}"],
        }  # fmt: skip
    for spread in SPREADS:
        train, val, lengths = synthetic_files(out / "data" / spread, spread=spread)
        common = ["experiment=medical_lora", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                  "data.max_seq_len=512", f"trainer.max_steps={steps}", "trainer.limit_val_batches=4"]  # fmt: skip
        plan[f"spread-{spread}"] = {
            "unpacked": [*common, "data.pack=false", "data.batch_size=8"],
            "packed": [*common, "data.pack=true", f"data.batch_size={same_positions(lengths, batch=8, row_len=512)}"],
        }
    return plan


FIELDS = ("useful_tokens_per_s", "useful_tokens_per_cpu_s", "tokens_per_s", "padding_share", "val_perplexity",
          "step_time_s_median", "step_cpu_s_median", "global_batch_size")  # fmt: skip


def overrides_value(overrides: list[str], key: str) -> str:
    """The value ``key=`` has in ``overrides``."""
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}="))


def summarize(plan: dict[str, dict[str, list[str]]], runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict:
    """Per case: each mode's medians of :data:`FIELDS`, the useful-throughput gain and the bound it is held to, and
    the held-out perplexity change (the ``epoch`` run's where there is one)."""
    out = {}
    for case, modes in runs.items():
        med = {mode: {f: statistics.median(r[f] for r in reps) for f in FIELDS} for mode, reps in modes.items() if reps}
        gain = med["packed"]["useful_tokens_per_cpu_s"] / med["unpacked"]["useful_tokens_per_cpu_s"]
        wall_gain = med["packed"]["useful_tokens_per_s"] / med["unpacked"]["useful_tokens_per_s"]
        bound = 0.9 / (1 - med["unpacked"]["padding_share"])
        compared = med.get("epoch", med["packed"])
        out[case] = {**med, "gain": gain, "wall_gain": wall_gain, "bound": bound, "gain_over_bound": gain / bound,
                     "perplexity_change": compared["val_perplexity"] / med["unpacked"]["val_perplexity"] - 1,
                     "batch": {mode: int(overrides_value(o, "data.batch_size")) for mode, o in plan[case].items()},
                     "runs": {mode: len(reps) for mode, reps in modes.items()}}  # fmt: skip
    return out


def report(summary: dict[str, dict[str, Any]]) -> str:
    """The results table (markdown)."""
    lines = [
        "| case | micro-batch: unpacked / packed (/ one epoch) | padding, unpacked -> packed | useful tokens per"
        " CPU-second of a rank, unpacked -> packed | gain | bound 0.9 / (1 - padding) | gain / bound | gain in"
        " wall-clock useful tokens/s | held-out perplexity, unpacked -> packed | runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, s in summary.items():
        u, p = s["unpacked"], s["packed"]
        e = s.get("epoch", p)
        batches = " / ".join(str(b) for b in s["batch"].values())
        lines.append(f"| {case} | {batches} | {u['padding_share']:.1%} -> {p['padding_share']:.1%} |"
                     f" {u['useful_tokens_per_cpu_s']:,.0f} -> {p['useful_tokens_per_cpu_s']:,.0f} | {s['gain']:.2f}x |"
                     f" {s['bound']:.2f}x | {s['gain_over_bound']:.2f} | {s['wall_gain']:.2f}x |"
                     f" {u['val_perplexity']:.3f} ->"
                     f" {e['val_perplexity']:.3f} ({s['perplexity_change']:+.1%}) |"
                     f" {'/'.join(str(n) for n in s['runs'].values())} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run every case's modes, interleaved; write ``results.json`` and ``results.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "measured" / "packing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps of the wide-spread runs")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--report", action="store_true", help="only rewrite results.md from --out's results.json")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads((args.out / "results.json").read_text())
        write_report(args.out, summarize(saved["plan"], saved["runs"]), repeats=args.repeats,
                     wall_s=saved.get("wall_s"))  # fmt: skip
        return
    started = time.perf_counter()
    plan = cases(args.out, steps=args.steps)
    plan = {k: v for k, v in plan.items() if not args.only or k in args.only}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {case: {m: [] for m in modes} for case, modes in plan.items()}
    for repeat in range(args.repeats):
        for case, modes in plan.items():
            for mode, overrides in modes.items():
                if mode == "epoch" and repeat:
                    continue  # its figure is the perplexity: deterministic
                metrics = run_train([*overrides, *COMMON], out=args.out / f"{case}-{mode}-{repeat}")
                runs[case][mode].append({f: metrics[f] for f in FIELDS})
                print(case, mode, {f: metrics[f] for f in FIELDS}, flush=True)
    summary = summarize(plan, runs)
    wall_s = time.perf_counter() - started
    saved = {"plan": plan, "runs": runs, "summary": summary, "wall_s": wall_s}
    (args.out / "results.json").write_text(json.dumps(saved, indent=1))
    write_report(args.out, summary, repeats=args.repeats, wall_s=wall_s)


def write_report(out: Path, summary: dict[str, dict[str, Any]], *, repeats: int, wall_s: float | None) -> None:
    """``results.md``: where, when and how it was measured, then the table."""
    import datetime
    import os
    import platform

    import torch

    took = f", {wall_s / 60:.0f} min" if wall_s else ""
    head = (f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()},"
            f" {os.cpu_count()} cores, torch {torch.__version__}, 2 CPU ranks under tcmalloc, with"
            f" `python -m benchmarks.packing --repeats {repeats}`{took}.\n\n")  # fmt: skip
    (out / "results.md").write_text(head + report(summary))
    print(head + report(summary))


if __name__ == "__main__":
    sys.exit(main())
