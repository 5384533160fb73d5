"""Automatic tensor parallelism matches one process (issue 48): a Llama, a Qwen2 and a GQA Llama (KV heads < heads),
full and LoRA, with and without activation checkpointing, a tied GQA Qwen2, loss parallel (GQA Llama, Qwen2 LoRA),
and the Llama under SHARD_GRAD_OP, NO_SHARD and compile, clipping on, 10 steps at fp32, on 2 ranks (tensor 2) and on
4 (2 data-parallel x 2 tensor). One ``torchrun`` launch of ``tests/helpers/tp_cases.py`` per layout."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import REPO, run_script
from tests.helpers.tp_cases import CASES

LAYOUTS = {"tp2": 2, "dp2xtp2": 4}
"""Layout: ranks (tensor-parallel size 2 in both)."""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def results(request, tmp_path_factory) -> tuple[str, dict[str, dict]]:
    out = tmp_path_factory.mktemp(request.param)
    run_script(REPO / "tests" / "helpers" / "tp_cases.py", "--tp", "2", "--out", str(out),
               torchrun=LAYOUTS[request.param], timeout=900)  # fmt: skip
    return request.param, json.loads((out / "results.json").read_text())


def test_every_case_trains_as_one_process(results):
    layout, cases = results
    assert sorted(cases) == sorted(CASES)
    data_parallel = LAYOUTS[layout] // 2
    for name, case in cases.items():
        assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-5, (layout, name, case)
        no_shard = name.endswith("no_shard")  # replicas of one rank each
        expected = {"replicate": data_parallel if no_shard else 1, "shard": 1 if no_shard else data_parallel}
        assert case["mesh"] == {**expected, "tensor": 2}, (layout, name)
        assert bool(case["compiled"]) == name.endswith("compiled"), (name, case["compiled"])
        # every projection split over the tensor ranks (and sharded by FSDP2 over the data-parallel ones): 7 a layer,
        # and with LoRA one adapter matrix each, the one on the split side (lora_B of column-wise, lora_A of row-wise)
        split = case["placements"]
        weights = [k for k in split if k.endswith("weight")]  # Qwen2's q/k/v biases are split with their weights
        head = [k for k in weights if k.endswith("lm_head.weight")]
        assert len(head) == name.endswith("loss_parallel"), (name, head)  # split over the vocabulary, or whole
        assert len(weights) == 2 * 7 * (2 if "lora" in name else 1) + len(head), (name, sorted(split))
        assert {p[-1] for p in split.values()} == {"S(0)", "S(1)"}, split  # column-wise rows, row-wise columns
        if "lora" in name:
            assert split["model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"][-1] == "S(0)"
            assert split["model.base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight"][-1] == "S(1)"
        # each rank holds about 1/(tensor x data-parallel) of the split parameters, the rest 1/data-parallel
        shards = 1 if no_shard else data_parallel
        assert case["local_bytes"] < case["full_bytes"] / shards * 0.7, (name, case["local_bytes"])
