"""Checkpoints on 2 CPU processes: exact resume, resharding, LoRA+int8 size, crashes, corruption.

Each scenario is a real launch of tests/helpers/ckpt_cases.py (3 x 4 SGD steps, a "last" checkpoint every 4
steps). Exact means equal: resumed runs reproduce the uninterrupted run's losses and parameters bit for bit
(resharded runs to 1e-5: one rank sums the batch in another order).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_fsdp_plus.checkpoint import CheckpointError, load_full, verify
from tests.conftest import LORA_KINDS
from tests.helpers.ckpt_runs import SCRIPT, launch, max_diff, result, wait_for
from tests.helpers.launch import REPO, subprocess_env


# full fine-tuning resumes exactly in tests/test_preemption_distributed.py (stopped mid-epoch, inside validation and a
# checkpoint save); here LoRA on a replicated int8 base and on a sharded NF4 one (nested statistics), whose
# checkpoints hold the adapter only. Both kinds run in each launch (first 4 steps, then the resume).
def test_lora_resume_on_int8_and_nf4_bases_is_exact_and_saves_only_the_adapter(tmp_path, ckpt_reference):
    kinds = ",".join(LORA_KINDS)
    launch(tmp_path, "first", "--kind", kinds, "--max-steps", "4")
    launch(tmp_path, "resumed", "--kind", kinds, "--resume", "last")
    for kind in LORA_KINDS:
        losses, state = result(tmp_path / kind, "resumed")
        ref_losses, ref_state, _ = ckpt_reference[kind]
        assert sorted(losses, key=int) == [str(s) for s in range(5, 13)], kind
        assert all(losses[k] == ref_losses[k] for k in losses), kind
        assert max_diff(state, ref_state) == 0.0, kind
        assert_only_the_adapter_was_saved(tmp_path / kind, ref_state)  # no base weight, 4-bit statistics neither


def assert_only_the_adapter_was_saved(tmp_path: Path, ref_state: dict[str, torch.Tensor]) -> None:
    """The trainable-only checkpoint in ``tmp_path/ckpt/last.ckpt`` holds LoRA weights and momentum, nothing else."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = tmp_path / "ckpt" / "last.ckpt"
    written = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    lora = [v for k, v in ref_state.items() if "lora_" in k]
    adapter_and_momentum = 2 * sum(v.numel() * 4 for v in lora)  # fp32 weights + SGD momentum
    assert written < 2 * adapter_and_momentum
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("state_dict.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no base weight (quantized or float) inside


def test_full_format_resumes_exactly_and_is_one_verified_file(tmp_path, ckpt_reference):
    launch(tmp_path, "first", "--max-steps", "4", "--state-dict-type", "full")
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file() and Path(f"{ckpt}.sha256").is_file()
    assert "state_dict" in load_full(ckpt)  # weights_only unpickling
    launch(tmp_path, "resumed", "--resume", "last", "--state-dict-type", "full")
    assert max_diff(result(tmp_path, "resumed")[1], ckpt_reference["full_ft"][1]) == 0.0


def test_two_ranks_reshard_to_one_with_another_sharding_strategy(tmp_path, ckpt_reference):
    launch(tmp_path, "first", "--max-steps", "4")
    launch(tmp_path, "resumed", "--resume", "last", "--devices", "1", "--sharding", "SHARD_GRAD_OP")
    losses, state = result(tmp_path, "resumed")
    ref_losses, ref_state, _ = ckpt_reference["full_ft"]
    assert max(abs(losses[k] - ref_losses[k]) for k in losses) < 1e-5
    assert max_diff(state, ref_state) < 1e-5


def test_kill_9_of_one_rank_then_resume_from_last_finishes_like_the_uninterrupted_run(tmp_path, ckpt_reference):
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--scenario", "killed", "--step-sleep", "0.4"]
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(tmp_path / "killed.rank1.progress", step=6, timeout=240, proc=proc)
    os.kill(int((tmp_path / "killed.rank1.pid").read_text()), signal.SIGKILL)
    killed_at = time.time()
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode != 0
    assert time.time() - killed_at < 60, "the surviving rank did not exit promptly"
    assert "terminated with code -9" in output or "Connection" in output  # the survivor says why it stops
    reached = int((tmp_path / "killed.rank0.progress").read_text())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt" / "meta.pt", weights_only=False)["global_step"]
    assert 0 < reached - saved <= 4  # at most one checkpoint interval lost
    launch(tmp_path, "resumed", "--resume", "last")
    assert max_diff(result(tmp_path, "resumed")[1], ckpt_reference["full_ft"][1]) == 0.0


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, ckpt_reference):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--scenario", "crash",
                           "--crash-on-commit", "2"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    verify(ckpt)  # the checkpoint of step 4 is whole ...
    assert torch.load(ckpt / "meta.pt", weights_only=False)["global_step"] == 4
    assert any(p.name.startswith(".fsdp_plus_tmp-") for p in ckpt.parent.iterdir())  # ... the new one never replaced it
    launch(tmp_path, "resumed", "--resume", "last")
    assert max_diff(result(tmp_path, "resumed")[1], ckpt_reference["full_ft"][1]) == 0.0


def test_truncated_and_corrupted_checkpoints_are_named_errors(tmp_path, ckpt_reference):
    good = ckpt_reference["full_ft"][2] / "ckpt" / "last.ckpt"  # the uninterrupted run's sharded checkpoint
    verify(good)
    shard = next(good.glob("__1_*.distcp"))
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    (truncated / shard.name).write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=re.escape(f"file {truncated / shard.name} is truncated")):
        verify(truncated)
    corrupted = tmp_path / "corrupted"
    shutil.copytree(good, corrupted)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupted / shard.name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"file {corrupted / shard.name} is corrupted")):
        verify(corrupted)
    (corrupted / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        verify(corrupted)


def test_export_consolidates_sharded_checkpoints_and_writes_peft_adapters(tmp_path, ckpt_reference):
    from peft import PeftModel
    from safetensors.torch import load_file

    from lightning_fsdp_plus.export import main as export
    from tests.helpers.models import LORA_LLAMA, tiny_llama

    _, full_state, full_dir = ckpt_reference["full_ft"]
    assert export([str(full_dir / "ckpt" / "last.ckpt"), str(tmp_path / "full")]) == 0
    weights = load_file(tmp_path / "full" / "model.safetensors")
    model = tiny_llama(1)
    missing, unexpected = model.load_state_dict(weights, strict=False)  # transformers names: prefix stripped
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(weights[k.removeprefix("model.")], v) for k, v in full_state.items()
               if k.removeprefix("model.") in weights)  # fmt: skip

    _, lora_state, lora_dir = ckpt_reference["lora_int8"]
    assert export([str(lora_dir / "ckpt" / "last.ckpt"), str(tmp_path / "adapter")]) == 0
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    reloaded = PeftModel.from_pretrained(tiny_llama(0, **LORA_LLAMA), tmp_path / "adapter")
    trained = {k.removeprefix("model."): v for k, v in lora_state.items() if "lora_" in k}
    params = dict(reloaded.named_parameters())
    assert trained and all(torch.equal(params[k], v) for k, v in trained.items())
    assert export([str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
