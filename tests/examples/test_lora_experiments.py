"""The medical LoRA experiment (the demo) for real (2 CPU processes, LoRA + int8 base), then checked in a plain
single process: the exported adapter reproduces the held-out loss, and greedy answers match token for token.

It runs ``fsdp-plus-train experiment=medical_lora`` (the tiny model's experiment, as ``scripts/run`` runs it; the
README's main command runs the real model: tests/examples/test_real_model.py) with 45 steps instead of the
configured 300 to keep the suite short (the examples table in docs/measured/examples.md quotes full runs of both,
measured by scripts/refresh_measured.py). The legal experiment runs the
same code on other files: it is composed and validated in tests/config and its data checked in
test_datasets_and_base.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

BASE = REPO / "examples" / "assets" / "tiny-llama"
DOMAINS = ["medical_lora"]


CHECKPOINTED = "medical_lora_checkpointed"
"""The medical experiment again with ``strategy.activation_checkpointing=auto`` (no generation): it must train
exactly as the run without checkpointing."""
RUNS = {"medical_lora": [], CHECKPOINTED: ["strategy.activation_checkpointing=auto", "generate.num_prompts=0"]}
"""Overrides on top of ``experiment=medical_lora`` for each run."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    demo = ["scripts/run", "fsdp-plus-train", "experiment=medical_lora"]  # the tiny model's experiment
    runs = {}
    for name, overrides in RUNS.items():  # single runs: a multirun would start one more process (the job) per run
        run_dir = tmp_path_factory.mktemp(name)
        command = [*demo, *overrides, "trainer.max_steps=45", "trainer.val_check_interval=45",
                   "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
        proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, failure_excerpt(proc.stderr)
        runs[name] = run_dir
    return runs


def test_the_experiment_with_activation_checkpointing_trains_exactly_as_without(runs):
    """The instruction data (padding, masks, prompt masking) through checkpointed decoder layers: the same losses
    and the same adapter, to the bit, after 45 AdamW steps."""
    from safetensors.torch import load_file

    plain, checkpointed = (json.loads((runs[n] / "metrics.json").read_text()) for n in ("medical_lora", CHECKPOINTED))
    assert checkpointed["activation_checkpointing"] and not plain["activation_checkpointing"]
    for key in ("train_loss", "val_loss", "base_val_loss"):
        assert checkpointed[key] == pytest.approx(plain[key], abs=1e-6), key
    adapters = [load_file(runs[n] / "adapter" / "adapter_model.safetensors") for n in ("medical_lora", CHECKPOINTED)]
    assert adapters[0].keys() == adapters[1].keys()
    assert max((adapters[0][k] - adapters[1][k]).abs().max().item() for k in adapters[0]) <= 1e-6


@pytest.mark.parametrize("domain", DOMAINS)
def test_held_out_perplexity_falls_by_at_least_20_percent(runs, domain):
    metrics = json.loads((runs[domain] / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["quantize_base"] == "int8" and metrics["lora_only"] is True
    assert metrics["val_perplexity"] <= 0.8 * metrics["base_val_perplexity"]
    assert metrics["fit_time_s"] < 180


@pytest.mark.parametrize("domain", DOMAINS)
def test_memory_estimate_of_the_experiment_matches_its_metrics(runs, domain):
    """fsdp-plus-estimate with the run's own settings against what MemoryMonitor wrote into metrics.json."""
    from omegaconf import OmegaConf

    from lightning_fsdp_plus.memory.estimate import estimate_memory

    cfg = OmegaConf.load(runs[domain] / ".hydra" / "config.yaml")
    metrics = json.loads((runs[domain] / "metrics.json").read_text())
    _, (estimate,) = estimate_memory(
        config=BASE, world_size=metrics["world_size"], strategy=cfg.strategy.sharding_strategy,
        precision=cfg.precision.name, optimizer="adamw", lora=OmegaConf.to_container(cfg.strategy.lora),
        lora_only=cfg.strategy.lora_only, quantize_base=cfg.strategy.quantize_base,
        batch_size=cfg.data.batch_size, seq_len=cfg.data.max_seq_len, padded=True,
    )  # fmt: skip
    assert estimate.model_state_bytes_per_rank == pytest.approx(metrics["model_state_bytes_per_rank"], rel=0.10)
    assert estimate.activation_bytes_per_rank == pytest.approx(metrics["activation_bytes_per_rank"], rel=0.10)
    assert estimate.peak_bytes_per_rank == pytest.approx(metrics["tensor_peak_bytes_per_rank"], rel=0.10)


def _val_loss(model, datamodule) -> float:
    from lightning_fsdp_plus.app.lm import target_tokens

    total = tokens = 0.0
    with torch.no_grad():
        for batch in datamodule.val_dataloader():
            n = target_tokens(batch)
            total += model(**batch).loss.item() * n
            tokens += n
    return total / tokens


def _reloaded(run: Path, *, int8: bool):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_plus.quantization import convert_to_int8

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), run / "adapter")
    if int8:
        convert_to_int8(model)  # the conversion the training run applied, on one process
    return model.eval()


@pytest.mark.parametrize("domain", DOMAINS)
def test_adapter_reloads_with_peft_and_reproduces_the_held_out_loss(runs, domain):
    from lightning_fsdp_plus.app.data import InstructionDataModule

    run = runs[domain]
    files = REPO / "examples" / domain / "data"
    seq = OmegaConf.load(run / ".hydra" / "config.yaml").data.max_seq_len  # the held-out rows the run scored
    datamodule = InstructionDataModule(tokenizer=str(BASE), train_files=[str(files / "val.jsonl")],
                                       val_files=[str(files / "val.jsonl")], batch_size=8, max_seq_len=seq)  # fmt: skip
    reported = json.loads((run / "metrics.json").read_text())["val_loss"]
    # the plain float base: differs from the int8 base the adapter trained on by quantization error only
    assert _val_loss(_reloaded(run, int8=False), datamodule) == pytest.approx(reported, rel=1e-2)
    assert _val_loss(_reloaded(run, int8=True), datamodule) == pytest.approx(reported, rel=1e-3)


@pytest.mark.parametrize("domain", DOMAINS)
def test_sharded_and_reloaded_models_generate_the_same_greedy_tokens(runs, domain):
    from transformers import AutoTokenizer

    from lightning_fsdp_plus.app.generate import greedy_generate

    rows = [json.loads(line) for line in (runs[domain] / "generations.jsonl").open()]
    assert len(rows) == 4 and all(r["generated"] for r in rows)
    model = _reloaded(runs[domain], int8=True)
    answers = greedy_generate(lambda ids: model(input_ids=ids).logits, AutoTokenizer.from_pretrained(BASE),
                              [r["prompt"] for r in rows], max_new_tokens=40)  # fmt: skip
    assert answers == [r["generated"] for r in rows]


@pytest.fixture(scope="module")
def merged(runs, tmp_path_factory) -> Path:
    """``fsdp-plus-export --merge`` of the medical run, from another directory (the base found from the run)."""
    from lightning_fsdp_plus.export import main

    out = tmp_path_factory.mktemp("merged")
    assert main([str(runs["medical_lora"] / "checkpoints" / "last.ckpt"), str(out), "--merge"]) == 0
    return out


def test_export_merge_writes_a_full_model_that_answers_like_base_plus_adapter(runs, merged):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any("lora" in name for name, _ in model.named_parameters())  # a plain transformers model
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _reloaded(runs["medical_lora"], int8=False)(input_ids=ids).logits  # float base + the adapter
        assert (model(input_ids=ids).logits - expected).abs().max().item() < 1e-4
        base = AutoModelForCausalLM.from_pretrained(BASE).eval()(input_ids=ids).logits
        assert (base - expected).abs().max().item() > 1e-2  # the adapter changed the model: the merge carried it


def test_generate_answers_alike_from_the_merged_model_and_from_base_plus_adapter(runs, merged, capsys):
    from lightning_fsdp_plus.app.generate import main  # fsdp-plus-generate (the walkthrough test runs the command)

    questions = ["What causes type 2 diabetes?", "How can the risk of eczema be reduced?"]
    prompts = [arg for q in questions for arg in ("--prompt", q)]

    def answers(*args: str) -> list[dict]:
        assert main([*args, *prompts, "--max-new-tokens", "24"]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]

    from_merged = answers(str(merged))
    assert [a["instruction"] for a in from_merged] == questions and all(a["answer"] for a in from_merged)
    assert from_merged == answers(str(BASE), "--adapter", str(runs["medical_lora"] / "adapter"))
    with pytest.raises(SystemExit) as usage:
        main([str(merged)])
    assert usage.value.code == 2 and "give --prompt TEXT" in capsys.readouterr().err
