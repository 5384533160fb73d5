"""Smoke test of the LoRA+int8 benchmark: it runs (quick, two cases) and writes valid, consistent files."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import REPO, subprocess_env


def test_quick_benchmark_writes_results_with_counted_collectives(tmp_path):
    command = [sys.executable, "-m", "benchmarks.lora_int8", "--quick", "--out", str(tmp_path),
               "--cases", "lora_int8_sharded,lora_bf16_sharded"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["case"]: r for r in results["results"]}
    assert set(rows) == {"lora_int8_sharded", "lora_bf16_sharded"}
    for row in rows.values():
        assert row["step_time_s_median"] > 0 and row["tokens_per_s"] > 0
        assert row["all_gather_calls_per_step"] > 0 and row["reduce_scatter_bytes_per_step"] > 0
    # the int8 base travels as int8: fewer all-gather bytes than the same base in bf16
    int8, bf16 = rows["lora_int8_sharded"], rows["lora_bf16_sharded"]
    assert int8["all_gather_bytes_per_step"] < 0.7 * bf16["all_gather_bytes_per_step"]
    assert int8["reduce_scatter_bytes_per_step"] == bf16["reduce_scatter_bytes_per_step"]  # same LoRA grads
    assert "| lora_int8_sharded |" in (tmp_path / "results.md").read_text()
