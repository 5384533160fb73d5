"""The candidates the auto plan enumerates, and the options each one stands for."""

from __future__ import annotations

import torch

from lightning_fsdp_plus.autoplan.candidates import Candidate, enumerate_candidates, hybrid_sizes
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import ShardingStrategy


def test_hybrid_sizes_are_the_proper_divisors_of_the_world():
    assert hybrid_sizes(8) == [2, 4] and hybrid_sizes(2) == [] and hybrid_sizes(6) == [2, 3]


def test_full_fine_tune_on_cpu_has_strategies_times_checkpointing():
    candidates = enumerate_candidates(world_size=2, lora_run=False)
    assert len(candidates) == 3 * 3 and not any(c.lora_only or c.cpu_offload or c.quantize_base for c in candidates)
    assert [c.strategy_name for c in candidates[::3]] == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    # off, full and selective checkpointing for each
    assert [(c.activation_checkpointing, c.checkpointing_mode) for c in candidates[:3]] == [
        (False, "full"), (True, "full"), (True, "selective")]
    assert candidates[2].label == "FULL_SHARD + selective checkpointing"
    assert candidates[2].options(FSDPPlusOptions()).activation_checkpointing_mode == "selective"


def test_lora_on_eight_gpus_with_quantization_allowed():
    candidates = enumerate_candidates(world_size=8, lora_run=True, quantize=(None, "int8", "nf4"), accelerator=True)
    # FULL, SHARD_GRAD_OP, HYBRID/2, HYBRID/4 with lora_only on and off, NO_SHARD without: 9 layouts x 3 kinds x
    # 3 checkpointing choices x 2 offloads
    assert len(candidates) == 9 * 3 * 3 * 2 == len(set(candidates))
    assert not any(c.lora_only for c in candidates if c.sharding_strategy is ShardingStrategy.NO_SHARD)
    assert {c.hybrid_shard_size for c in candidates} == {None, 2, 4}
    assert {c.quantize_base for c in candidates} == {None, "int8", "nf4"}


def test_a_candidate_is_a_set_of_options():
    base = FSDPPlusOptions(sharding_strategy="auto", memory_budget="8GiB", plan_batch_size=1, plan_seq_len=8,
                           auto_wrap_policy=[torch.nn.Linear])  # fmt: skip
    candidate = Candidate(ShardingStrategy.HYBRID_SHARD, 4, lora_only=True, activation_checkpointing=True,
                          quantize_base="int8")  # fmt: skip
    options = candidate.options(base)
    assert not options.auto and options.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert options.hybrid_shard_size == 4 and options.lora_only and options.quantize_base == "int8"
    assert options.activation_checkpointing == [torch.nn.Linear]  # the wrap policy's units
    assert candidate.label == "HYBRID_SHARD/4 + lora_only + checkpointing + int8"
    assert Candidate(ShardingStrategy.NO_SHARD).options(base).activation_checkpointing is None


def test_a_resharded_root_is_an_option_and_a_label():
    base = FSDPPlusOptions(sharding_strategy="auto", memory_budget="8GiB", plan_batch_size=1, plan_seq_len=8)
    candidate = Candidate(ShardingStrategy.FULL_SHARD, reshard_root=True)
    assert candidate.options(base).reshard_root_after_forward and candidate.options(base).resharded_root
    assert candidate.label == "FULL_SHARD + root resharded"
    assert candidate.to_dict()["reshard_root_after_forward"] is True
    assert not Candidate(ShardingStrategy.FULL_SHARD).options(base).reshard_root_after_forward
