"""Activation checkpointing on the instruction data, 2 ranks: a checkpointed run equals the same run without it.

One ``torchrun`` launch of ``tests/helpers/ac_cases.py`` (33 fits, about 20 s): Llama, Qwen2, Phi-3, GPT-2 and BERT,
full fine-tune and LoRA on int8 and NF4 bases, on the shipped medical instructions (padding, attention masks,
prompt masking), the model called as a user calls it (its key/value cache on, the config's default); and the other
ways checkpointing is reached: the model's own ``gradient_checkpointing_enable()``, both together, the auto plan's
choice under a tight budget. Before the fix every decoder case failed in its first backward: the recomputed layer
appended its keys to the cache a second time ("The size of tensor a (192) must match the size of tensor b (96)").
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import REPO, run_script

TOLERANCE = 1e-6
"""fp32 losses and parameters (measured: identical, 0.0)."""
DECODERS = ("llama", "qwen2", "phi3", "gpt2")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("activation_checkpointing")
    run_script(REPO / "tests" / "helpers" / "ac_cases.py", "--out", str(out), torchrun=2)
    return json.loads((out / "results.json").read_text())


def _assert_equal_to_reference(case: dict) -> None:
    assert case["loss_diff"] <= TOLERANCE and case["param_diff"] <= TOLERANCE, case
    assert case["checkpointed"] and not case["reference_checkpointed"]
    assert case["flags_left_on"] == 0  # the model's own checkpointing never runs inside ours


CASES = [f"{arch}/{mode}" for arch in (*DECODERS, "bert") for mode in ("full", "lora_int8", "lora_nf4")
         if not (mode == "lora_nf4" and arch in ("gpt2", "bert"))]  # fmt: skip
"""NF4 on the Llama, Qwen2 and Phi-3 decoders; GPT-2 (Conv1D layers) and BERT take the int8 base."""


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_run_on_instruction_data_equals_the_run_without(results, name):
    arch = name.split("/")[0]
    case = results[name]
    _assert_equal_to_reference(case)
    layers = 3 if arch == "bert" else 2  # BERT's "auto" units: its two layers and BertEmbeddings
    assert len(case["checkpointed"]) == layers


@pytest.mark.parametrize("way", ["model_own", "both"])
def test_the_models_own_gradient_checkpointing_is_applied_once_by_the_plan(results, way):
    case = results[f"llama/{way}"]
    _assert_equal_to_reference(case)
    assert case["checkpointed"] == ["model.model.layers.0", "model.model.layers.1"]


def test_the_auto_plans_checkpointing_choice_trains_like_the_same_choice_without_it(results):
    case = results["llama/auto_plan"]
    assert case["auto"]["activation_checkpointing"]  # the tight budget left only checkpointed candidates
    _assert_equal_to_reference(case)
