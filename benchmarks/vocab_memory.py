"""Memory at the vocabularies people fine-tune (issue 44): Llama-3- and Qwen2.5-shaped models on 2 CPU ranks.

Each run is the Hydra app as users run it (``scripts/run fsdp-plus-train``: tcmalloc preloaded, 2 CPU processes,
the shipped medical instruction set, batch 8 x up to 128 tokens, padded, FULL_SHARD), on a model built from a config
and saved as bf16 safetensors (built on meta and read per rank, as a real checkpoint). Per run it records:

* **added**: the process memory the run adds over the same run on the shipped tiny Llama — the largest ``RssAnon``
  peak of a rank over the training steps (``benchmarks.memory_phases.PhaseMemory``), minus the tiny run's;
* **estimate**: the estimator's real peak (``--platform cpu-tcmalloc``, batch 8 x 128 padded), minus its figure for
  the tiny model (the same subtraction);
* **traced**: the live tensor bytes at the traced step's peak (``benchmarks.memory_trace.AllocationTrace``: what the
  step allocated at its peak plus the model state alive when it began) beside the estimator's live peak;
* **step**: the median step time from ``metrics.json``.

``--layout before`` reproduces the layout and loss of the release before issue 44 on today's code (the root holds
embeddings and head: ``auto_wrap_policy`` = the decoder layer class only; the model's own loss:
``model.chunked_loss=false``), for the "<= 0.6x what main adds" comparison.

    python -m benchmarks.vocab_memory --out benchmarks/results/vocab [--models llama3 qwen25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.app_run import run_train

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "assets" / "tiny-llama"

MODELS: dict[str, dict[str, Any]] = {
    # Llama 3's vocabulary and GQA (8 query heads per 2 key/value heads), untied: 140M parameters
    "llama3": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 512, "intermediate_size": 1408,
               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
               "tie_word_embeddings": False, "max_position_embeddings": 256, "rope_theta": 500000.0},
    # Qwen 2.5's vocabulary, tied embeddings as the small Qwens have, q/k/v biases: 131M parameters
    "qwen25": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 768, "intermediate_size": 2048,
               "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 2,
               "tie_word_embeddings": True, "max_position_embeddings": 256},
}  # fmt: skip
"""The shapes measured (small hidden sizes keep a CPU step short; the vocabulary is what is being measured)."""

RUNS: dict[str, list[str]] = {
    "lora_int8": ["strategy=lora_int8_sharded"],
    "lora_nf4": ["strategy=lora_nf4_sharded", "strategy.quantize_blocksize=64"],
    "full": ["strategy=full_shard", "strategy.lora=null", "model.lr=1e-4"],  # the experiment's LoRA block off
}
"""The fine-tunes: LoRA r16 on an int8 base, on an NF4 base, and a full fine-tune; each FULL_SHARD."""

LAYER_CLASSES = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def build_model(name: str, directory: Path) -> Path:
    """The model saved as bf16 safetensors under ``directory/name`` (built once; random weights, fixed seed)."""
    target = directory / name
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True, max_shard_size="100MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the shipped byte-level tokenizer: ids < 512 <= vocab
        shutil.copy(TINY / name, target / name)
    return target


def run_app(*, model_dir: Path, run: str, layout: str, checkpointing: bool, out: Path, steps: int) -> dict[str, Any]:
    """One training run through ``scripts/run fsdp-plus-train``; its memory phases, trace and metrics."""
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    overrides = [
        "experiment=medical_lora", f"model.name_or_path={model_dir}", "model.torch_dtype=float32",
        *RUNS[run], "precision=32_true", f"trainer.max_steps={steps}", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1", "trainer.gradient_clip_val=1.0", "generate.num_prompts=0",
        "+callbacks.phases._target_=benchmarks.memory_phases.PhaseMemory", f"+callbacks.phases.out={out}",
        "+callbacks.trace._target_=benchmarks.memory_trace.AllocationTrace", f"+callbacks.trace.out={out}",
    ]  # fmt: skip
    if checkpointing:
        overrides.append("strategy.activation_checkpointing=auto")
    if layout == "before":
        overrides += [f"strategy.auto_wrap_policy=[{LAYER_CLASSES[model_type]}]", "model.chunked_loss=false"]
    metrics = run_train(overrides, out=out)
    phases = [json.loads(p.read_text()) for p in sorted(out.glob("phases.rank*.json"))]
    traces = [json.loads(p.read_text()) for p in sorted(out.glob("trace.rank*.json"))]
    training = [[r for r in rows if r["phase"].startswith("step")] for rows in phases]
    peak = max(r["peak_anon_since_last"] for rows in training for r in rows)
    start = [next(r for r in rows if r["phase"] == "step 1: after optimizer step") for rows in phases]
    traced = max(t["peak_bytes"] + s["tensors_model_state"] for t, s in zip(traces, start, strict=True))
    return {"rss_peak": peak, "traced_live": traced, "step_s": metrics.get("step_time_s_median"), "metrics": metrics}


def estimate(*, model_dir: Path, run: str, layout: str, checkpointing: bool) -> dict[str, Any]:
    """The estimator's figures for the run's configuration (cpu-tcmalloc, batch 8 x 128 padded)."""
    from lightning_fsdp_plus.memory.allocator import PLATFORMS
    from lightning_fsdp_plus.memory.estimate import estimate_memory

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    fields: dict[str, Any] = {}
    if run != "full":
        fields = {"lora": {"r": 16, "alpha": 32, "dropout": 0.0,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]},
                  "quantize_base": "int8" if run == "lora_int8" else "nf4"}  # fmt: skip
        if run == "lora_nf4":
            fields["quantize_blocksize"] = 64
    if layout == "before":
        fields["auto_wrap_policy"] = [LAYER_CLASSES[model_type]]
    described, (est,) = estimate_memory(
        config=model_dir, world_size=2, strategy="full_shard", precision="32-true", batch_size=8, seq_len=128,
        padded=True, activation_checkpointing=checkpointing, platform=PLATFORMS["cpu-tcmalloc"],
        chunked_loss=layout != "before", **fields,
    )  # fmt: skip
    return {"real_peak": est.real_peak_bytes_per_rank, "live_peak": est.live_peak_bytes_per_rank,
            "peak_moment": est.peak_moment, "params": described.total_weights}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the matrix and write ``results.json`` and ``results.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vocab")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--layouts", nargs="+", default=["now", "before"], choices=["now", "before"])
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--estimate-only", action="store_true",
                        help="keep the measured runs in --out, compute the estimator's figures again")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if args.estimate_only:
        for key, row in results.items():
            name, run, layout, ck = key.split("/")
            model_dir = TINY if name == "tiny" else args.out / "models" / name
            row.update(estimate(model_dir=model_dir, run=run, layout=layout, checkpointing=ck == "on"))
        results_path.write_text(json.dumps(results, indent=1))
        args.layouts, args.models = [], []  # nothing to run
    for layout in args.layouts:  # the tiny model's run: what every figure is added over
        key = f"tiny/lora_int8/{layout}/off"
        if key not in results:
            ran = run_app(model_dir=TINY, run="lora_int8", layout=layout, checkpointing=False,
                          out=args.out / key.replace("/", "-"), steps=args.steps)  # fmt: skip
            results[key] = {**ran, **estimate(model_dir=TINY, run="lora_int8", layout=layout, checkpointing=False)}
            results_path.write_text(json.dumps(results, indent=1))
    for name in args.models:
        model_dir = build_model(name, args.out / "models")
        for run in args.runs:
            for layout in args.layouts:
                for ck in args.checkpointing:
                    key = f"{name}/{run}/{layout}/{ck}"
                    if key in results:
                        continue
                    print(f"vocab_memory: {key}", flush=True)
                    ran = run_app(model_dir=model_dir, run=run, layout=layout, checkpointing=ck == "on",
                                  out=args.out / key.replace("/", "-"), steps=args.steps)  # fmt: skip
                    results[key] = {**ran, **estimate(model_dir=model_dir, run=run, layout=layout,
                                                      checkpointing=ck == "on")}  # fmt: skip
                    results_path.write_text(json.dumps(results, indent=1))
    import datetime
    import platform

    import torch

    head = (f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()},"
            f" {os.cpu_count()} cores, torch {torch.__version__}, 2 CPU ranks under tcmalloc, with"
            f" `python -m benchmarks.vocab_memory` ({args.steps} steps a run; GB = 10^9 bytes)\n\n")  # fmt: skip
    (args.out / "results.md").write_text(head + report(results))
    print(head + report(results))


def report(results: dict[str, Any]) -> str:
    """The results as a Markdown table (GB = 10^9 bytes)."""
    gb = lambda b: f"{b / 1e9:.3f}"  # noqa: E731
    lines = ["| model | run | checkpointing | added before | added now | now / before | estimate (added) | est / now |"
             " traced live | estimator live | traced / est | peak moment | step before / now, s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, now in results.items():
        name, run, layout, ck = key.split("/")
        if name == "tiny" or layout != "now":
            continue
        before = results.get(f"{name}/{run}/before/{ck}")
        tiny_now, tiny_before = results.get("tiny/lora_int8/now/off"), results.get("tiny/lora_int8/before/off")
        if tiny_now is None:
            continue
        added = now["rss_peak"] - tiny_now["rss_peak"]
        est = now["real_peak"] - tiny_now["real_peak"]
        was = before["rss_peak"] - (tiny_before or tiny_now)["rss_peak"] if before else None
        cells = [name, run, ck, gb(was) if was else "-", gb(added), f"{added / was:.2f}" if was else "-", gb(est),
                 f"{est / added:.2f}", gb(now["traced_live"]), gb(now["live_peak"]),
                 f"{now['traced_live'] / now['live_peak']:.2f}", str(now["peak_moment"]),
                 f"{before['step_s']:.2f} / {now['step_s']:.2f}" if before else f"- / {now['step_s']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
