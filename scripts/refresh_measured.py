"""Measure the documentation's measured figures again and rewrite them in place (before a release; minutes, not CI).

    python scripts/refresh_measured.py sweep        # fsdp-plus-train sweep=sharding: the sweep table (~2 min)
    python scripts/refresh_measured.py examples     # the medical and legal LoRA experiments: their table (~3 min)
    python scripts/refresh_measured.py benchmark    # python -m benchmarks.run: the performance tables (~30 min)
    python scripts/refresh_measured.py loading      # python -m benchmarks.loading: the loading tables (~10 min)
    python scripts/refresh_measured.py autoplan     # python -m benchmarks.autoplan: predicted vs measured (~4 min)
    python scripts/refresh_measured.py published    # python -m benchmarks.published: ours vs published runs (~5 min)
    python scripts/refresh_measured.py vocab        # python -m benchmarks.vocab_memory: 128k/152k runs (~40 min)
    python scripts/refresh_measured.py packing      # python -m benchmarks.packing: packed vs unpacked (~25 min)
    python scripts/refresh_measured.py tensor_parallel  # python -m benchmarks.tensor_parallel: TP vs FSDP (~4 min)
    python scripts/refresh_measured.py real_model   # python -m benchmarks.real_model: SmolLM2 fine-tunes (~35 min)
                                                    # (also the README's main-job paragraph)
    python scripts/refresh_measured.py real_model_packing  # ... --packing: one epoch packed vs not, 3 seeds (~25 min)
    python scripts/refresh_measured.py benchmark --from outputs/benchmarks/run   # a finished run's results.md

Each block sits between ``<!-- measured:NAME:start -->`` and ``<!-- measured:NAME:end -->`` in its page of
``docs/measured/`` and opens with the date, the machine and the command that measured it, so a figure can neither
drift from the code that produces it nor lose where it came from. Outputs go under ``outputs/measured/``
(``--from DIR`` reuses them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

from render_docs import DOCS, REPO, replace_block

OUT = REPO / "outputs" / "measured"
EXAMPLES = ("medical_lora", "legal_lora")
"""The example experiments the examples table compares, in its column order."""


def machine() -> str:
    """Where the figures were measured: date, CPU (or the GPU the benchmark names), cores, torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{date.today().isoformat()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def run(command: list[str]) -> float:
    """Run ``command`` from the repository root (its output streams through); its wall time in seconds."""
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    return time.perf_counter() - started


def sweep_block(sweep_dir: Path, *, wall_s: float | None, command: str) -> str:
    """The sweep table (the sweep's own ``sweep_summary.md``), headed by where and how it was measured."""
    took = f", {_duration(wall_s)}" if wall_s is not None else ""
    table = (sweep_dir / "sweep_summary.md").read_text().strip()
    return f"Measured {machine()}: `{command}`{took}.\n\n{table}\n"


def examples_block(sweep_dir: Path, *, wall_s: float | None, command: str) -> str:
    """The medical/legal table from the experiments' ``metrics.json`` (and their data files' sizes)."""
    from omegaconf import OmegaConf

    jobs = sorted(
        (p for p in sweep_dir.iterdir() if (p / "metrics.json").is_file()), key=lambda p: int(p.name.split("_")[0])
    )
    if len(jobs) != len(EXAMPLES):
        raise SystemExit(
            f"{sweep_dir}: expected {len(EXAMPLES)} finished jobs ({', '.join(EXAMPLES)}), found {len(jobs)}"
        )
    rows = {"data": [], "rows": [], "perplexity": [], "time": [], "tokens": []}
    for name, job in zip(EXAMPLES, jobs, strict=True):
        metrics = json.loads((job / "metrics.json").read_text())
        steps = OmegaConf.load(job / ".hydra" / "config.yaml").trainer.max_steps
        data = REPO / "examples" / name / "data"
        train, val = (sum(1 for line in (data / f).open() if line.strip()) for f in ("train.jsonl", "val.jsonl"))
        rows["data"].append(f"`examples/{name}/data/`: {train} train, {val} held-out")
        config = OmegaConf.load(job / ".hydra" / "config.yaml").get("data", {})
        packed = "packed into" if config.get("pack") else "one example per row of up to"
        rows["rows"].append(f"{packed} {config.get('max_seq_len', '?')} tokens, {config.get('batch_size', '?')} a rank")
        before, after = metrics["base_val_perplexity"], metrics["val_perplexity"]
        rows["perplexity"].append(f"{before:.2f} -> {after:.2f} ({after / before - 1:+.0%}) after {steps} steps")
        rows["time"].append(f"{metrics['fit_time_s']:.0f} s")
        rows["tokens"].append(
            f"{metrics['useful_tokens_per_s']:,.0f} ({metrics['padding_share']:.1%} padding)"
            if "useful_tokens_per_s" in metrics
            else "-"
        )
    took = f", {_duration(wall_s)} in all" if wall_s is not None else ""
    lines = [
        f"Measured {machine()}: `{command}`{took}.",
        "",
        "| | " + " | ".join(f"`experiment={name}`" for name in EXAMPLES) + " |",
        "|---|" + "---|" * len(EXAMPLES),
        "| data | " + " | ".join(rows["data"]) + " |",
        "| training rows | " + " | ".join(rows["rows"]) + " |",
        "| held-out perplexity, base -> trained | " + " | ".join(rows["perplexity"]) + " |",
        f"| training time ({metrics['world_size']} CPU processes) | " + " | ".join(rows["time"]) + " |",
        "| useful (in-loss) tokens per second | " + " | ".join(rows["tokens"]) + " |",
    ]
    return "\n".join(lines) + "\n"


def benchmark_block(results_dir: Path, *, wall_s: float | None, command: str) -> str:
    """A benchmark's own report (``results.md``: machine, date and command in its first lines)."""
    del wall_s, command  # the report states its command and wall time itself
    return (results_dir / "results.md").read_text().strip() + "\n"


TARGETS: dict[str, tuple[str, list[str], Callable[..., str]]] = {
    "sweep": (
        "measured/examples.md",
        ["-m", "lightning_fsdp_plus.app.train", "sweep=sharding", "trainer.enable_progress_bar=false"],
        sweep_block,
    ),
    "examples": (
        "measured/examples.md",
        [
            "-m",
            "lightning_fsdp_plus.app.train",
            "-m",
            "experiment=" + ",".join(EXAMPLES),
            "trainer.enable_progress_bar=false",
        ],
        examples_block,
    ),
    "benchmark": ("measured/performance.md", ["-m", "benchmarks.run"], benchmark_block),
    "loading": ("measured/loading.md", ["-m", "benchmarks.loading"], benchmark_block),
    "autoplan": ("measured/autoplan.md", ["-m", "benchmarks.autoplan"], benchmark_block),
    "published": ("measured/published.md", ["-m", "benchmarks.published"], benchmark_block),
    "vocab": ("measured/vocab.md", ["-m", "benchmarks.vocab_memory"], benchmark_block),
    "packing": ("measured/examples.md", ["-m", "benchmarks.packing"], benchmark_block),
    "tensor_parallel": ("measured/performance.md", ["-m", "benchmarks.tensor_parallel"], benchmark_block),
    "real_model": ("measured/real-model.md", ["-m", "benchmarks.real_model"], benchmark_block),
    "real_model_packing": ("measured/real-model.md", ["-m", "benchmarks.real_model", "--packing"], benchmark_block),
}
"""Each block's page in ``docs/``, what it runs (arguments to ``python``) and how its output becomes the block."""


def refresh(name: str, *, source: Path | None = None, docs: Path = DOCS) -> str:
    """Measure ``name`` (or read ``source``, a finished output directory) and rewrite its block in its page."""
    page, arguments, make = TARGETS[name]
    out = source if source is not None else OUT / name
    command = "python " + " ".join(a for a in arguments if a != "trainer.enable_progress_bar=false")
    wall_s = None
    if source is None:
        where = f"hydra.sweep.dir={out}" if arguments[1] == "lightning_fsdp_plus.app.train" else f"--out={out}"
        wall_s = run([sys.executable, *arguments, where])
    block = make(
        out, wall_s=wall_s, command=command.replace("python -m lightning_fsdp_plus.app.train", "fsdp-plus-train")
    )
    path = docs / page
    path.write_text(replace_block(path.read_text(), f"measured:{name}", block, where=f"docs/{page}"))
    if name == "real_model":  # the README's main-job paragraph, from the same results
        sys.path.insert(0, str(REPO))
        from benchmarks.real_model import readme_block

        readme = docs.parent / "README.md"
        results = json.loads((out / "results.json").read_text())
        block_text = readme_block(results)
        readme.write_text(replace_block(readme.read_text(), "measured:main_job", block_text, where="README.md"))
    return block


def main(argv: list[str] | None = None) -> int:
    """Refresh the named blocks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("blocks", nargs="+", choices=sorted(TARGETS))
    parser.add_argument("--from", dest="source", type=Path, help="a finished output directory (one block only)")
    args = parser.parse_args(argv)
    if args.source is not None and len(args.blocks) != 1:
        parser.error("--from reads one block's output: name exactly one block")
    for name in args.blocks:
        print(refresh(name, source=args.source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
