"""The peer comparison's harness (``python -m benchmarks.peers``): every system is fed the plan's token ids step by
step (checked by running each system for real, 2 steps, on the tiny Llama), and its arithmetic and page."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from benchmarks.peers.plan import digest, micro_batch, step_order, target_tokens
from benchmarks.peers.record import merge
from benchmarks.peers.report import medians, page
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

TINY = str(REPO / "examples" / "assets" / "tiny-llama")
FED = ("ours", "trl", "lightning_mps", "plain_peft")
"""The systems the CI run feeds (the int8 rows are ours again, on another base)."""


def test_every_system_trains_on_the_plans_token_ids_step_by_step(tmp_path):
    results = tmp_path / "peers.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.peers",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--base",
        TINY,
        "--systems",
        ",".join(FED),
        "--out",
        str(tmp_path / "runs"),
        "--results",
        str(results),
    ]
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    runs = json.loads(results.read_text())["runs"]
    assert [r["system"] for r in runs] == list(FED)
    assert not [r for r in runs if "error" in r], [r.get("error") for r in runs]
    assert all(r["same_batches_as_plan"] for r in runs)
    assert len({r["batches_sha"] for r in runs}) == 1  # every system, the same ids on the same rank and step
    assert all(r["steps"] == 2 and math.isfinite(r["heldout_loss"]) for r in runs)
    reference = next(r["heldout_loss"] for r in runs if r["system"] == "plain_peft")
    # the same two steps of the same arithmetic: every system's adapter gives the one-process loss (measured: equal
    # to 1e-7 here); a system fed other batches, other settings or another loss normalisation would not
    assert all(abs(r["heldout_loss"] / reference - 1) < 1e-3 for r in runs), [r["heldout_loss"] for r in runs]
    trl = next(r for r in runs if r["system"] == "trl")
    assert trl["setting"]["distributed"].startswith("accelerate ")  # what accelerate really ran is named
    assert {"trl", "accelerate", "peft"} <= set(trl["versions"])


def test_a_digest_covers_the_tokens_and_not_the_padding():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = micro_batch(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    wider = torch.cat([batch["input_ids"], torch.full((2, 2), 9)], dim=1)
    wider_mask = torch.cat([batch["attention_mask"], torch.zeros(2, 2, dtype=torch.long)], dim=1)
    assert digest(wider, wider_mask) == digest(batch["input_ids"], batch["attention_mask"])  # other padding
    swapped = micro_batch(rows[::-1], pad_id=0)
    assert digest(swapped["input_ids"], swapped["attention_mask"]) != digest(
        batch["input_ids"], batch["attention_mask"]
    )
    assert target_tokens(batch["labels"]) == 2  # 6 and 7; a label at position 0 is never predicted


def test_the_order_goes_through_seeded_epochs_without_repeating_within_one():
    steps = step_order(10, steps=3, ranks=2, per_rank=2, seed=0)
    flat = [i for step in steps for rank in step for i in rank]
    assert len(flat) == 12 and sorted(flat[:10]) == list(range(10))
    assert (
        steps
        == step_order(10, steps=3, ranks=2, per_rank=2, seed=0)
        != step_order(10, steps=3, ranks=2, per_rank=2, seed=1)
    )


def test_a_run_is_timed_by_its_slowest_rank_over_the_steady_steps(tmp_path):
    for rank, (times, tokens) in enumerate(
        (([9.0, 1.0, 2.0, 1.0], [10, 10, 10, 10]), ([8.0, 2.0, 1.0, 1.0], [30, 30, 30, 30]))
    ):
        record = {
            "rank": rank,
            "digests": ["a"],
            "tokens_per_step": tokens,
            "step_s": times,
            "peak_rss_added_mb": 100.0 + rank,
        }
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    merged = merge(tmp_path, warmup=1)
    assert merged["step_s"] == [9.0, 2.0, 2.0, 1.0]
    assert merged["step_s_median"] == 2.0
    assert merged["useful_tokens_per_s"] == (3 * 10 + 3 * 30) / 2 / 5.0
    assert merged["peak_rss_added_mb"] == 101.0


def _row(system, round_, tokens_per_s, memory, loss, error=None):
    row = {"system": system, "label": system.upper(), "round": round_, "setting": {"distributed": "d"}}
    if error:
        return {**row, "error": error}
    return {
        **row,
        "useful_tokens_per_s": tokens_per_s,
        "peak_rss_added_mb": memory,
        "heldout_loss": loss,
        "step_s_median": 1.0,
        "same_batches_as_plan": True,
    }


def test_the_page_keeps_every_run_and_takes_medians_of_the_successful_ones():
    runs = [
        _row("a", 0, 10.0, 500, 1.0),
        _row("b", 0, 0, 0, 0, error="RuntimeError: no devices"),
        _row("a", 1, 30.0, 700, 3.0),
        _row("a", 2, 20.0, 600, 2.0),
    ]
    m = medians(runs)
    assert m["a"] == {
        "runs": 3,
        "failed": 0,
        "useful_tokens_per_s": 20.0,
        "peak_rss_added_mb": 600,
        "heldout_loss": 2.0,
        "step_s_median": 1.0,
    }
    assert m["b"] == {"runs": 0, "failed": 1}
    settings = {
        "steps": 24,
        "examples": 360,
        "per_rank_batch": 8,
        "ranks": 2,
        "base": "B",
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
        "lr": 2e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "schedule": "constant",
        "precision": "fp32",
        "warmup": 4,
        "heldout_examples": 72,
    }
    text = page({"machine": "M", "command": "python -m benchmarks.peers", "settings": settings, "runs": runs})
    assert "| A | 3 | 20.0 | 1.00 | 600 | 2.0000 |" in text and "| B | 0 of 1 | - |" in text
    assert "| 0 | B | could not run: RuntimeError: no devices |" in text
    assert text.count("| A | d |") == 3  # every run kept


def test_cuda_without_gpus_says_so_and_writes_no_row(tmp_path):
    results = tmp_path / "peers.json"
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, whatever the machine has
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--device", "cuda", "--results", str(results)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    assert "0 CUDA device(s)" in proc.stdout and "nothing was run and no row was written" in proc.stdout
    assert not results.exists()
