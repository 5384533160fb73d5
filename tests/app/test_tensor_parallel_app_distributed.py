"""The Hydra app with ``strategy=tp2d`` (issue 48): the medical LoRA experiment on 2 CPU ranks, tensor-parallel 2,
trains on the same global batches as FSDP alone, with the same losses: the ranks of a tensor-parallel group take
the same samples (the data-parallel ranks count once), and the logged loss counts each group once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.app.test_resume_layouts_distributed import losses, samples
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

COMMON = ("experiment=medical_lora", "trainer.max_steps=4", "trainer.log_every_n_steps=1", "data.global_batch_size=8",
          "trainer.limit_val_batches=2", "generate.num_prompts=1", "trainer.enable_progress_bar=false")  # fmt: skip


def _train(run_dir: Path, strategy: str) -> str:
    command = [sys.executable, "-m", "lightning_fsdp_plus.app.train", f"hydra.run.dir={run_dir}", *COMMON,
               f"strategy={strategy}"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    return proc.stdout + proc.stderr


def test_tp2d_trains_the_experiment_as_fsdp_alone(tmp_path):
    console = _train(tmp_path / "tp2d", "tp2d")
    _train(tmp_path / "full_shard", "full_shard")
    assert "linear layers split over 2 tensor-parallel ranks" in console
    assert "mesh replicate=1 x shard=1 x tensor=2" in console
    tp, fsdp = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("tp2d", "full_shard"))
    assert tp["global_batch_size"] == fsdp["global_batch_size"] == 8
    tp_rows, fsdp_rows = samples(tmp_path / "tp2d"), samples(tmp_path / "full_shard")
    assert {s: sorted(set(ids)) for s, ids in tp_rows.items()} == fsdp_rows  # the same rows in the same steps
    assert all(len(tp_rows[s]) == 2 * len(fsdp_rows[s]) for s in fsdp_rows)  # both tensor ranks took each row
    by_step = losses(tmp_path / "tp2d"), losses(tmp_path / "full_shard")
    assert len(by_step[0]) == 4 and max(abs(by_step[0][s] - by_step[1][s]) for s in by_step[1]) <= 1e-4, by_step
    assert tp["val_perplexity"] < tp["base_val_perplexity"]
    assert (tmp_path / "tp2d" / "adapter" / "adapter_model.safetensors").exists()


def test_loss_parallel_trains_the_app_with_the_models_own_loss_and_decodes(tmp_path):
    """The app's tiny Llama built from its config (untied) on the medical data, the head split over the vocabulary:
    the app's loss steps aside for the model's own, validation and greedy decoding run on vocabulary-sharded logits.
    (The strategy's check runs again when the Trainer meets the sharded module: its head is FSDP2's subclass.)"""
    run = tmp_path / "loss_parallel"
    command = [sys.executable, "-m", "lightning_fsdp_plus.app.train", f"hydra.run.dir={run}", "data=medical",
               "strategy=tp2d", "strategy.loss_parallel=true", "trainer.max_steps=4", "trainer.limit_val_batches=2",
               "generate.num_prompts=1", "trainer.enable_progress_bar=false"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, failure_excerpt(console)
    assert "the output head over the vocabulary: loss parallel" in console
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["val_perplexity"] < metrics["base_val_perplexity"]
    generated = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert len(generated) == 1 and generated[0]["generated"]
