"""The main job on the real model, shortened: the README's main command (``bash scripts/demo.sh``, the medical
fine-tune of SmolLM2-135M-Instruct, LoRA on a sharded int8 base, 2 CPU processes) for 4 steps instead of the shipped
run, then its adapter loaded with plain transformers + peft in a fresh process. The full runs and their figures are
benchmarks (``python -m benchmarks.real_model``), not tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docs import doc_commands
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

DOMAINS = ("medical_lora", "legal_lora")
RELOAD = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

adapter, prompts = sys.argv[1], json.loads(sys.argv[2])
base = json.load(open(f"{adapter}/adapter_config.json"))["base_model_name_or_path"]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                             quantization_config=BitsAndBytesConfig(load_in_8bit=True))
model = PeftModel.from_pretrained(model, adapter).eval()
tokenizer = AutoTokenizer.from_pretrained(base)
rows = []
with torch.no_grad():
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        top = model(input_ids=ids).logits[0, -1].float().topk(5)
        rows.append({"ids": top.indices.tolist(), "logits": top.values.tolist()})
assert not any(name.startswith("lightning_fsdp_plus") for name in sys.modules), "imported the project"
print(json.dumps(rows))
"""
"""A fresh process with plain transformers + peft (the base held as transformers' LLM.int8, as the run held it)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_checkpoint) -> Path:
    demo = doc_commands("setup")[0]
    assert demo == ["bash", "scripts/demo.sh"]
    assert "experiment=medical_smollm2" in (REPO / "scripts" / "demo.sh").read_text()
    run_dir = tmp_path_factory.mktemp("medical_smollm2")
    command = [*demo, "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=3",
               "generate.num_prompts=2", "generate.max_new_tokens=6", "trainer.enable_progress_bar=false",
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    return run_dir


def test_the_main_job_trains_the_real_model_sharded_and_reports_before_and_after(run, smollm2_checkpoint):
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["quantize_base"] == "int8" and metrics["lora_only"] is False
    assert metrics["steps"] == 4 and metrics["wall_time_s"] > metrics["fit_time_s"] > 0
    assert metrics["val_perplexity"] < 0.8 * metrics["base_val_perplexity"]  # 4 steps already teach the format
    assert metrics["useful_tokens_per_s_per_rank"] == pytest.approx(metrics["useful_tokens_per_s"] / 2)
    assert 0 < metrics["padding_fraction"] < 0.2  # packed rows of 256
    adapter = Path(metrics["adapter_dir"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == smollm2_checkpoint  # plain peft finds the base by itself


def test_the_run_answers_held_out_questions_as_base_and_as_tuned_model(run):
    questions = [json.loads(line) for line in (REPO / "examples/medical_lora/data/heldout_questions.jsonl").open()]
    rows = [json.loads(line) for line in (run / "generations.jsonl").open()]
    assert [r["question"] for r in rows] == [q["question"] for q in questions[:2]]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)  # asked through the chat template
    assert all(r["generated"] and r["base_generated"] for r in rows)
    assert [r["generated"] for r in rows] != [r["base_generated"] for r in rows]  # the adapter changed the answers
    output = (run / "train.log").read_text()
    assert "base:  " + rows[0]["base_generated"] in output and "tuned: " + rows[0]["generated"] in output


def test_the_adapter_gives_the_trained_models_logits_in_plain_transformers_and_peft(run):
    """Top-5 next-token logits on the held-out prompts: the sharded model at the end of training against the adapter
    on transformers' own LLM.int8 base in a fresh process, within 1e-3 (sharded vs one-process reduction order)."""
    metrics = json.loads((run / "metrics.json").read_text())
    rows = [json.loads(line) for line in (run / "generations.jsonl").open()]
    prompts = json.dumps([r["prompt"] for r in rows])
    command = [sys.executable, "-c", RELOAD, metrics["adapter_dir"], prompts]
    proc = subprocess.run(command, cwd=run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    reloaded = json.loads(proc.stdout.strip().splitlines()[-1])
    for trained, plain in zip((r["next_token_top"] for r in rows), reloaded, strict=True):
        assert plain["ids"] == trained["ids"]
        assert max(abs(a - b) for a, b in zip(plain["logits"], trained["logits"], strict=True)) < 1e-3


@pytest.mark.parametrize("domain", DOMAINS)
def test_no_held_out_question_is_in_the_training_or_validation_files(domain):
    data = REPO / "examples" / domain / "data"
    seen = (data / "train.jsonl").read_text().lower() + (data / "val.jsonl").read_text().lower()
    questions = [json.loads(line) for line in (data / "heldout_questions.jsonl").open()]
    assert len(questions) >= 100 and all(q["answers"] for q in questions)
    assert not [q["question"] for q in questions if q["question"].lower() in seen]
    records = [json.loads(line) for line in (data / "train.jsonl").open()]
    trained = {r["instruction"].lower() for r in records}
    assert not trained & {q["question"].lower() for q in questions}
