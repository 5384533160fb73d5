"""Shared fixtures: one batched multi-process launch for all strategy cases, and the single-process references."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.ckpt_runs import launch, result
from tests.helpers.launch import REPO, run_script
from tests.helpers.models import train_reference

DIST_CASES = REPO / "tests" / "helpers" / "dist_cases.py"
LORA_KINDS = ("lora_int8", "lora_nf4")
"""The LoRA checkpoint scenarios: a replicated int8 base (adapter-only checkpoint) and a sharded NF4 one."""


@dataclass
class CaseResult:
    """What one multi-process case left behind."""

    ranks: list[dict]
    state: dict[str, torch.Tensor]

    @property
    def rank0(self) -> dict:
        return self.ranks[0]


def load_case(out: Path, name: str, world_size: int = 2) -> CaseResult:
    """Read a case's per-rank JSON and rank 0's full state dict."""
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world_size)]
    return CaseResult(ranks=ranks, state=torch.load(out / f"{name}.pt", weights_only=True))


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory) -> tuple[Path, str]:
    """All cases of ``dist_cases.py`` in one 2-process ``torchrun`` launch: (out dir, output)."""
    out = tmp_path_factory.mktemp("strategy_runs")
    output = run_script(DIST_CASES, "--out", str(out), torchrun=2)  # both ranks import at once
    return out, output


@pytest.fixture(scope="session")
def compile_runs(tmp_path_factory) -> tuple[Path, str]:
    """Every compiled case of ``dist_cases.py`` (``COMPILED_CASES``) in one 2-process launch: (out dir, output)."""
    from tests.helpers.dist_cases import COMPILED_CASES

    out = tmp_path_factory.mktemp("compile_runs")
    output = run_script(DIST_CASES, "--out", str(out), "--cases", ",".join(COMPILED_CASES), torchrun=2)
    return out, output


@pytest.fixture(scope="session")
def reference():
    """Memoised single-process reference runs, keyed by their keyword arguments."""
    cache: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = train_reference(steps=6, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def ckpt_reference(tmp_path_factory) -> dict[str, tuple]:
    """Uninterrupted ``ckpt_cases.py`` runs — full fine-tune, LoRA on int8 and on NF4 bases — in one launch:
    (losses, final state, out dir) by kind."""
    out, kinds = tmp_path_factory.mktemp("reference"), ("full_ft", *LORA_KINDS)
    launch(out, "reference", "--kind", ",".join(kinds))
    return {kind: (*result(out / kind, "reference"), out / kind) for kind in kinds}
