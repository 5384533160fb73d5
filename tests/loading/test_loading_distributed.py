"""Streaming loading on 2 CPU ranks: every case of tests/loading/cases.py, from one torchrun launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import ARCHITECTURES, save_checkpoint, save_mid_llama
from tests.helpers.launch import REPO, assert_case_passed, run_script, subprocess_env
from tests.loading.cases import CASES, EQUALITY, MODES

SCRIPT = REPO / "tests" / "loading" / "cases.py"


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, str]:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    for arch in ARCHITECTURES:
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            save_checkpoint(checkpoints / f"{arch}_{tag}", arch, dtype=dtype)
    save_checkpoint(checkpoints / "llama_tied_bf16", "llama", tied=True)
    save_mid_llama(checkpoints / "mid")
    out = tmp_path_factory.mktemp("loading")
    env = {**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed slices leave the heap at once
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(SCRIPT),
               "--checkpoints", str(checkpoints), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return out, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(CASES))
def test_loading_case(launch, name):
    out, output = launch
    assert_case_passed(out, output, name)


def test_the_equality_cases_cover_every_strategy_mode_dtype_and_architecture():
    assert {e[3]["sharding_strategy"] for e in EQUALITY} == {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"}
    assert {e[4] for e in EQUALITY} == set(MODES)
    assert {e[0].rsplit("_", 1)[1] for e in EQUALITY} == {"bf16", "fp32"}
    assert {e[0].split("_")[0] for e in EQUALITY} == set(ARCHITECTURES)
    assert {e[2] for e in EQUALITY} >= {"32-true", "bf16-true", "bf16-mixed"}


def test_the_loader_reports_what_it_loads(launch):
    _, output = launch
    assert "fsdp_plus: loading " in output and "every rank reads only its own shards" in output
    assert "this rank read" in output


def test_spawn_hands_the_streamed_and_trained_weights_to_the_main_process(tmp_path):
    save_checkpoint(tmp_path / "llama", "llama")
    run_script(REPO / "tests" / "loading" / "spawn_fit.py", "--checkpoint", str(tmp_path / "llama"), "--out",
               str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "spawn.json").read_text())
    assert result["meta_left"] == [] and result["missing"] == [] and result["different"] == []
    assert result["int8_layers"] == 14  # 2 layers x 7 projections, int8 in the main process as in the workers
