"""Packed rows compose with the strategy, 2 ranks (issue 47): every packed run trains exactly as the same examples one
per row, on each sharding strategy, LoRA on int8 and NF4 bases, activation checkpointing and compile, clipping on.

One ``torchrun`` launch of ``tests/helpers/packing_cases.py``.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import REPO, run_script
from tests.helpers.packing_cases import CASES, ROW_LEN, ROWS

TOLERANCE = {"llama/compiled": 1e-4}
"""fp32: 1e-5, as the issue asks; the compiled run against its eager reference: inductor's fused kernels round
differently."""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("packing")
    run_script(REPO / "tests" / "helpers" / "packing_cases.py", "--out", str(out), torchrun=2)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("name", [*CASES, "llama/compiled"])
def test_packed_rows_train_as_their_examples_one_per_row(results, name):
    case = results[name]
    tolerance = TOLERANCE.get(name, 1e-5)
    assert case["loss_diff"] <= tolerance and case["param_diff"] <= tolerance, case
    packed, single = case["positions"]["packed"], case["positions"]["single"]
    assert all(shape == [ROWS, ROW_LEN] for shape in packed)  # fixed shapes: what compile keeps static
    assert bool(case["compiled"]) == (name == "llama/compiled")
    # transformers' own packed-sequence route, through FSDP2's and PEFT's wrappers; the reference has masks
    assert case["route"] == "position_ids" and case["reference_route"] is None
    assert all(s[0] >= 2 * ROWS for s in single)  # the same examples took two rows or more each unpacked
