"""The shipped example data and tiny base: sizes, provenance, and reproducibility of the generating scripts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))


@pytest.mark.parametrize("domain", ["medical_lora", "legal_lora"])
def test_datasets_are_big_enough_disjoint_and_documented(domain):
    rows = {split: [json.loads(line) for line in (EXAMPLES / domain / "data" / f"{split}.jsonl").open()]
            for split in ("train", "val")}  # fmt: skip
    assert len(rows["train"]) >= 300 and len(rows["val"]) >= 60
    for row in rows["train"] + rows["val"]:
        assert set(row) <= {"instruction", "input", "response"} and row["instruction"] and row["response"]
    as_key = lambda r: (r["instruction"], r.get("input"))  # noqa: E731
    assert not {as_key(r) for r in rows["train"]} & {as_key(r) for r in rows["val"]}
    readme = (EXAMPLES / domain / "README.md").read_text()
    assert "Provenance" in readme and "License" in readme and "CC0" in readme


def test_the_generator_reproduces_the_shipped_files():
    import make_datasets

    for domain, rows, seed in (("medical_lora", make_datasets.medical_examples(), 11),
                               ("legal_lora", make_datasets.legal_examples(), 12)):  # fmt: skip
        train, val = make_datasets.split(rows, seed=seed)
        for split, expected in (("train", train), ("val", val)):
            shipped = [json.loads(line) for line in (EXAMPLES / domain / "data" / f"{split}.jsonl").open()]
            assert shipped == expected
    assert (EXAMPLES / "assets" / "corpus.txt").read_text() == make_datasets.corpus()


def test_the_tiny_base_is_small_and_loads():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = EXAMPLES / "assets" / "tiny-llama"
    assert sum(p.stat().st_size for p in base.iterdir()) <= 20 * 2**20
    model = AutoModelForCausalLM.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert model.config.model_type == "llama" and len(tokenizer) == model.config.vocab_size
    assert tokenizer.decode(tokenizer("Doctors describe gout.")["input_ids"]) == "Doctors describe gout."


def test_rebuilding_the_tiny_base_reproduces_it(tmp_path):
    """Same config, same tokenizer, and the first 20 of the 300 training steps' losses as recorded (the full rebuild,
    ``python examples/assets/build_tiny_base.py``, takes a minute on one core; its final losses are recorded too)."""
    shipped = EXAMPLES / "assets" / "tiny-llama"
    command = [sys.executable, str(EXAMPLES / "assets" / "build_tiny_base.py"), "--out", str(tmp_path), "--stop-after",
               "20"]  # fmt: skip
    proc = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((shipped / "config.json").read_text())
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((shipped / "tokenizer.json").read_text())
    rebuilt = json.loads((tmp_path / "build_info.json").read_text())["first_losses"]
    recorded = json.loads((shipped / "build_info.json").read_text())["first_losses"]
    assert len(rebuilt) == len(recorded) == 20 and rebuilt == pytest.approx(recorded, rel=1e-4)
    assert rebuilt[-1] < 0.8 * rebuilt[0]  # it learns from the first steps on
