"""A run resumed past its first epoch, on the same or another number of ranks, continues exactly (issues 46, 47).

The medical LoRA experiment on an int8 base, on 48 of its examples packed into rows of 192 tokens (``data.pack``:
27 rows of whole examples, made once from the seed): a global batch of 16 rows (2 ranks x 8), 2 steps an epoch, 9
steps. The uninterrupted run keeps a checkpoint of every step; the resumed runs start from two of them in run
directories of their own, as a job that died right after writing it would: inside epoch 2 (step 3) and at its end
(step 4). Every resumed run sees the uninterrupted run's rows in the same global batches; on 2 ranks (from step 3) it
ends bit for bit where the uninterrupted run ends, on 1 rank (accumulating 2) and on 4 (micro-batch 4), from step 4,
within float rounding. (The epoch boundary on 2 ranks is not a case of its own: the 1- and 4-rank resumes from it
check its global batches exactly, and the same-world resume checks bit-exactness; 23 s of the suite.)
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

STEPS = 9
COMMON = ("experiment=medical_lora", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1",
          "generate.num_prompts=0", "validate_before=false", "trainer.enable_progress_bar=false",
          f"trainer.max_steps={STEPS}", "data.pack=true", "data.max_seq_len=192", "data.batch_size=8")  # fmt: skip


def _train(run_dir: Path, *overrides: str) -> None:
    command = [sys.executable, "-m", "lightning_fsdp_plus.app.train", f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    (run_dir / "console.txt").write_text(proc.stdout + proc.stderr)


def losses(run_dir: Path) -> dict[int, float]:
    """``train_loss`` by optimizer step from the run's CSV logs."""
    out = {}
    for path in sorted((run_dir / "csv").rglob("metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train_loss"):
                out[int(row["step"])] = float(row["train_loss"])
    return out


def samples(run_dir: Path) -> dict[int, list[int]]:
    """The training-set (row) indices of each optimizer step's global batch, over every rank and micro-step."""
    out: dict[int, list[int]] = {}
    for path in run_dir.glob("samples.rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], []).extend(record["ids"])
    return {step: sorted(ids) for step, ids in out.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    """The 9-step run on 2 ranks with a checkpoint after every step; and the 48-example training file."""
    tmp = tmp_path_factory.mktemp("layouts")
    data = tmp / "train.jsonl"
    lines = (REPO / "examples" / "medical_lora" / "data" / "train.jsonl").read_text().splitlines()
    data.write_text("\n".join(lines[:48]) + "\n")
    _train(tmp / "whole", f"data.train_files=[{data}]", "checkpoint.every_n_train_steps=1",
           "callbacks.model_checkpoint.save_top_k=-1")  # fmt: skip
    return tmp / "whole", data


@pytest.mark.parametrize(
    ("step", "devices", "micro", "exact"),
    [(3, 2, 8, True), (4, 1, 8, False), (4, 4, 4, False)],
    ids=["epoch2-same", "epoch-boundary-on-1-rank", "epoch-boundary-on-4-ranks"],
)
def test_a_resume_sees_the_same_global_batches_and_ends_where_the_uninterrupted_run_ends(
    uninterrupted, tmp_path, step, devices, micro, exact
):
    whole, data = uninterrupted
    [checkpoint] = (whole / "checkpoints").glob(f"epoch=*-step={step}.ckpt")
    resumed = tmp_path / "resumed"
    # nothing else changed: on 4 ranks the micro-batch of 8 is lowered to 4 to keep the global batch of 16
    _train(resumed, f"data.train_files=[{data}]", f"ckpt_path='{checkpoint}'", f"trainer.devices={devices}")
    expected_samples, got_samples = samples(whole), samples(resumed)
    assert sorted(got_samples) == list(range(step, STEPS))
    assert all(len(set(expected_samples[k])) == 16 for k in range(STEPS))
    assert {k: expected_samples[k] for k in got_samples} == got_samples  # the same samples in the same global batches
    expected_loss, got_loss = losses(whole), losses(resumed)
    assert sorted(got_loss) == list(range(step, STEPS))
    expected, got = (
        load_file(whole / "adapter" / "adapter_model.safetensors"),
        load_file(resumed / "adapter" / "adapter_model.safetensors"),
    )
    weight_diff = max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)
    loss_diff = max(abs(expected_loss[k] - got_loss[k]) for k in got_loss)
    if exact:
        assert weight_diff == 0.0 and loss_diff == 0.0
    else:
        assert weight_diff <= 1e-5 and loss_diff <= 1e-5
        console = (resumed / "console.txt").read_text()
        assert f"resuming on {devices} ranks (micro-batch {micro}" in console and "a run checkpointed on 2" in console
        assert ("data.batch_size=8 is lowered to 4" in console) == (micro == 4)
    [attempt] = json.loads((resumed / "attempts.json").read_text())
    accumulate = 16 // (devices * micro)
    assert attempt == {"attempt": 1, "start_step": step, "world_size": devices, "global_batch_size": 16,
                       "micro_batch_size": micro, "accumulate_grad_batches": accumulate}  # fmt: skip
    metrics = json.loads((resumed / "metrics.json").read_text())
    assert metrics["global_batch_size"] == 16 and metrics["accumulate_grad_batches"] == accumulate
