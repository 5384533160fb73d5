"""What packing buys (issue 47): useful tokens per second and the padding share, packed vs one example per row, and
the held-out perplexity after one epoch, on the app as users run it (``scripts/run fsdp-plus-train``: 2 CPU ranks,
tcmalloc).

* **The shipped experiments** (``experiment=medical_lora``, ``legal_lora``), one epoch each way, at
  ``data.max_seq_len=256`` so that no example is cut (the longest has 222 tokens): one example per row in
  micro-batches of 8 padded to their longest; packed rows of 256 in micro-batches of 4.
* **A wide length spread**: synthetic instruction files (words of the medical set, so the tiny Llama's tokenizer
  reads them as it reads real text) whose examples have 20 to 500 tokens, rows of 512, micro-batches of 8 both ways,
  ``--steps`` steps. Two length distributions: log-uniform (most examples short, a long tail: the shape of real
  instruction sets, whose padding share is 50-70% unpacked) and uniform.

Per case: the padding share and useful (in-loss) tokens per second from each run's ``metrics.json``, their ratio
against the bound ``0.9 / (1 - unpacked padding share)``, and the held-out perplexity. Runs are interleaved,
``--repeats`` times; the table gives medians.

    python -m benchmarks.packing --out outputs/measured/packing [--repeats 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.app_run import run_train

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("medical_lora", "legal_lora")
SPREADS = ("log-uniform", "uniform")
COMMON = ("generate.num_prompts=0", "trainer.enable_progress_bar=false", "validate_before=false")
MODES = {"unpacked": ("data.pack=false",), "packed": ("data.pack=true",)}


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
            record = {"instruction": rng.choice(words), "response": ""}
            while True:  # grow the response a word at a time up to the target's tokens
                size = len(encode_record(record, tokenizer, max_seq_len=10_000)["input_ids"])
                if size >= target:
                    break
                record["response"] = f"{record['response']} {rng.choice(words)}".strip()
            records.append(record)
            if name == "train":
                lengths.append(size)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1], lengths


def cases(out: Path, *, steps: int) -> dict[str, dict[str, list[str]]]:
    """Each case's overrides per mode."""
    shipped = {
        experiment: {mode: [f"experiment={experiment}", "data.max_seq_len=256", "trainer.max_steps=-1",
                            "trainer.max_epochs=1", f"data.batch_size={4 if mode == 'packed' else 8}", *flags]
                     for mode, flags in MODES.items()}
        for experiment in EXPERIMENTS
    }  # fmt: skip
    spread = {}
    for name in SPREADS:
        train, val, _ = synthetic_files(out / "data" / name, spread=name)
        spread[f"spread-{name}"] = {
            mode: ["experiment=medical_lora", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                   "data.max_seq_len=512", "data.batch_size=8", f"trainer.max_steps={steps}",
                   "trainer.limit_val_batches=4", *flags]
            for mode, flags in MODES.items()
        }  # fmt: skip
    return {**shipped, **spread}


FIELDS = ("useful_tokens_per_s", "tokens_per_s", "padding_share", "val_perplexity", "step_time_s_median")


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per case: each mode's medians of :data:`FIELDS`, the useful-throughput gain and the bound it is held to."""
    out = {}
    for case, modes in runs.items():
        med = {mode: {f: statistics.median(r[f] for r in reps) for f in FIELDS} for mode, reps in modes.items()}
        gain = med["packed"]["useful_tokens_per_s"] / med["unpacked"]["useful_tokens_per_s"]
        bound = 0.9 / (1 - med["unpacked"]["padding_share"])
        ppl = med["packed"]["val_perplexity"] / med["unpacked"]["val_perplexity"] - 1
        out[case] = {**med, "gain": gain, "bound": gain / bound, "perplexity_change": ppl}
    return out


def report(summary: dict[str, dict[str, Any]], *, repeats: int) -> str:
    """The results table (markdown)."""
    lines = [
        f"| case | padding, unpacked | padding, packed | useful tokens/s, unpacked | useful tokens/s, packed | gain"
        f" | gain / (0.9 / (1 - padding)) | held-out perplexity, unpacked -> packed | medians of {repeats} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, s in summary.items():
        u, p = s["unpacked"], s["packed"]
        lines.append(f"| {case} | {u['padding_share']:.1%} | {p['padding_share']:.1%} | {u['useful_tokens_per_s']:,.0f}"
                     f" | {p['useful_tokens_per_s']:,.0f} | {s['gain']:.2f}x | {s['bound']:.2f} |"
                     f" {u['val_perplexity']:.3f} -> {p['val_perplexity']:.3f} ({s['perplexity_change']:+.1%}) | |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run every case both ways, interleaved; write ``results.json`` and ``results.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "measured" / "packing")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="steps of the wide-spread runs")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    plan = cases(args.out, steps=args.steps)
    plan = {k: v for k, v in plan.items() if not args.only or k in args.only}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {case: {m: [] for m in MODES} for case in plan}
    for repeat in range(args.repeats):
        for case, modes in plan.items():
            for mode, overrides in modes.items():
                metrics = run_train([*overrides, *COMMON], out=args.out / f"{case}-{mode}-{repeat}")
                runs[case][mode].append({f: metrics[f] for f in FIELDS})
                print(case, mode, {f: metrics[f] for f in FIELDS}, flush=True)
    summary = summarize(runs)
    (args.out / "results.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    (args.out / "results.md").write_text(report(summary, repeats=args.repeats))
    print(report(summary, repeats=args.repeats))


if __name__ == "__main__":
    sys.exit(main())
