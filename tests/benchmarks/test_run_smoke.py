"""Smoke test of ``python -m benchmarks.run --quick``: it runs (a subset, one repetition) and writes valid files.

Speed and memory goals are not asserted here — they live in the benchmark's own report.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

CASES = "fsdp_plus_full_shard,fsdp2_loop_full_shard,lightning_fsdp,lightning_ddp,lora_int8_sharded,lora_bf16_sharded"


def test_quick_run_writes_json_markdown_and_png(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--repeats", "1", "--steps", "3", "--cases", CASES,
               "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["world_size"] == 2 and results["meta"]["repetitions"] == 1
    cases = results["cases"]
    assert set(cases) == set(CASES.split(","))
    assert cases["lightning_fsdp"]["refused"].startswith("ValueError")  # Lightning's FSDP refuses CPU
    for name in set(CASES.split(",")) - {"lightning_fsdp"}:
        case = cases[name]
        assert case["step_time_s"]["median"] > 0 and case["tokens_per_s"]["median"] > 0
        assert case["model_state_bytes_per_rank"] > 0 and case["tensor_peak_bytes_per_rank"] > 0
    assert cases["fsdp_plus_full_shard"]["comm_per_step"]["all_gather"] > 0
    assert cases["lightning_ddp"]["comm_per_step"]["all_reduce"] > 0  # counted through DDP's comm hook
    int8, bf16 = cases["lora_int8_sharded"]["comm_per_step"], cases["lora_bf16_sharded"]["comm_per_step"]
    assert int8["all_gather"] < 0.7 * bf16["all_gather"]
    assert set(results["overhead_vs_fsdp2_loop"]) == {"FULL_SHARD"}
    assert results["overhead_vs_fsdp2_loop"]["FULL_SHARD"]["median"] > 0
    assert "| fsdp_plus_full_shard |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
