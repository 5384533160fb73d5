"""Smoke test of ``python -m benchmarks.run --quick``: it runs (a subset, one repetition) and writes valid files.

Speed and memory goals are not asserted here — they live in the benchmark's own report.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.harness import PYTHON
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

CASES = (
    "fsdp_plus_full_shard,fsdp2_loop_full_shard,lightning_model_parallel_full_shard,lightning_fsdp,lightning_ddp,"
    "lora_int8_sharded,lora_bf16_sharded,plain_gpt_fsdp_plus_full_shard,plain_gpt_lightning_model_parallel_default_mesh"
)


def test_quick_run_writes_json_markdown_and_png(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--repeats", "1", "--steps", "3", "--cases", CASES,
               "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["world_size"] == 2 and results["meta"]["repetitions"] == 1
    assert results["meta"]["gradient_clip_val"] == 1.0  # every case clips by norm, as users run
    cases = results["cases"]
    assert set(cases) == set(CASES.split(","))
    assert cases["lightning_fsdp"]["refused"].startswith("ValueError")  # Lightning's FSDP refuses CPU
    for name in set(CASES.split(",")) - {"lightning_fsdp"}:
        case = cases[name]
        assert case["step_time_s"]["median"] > 0 and case["tokens_per_s"]["median"] > 0
        assert case["model_state_bytes_per_rank"] > 0 and case["tensor_peak_bytes_per_rank"] > 0
    assert cases["fsdp_plus_full_shard"]["comm_per_step"]["all_gather"] > 0
    # ModelParallelStrategy's default mesh on one node: a data-parallel mesh of one rank shards nothing (issue 31)
    default_mesh = cases["plain_gpt_lightning_model_parallel_default_mesh"]
    assert default_mesh["sharded_over_ranks"] == 1 and not any(default_mesh["comm_per_step"].values())
    plain = cases["plain_gpt_fsdp_plus_full_shard"]
    assert plain["comm_per_step"]["all_gather"] > 0 and 2 * plain["model_state_bytes_per_rank"] == pytest.approx(
        default_mesh["model_state_bytes_per_rank"], rel=0.01)  # fmt: skip
    assert cases["lightning_ddp"]["comm_per_step"]["all_reduce"] > 0  # counted through DDP's comm hook
    int8, bf16 = cases["lora_int8_sharded"]["comm_per_step"], cases["lora_bf16_sharded"]["comm_per_step"]
    assert int8["all_gather"] < 0.7 * bf16["all_gather"]
    ratio = results["overhead_vs_best_reference"]["FULL_SHARD"]
    assert set(results["overhead_vs_best_reference"]) == {"FULL_SHARD"} and ratio["median"] > 0  # no plain reference
    assert ratio["reference"] in ("fsdp2_loop_full_shard", "lightning_model_parallel_full_shard")
    # the (last) repetition profiled every case: torch ops and the time outside them, per step
    profile = cases["fsdp_plus_full_shard"]["profile_s"]
    assert PYTHON in profile and any(op.startswith("aten::") for op in profile)
    assert ratio["profile_delta_s"] and all(len(row) == 3 for row in ratio["profile_delta_s"])
    # FSDP2 keeps the root gathered from forward to backward in all three (fsdp_plus by default): same bytes
    gathered = {name: cases[name]["comm_per_step"]["all_gather"] for name in CASES.split(",")[:3]}
    assert len(set(gathered.values())) == 1, gathered
    markdown = (tmp_path / "results.md").read_text()
    assert "| fsdp_plus_full_shard |" in markdown and "torch.profiler self CPU ms per step" in markdown
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_small_gpt_is_gpt2_with_its_vocabulary_and_the_loop_shards_its_blocks():
    from transformers import GPT2LMHeadModel

    from benchmarks.cases import GPT_BATCH_SIZE, SIZES, Setting, blocks

    full = Setting(size=SIZES["full"], batch_size=4, warmup=3, steps=20, world_size=2).gpt()
    assert full.is_gpt and (full.batch_size, full.warmup, full.steps) == (GPT_BATCH_SIZE, 2, 10)
    setting = Setting(size=SIZES["quick"], batch_size=4, warmup=3, steps=12, world_size=2).gpt()
    assert setting.is_gpt and (setting.batch_size, setting.steps) == (GPT_BATCH_SIZE // 2, 6)
    config = setting.config()
    assert (config.n_embd, config.n_layer, config.vocab_size, config.n_positions) == (256, 4, 50257, 128)
    model = GPT2LMHeadModel(config)
    assert blocks(model) is model.transformer.h and len(blocks(model)) == 4
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: the root unit holds most of the model
