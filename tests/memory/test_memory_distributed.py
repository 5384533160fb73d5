"""Estimates against 2-rank CPU runs measured by ``MemoryMonitor`` (the cases run in the batched launch)."""

from __future__ import annotations

import copy

import pytest

from lightning_fsdp_plus.memory.estimate import (
    count_activations,
    describe_module,
    estimate_memory,
    estimate_strategy,
)
from lightning_fsdp_plus.plan import ShardingStrategy
from lightning_fsdp_plus.precision import compute_dtype
from lightning_fsdp_plus.sharding import apply_activation_checkpointing
from tests.conftest import load_case
from tests.helpers.models import LORA, LORA_LLAMA, SEQ, Block, TinyLM, TokenDataset, lm_loss, tiny_llama

# case -> (strategy, hybrid_shard_size, precision, optimizer) as dist_cases.py runs them (TinyLM, batch 4 per rank)
TINY_CASES = {
    "full_shard_sgd": ("FULL_SHARD", None, "32-true", "sgd-momentum"),
    "full_shard_root_resharded_sgd": ("FULL_SHARD", None, "32-true", "sgd-momentum", False, True),
    "shard_grad_op_sgd": ("SHARD_GRAD_OP", None, "32-true", "sgd-momentum"),
    "no_shard_sgd": ("NO_SHARD", None, "32-true", "sgd-momentum"),
    "hybrid_shard_sgd": ("HYBRID_SHARD", 1, "32-true", "sgd-momentum"),
    "full_shard_adamw": ("FULL_SHARD", None, "32-true", "adamw"),
    "bf16_mixed": ("FULL_SHARD", None, "bf16-mixed", "sgd-momentum"),
    "ac_prefetch_sgd": ("FULL_SHARD", None, "32-true", "sgd-momentum", True),
}


def _tiny_estimate(
    strategy: str, hybrid: int | None, precision: str, optimizer: str, checkpointed: bool = False,
    reshard_root: bool = False,
):  # fmt: skip
    module = TinyLM()
    model = copy.deepcopy(module.model).to(compute_dtype(precision))  # forward runs in the compute dtype
    if checkpointed:  # as activation_checkpointing=["Block"] does
        apply_activation_checkpointing(model, [n for n, m in model.named_modules() if isinstance(m, Block)])
    batch = TokenDataset().data[:4].clone()  # its own storage, as a collated batch has (a view would count all)
    activations = count_activations(lambda: lm_loss(model(batch), batch), precision=precision)
    description = describe_module(module, activation_bytes=activations)
    return estimate_strategy(
        description,
        sharding_strategy=ShardingStrategy.parse(strategy),
        world_size=2,
        precision=precision,
        optimizer=optimizer,
        hybrid_shard_size=hybrid,
        reshard_root=reshard_root,
    )


def _assert_close(measured: dict, estimate, *, rel: float = 0.10) -> None:
    assert estimate.model_state_bytes_per_rank == pytest.approx(measured["model_state_peak"], rel=rel)
    assert estimate.peak_bytes_per_rank == pytest.approx(measured["peak"]["tensor_total"], rel=rel)
    assert estimate.activation_bytes_per_rank == pytest.approx(measured["activation_peak"], rel=rel)


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_estimate_matches_the_measured_run_within_10_percent(strategy_runs, case):
    estimate = _tiny_estimate(*TINY_CASES[case])
    for rank in load_case(strategy_runs[0], case).ranks:
        _assert_close(rank["monitor"], estimate)


def test_activation_checkpointing_shrinks_measured_and_estimated_activations_alike(strategy_runs):
    out = strategy_runs[0]
    measured = {c: load_case(out, c).rank0["monitor"]["activation_peak"] for c in ("ac_prefetch_sgd", "full_shard_sgd")}
    estimated = {c: _tiny_estimate(*TINY_CASES[c]).activation_bytes_per_rank for c in measured}
    assert measured["ac_prefetch_sgd"] < 0.7 * measured["full_shard_sgd"]
    assert estimated["ac_prefetch_sgd"] / estimated["full_shard_sgd"] == pytest.approx(
        measured["ac_prefetch_sgd"] / measured["full_shard_sgd"], rel=0.1
    )


def test_estimate_from_a_config_matches_the_llama_run(strategy_runs, tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)
    _, (estimate,) = estimate_memory(
        config=tmp_path, world_size=2, strategy="full_shard", precision="32-true", optimizer="adamw",
        batch_size=4, seq_len=SEQ,
    )  # fmt: skip
    for rank in load_case(strategy_runs[0], "llama_auto").ranks:
        _assert_close(rank["monitor"], estimate)


@pytest.mark.parametrize(("case", "lora_only"), [("lora_int8_replicated", True), ("lora_int8_sharded", False)])
def test_lora_int8_estimate_matches_the_measured_run(strategy_runs, tmp_path, case, lora_only):
    tiny_llama(0, **LORA_LLAMA).config.save_pretrained(tmp_path)
    model, (estimate,) = estimate_memory(
        config=tmp_path, world_size=2, strategy="FULL_SHARD", precision="32-true", optimizer="sgd-momentum",
        lora=LORA, lora_only=lora_only, quantize_base="int8", batch_size=4, seq_len=SEQ,
    )  # fmt: skip
    assert (model.to_dict()["replicated_params"] > 0) is lora_only
    for rank in load_case(strategy_runs[0], case).ranks:
        _assert_close(rank["monitor"], estimate)


def test_monitor_logs_max_over_ranks_and_empties_the_cache_when_due(strategy_runs):
    result = load_case(strategy_runs[0], "full_shard_sgd")
    for rank in result.ranks:
        monitor = rank["monitor"]
        assert monitor["empty_cache_steps"] == [2, 4]  # empty_cache_every_n_steps=2 over 6 steps
        assert monitor["steps_sampled"] == 6
        assert monitor["peak"]["device_reserved"] is None  # CPU: no caching allocator
        assert monitor["peak"]["device_allocated"] > monitor["peak"]["tensor_total"]  # the process holds more
    assert {"memory/tensor_total", "memory/activations", "memory/optimizer"} <= set(result.rank0["logged"])


def test_monitor_counts_shards_once_while_units_are_unsharded(strategy_runs):
    """SHARD_GRAD_OP after forward: local shards + every unit's full copy, not the full copy twice."""
    out = strategy_runs[0]
    full = load_case(out, "full_shard_sgd").rank0["monitor"]["peak"]
    sgo = load_case(out, "shard_grad_op_sgd").rank0["monitor"]["peak"]
    assert sgo["params"] == full["params"]  # the local shards
    assert sgo["unsharded_params"] == 4 * sum(p.numel() for p in TinyLM().parameters())  # one full fp32 copy
    assert sgo["unsharded_params"] <= 2 * full["params"]  # two shards: the full copy plus dim-0 padding
    # FULL_SHARD reshards every unit after forward but the root (kept gathered until backward, FSDP2's default),
    # unless reshard_root_after_forward
    root = [p.numel() for n, p in TinyLM().named_parameters() if ".blocks." not in f".{n}"]
    assert full["unsharded_params"] == 4 * sum(root) > 0
    assert load_case(out, "full_shard_root_resharded_sgd").rank0["monitor"]["peak"]["unsharded_params"] == 0
    assert sgo["activations"] == full["activations"]
