"""Drop-in for Lightning's FSDPStrategy: every argument it takes is accepted and means the same on FSDP2."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, MixedPrecisionPolicy
from torch.distributed.fsdp import ShardingStrategy as FSDP1ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from lightning_fsdp_plus import FSDPPlusPrecision, FSDPPlusStrategy, ShardingStrategy
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import plan_model
from lightning_fsdp_plus.plan import MeshLayout
from tests.conftest import load_case
from tests.helpers.models import Block, TinyLM

BLOCKS = ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def _plan(**kwargs):
    options = FSDPPlusOptions(**kwargs)
    return plan_model(TinyLM(), options, layout=MeshLayout(1, 2), precision="32-true", device_type="cpu")


def _fsdp1_wraps(policy) -> list[str]:
    """What FSDP1 itself wraps under ``policy`` (its own recursive walk), root excluded."""
    model, chosen = TinyLM(), []
    _recursive_wrap(model, policy, lambda m, **_: chosen.append(m) or m, set(), set(), only_wrap_children=True)
    return [name for name, m in model.named_modules() if name and any(m is c for c in chosen)]


def test_every_fsdpstrategy_argument_is_an_argument_here():
    ours = set(inspect.signature(FSDPPlusStrategy).parameters)
    for name in inspect.signature(FSDPStrategy.__init__).parameters:
        if name not in ("self", "kwargs"):
            assert name in ours or name in ("activation_checkpointing_policy",), name
    FSDPPlusStrategy(activation_checkpointing_policy={Block})  # an alias: accepted through **kwargs


size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=5000)
transformer_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({Block}, BLOCKS),
        (ModuleWrapPolicy({Block}), BLOCKS),
        (CustomPolicy(lambda m: isinstance(m, Block)), BLOCKS),
        (transformer_policy, _fsdp1_wraps(transformer_policy)),
        (size_policy, _fsdp1_wraps(size_policy)),
        (None, []),
    ],
    ids=["set", "ModuleWrapPolicy", "CustomPolicy", "transformer_auto_wrap_policy", "size_based", "none"],
)
def test_fsdp1_wrap_policies_pick_the_modules_fsdp1_would_wrap(policy, expected):
    units = [u.path for u in _plan(auto_wrap_policy=policy).units if u.path]
    assert sorted(units) == sorted(expected)
    assert expected != [] or policy is None


@pytest.mark.parametrize(
    ("kwargs", "checkpointed"),
    [({"activation_checkpointing": Block}, BLOCKS), ({"activation_checkpointing": {Block}}, BLOCKS),
     ({"activation_checkpointing": ModuleWrapPolicy({Block})}, BLOCKS), ({"activation_checkpointing": "auto"}, BLOCKS)],
)  # fmt: skip
def test_activation_checkpointing_takes_classes_sets_and_policies(kwargs, checkpointed):
    assert sorted(_plan(**kwargs).activation_checkpointing) == checkpointed


def test_fsdp1_values_map_to_their_fsdp2_meaning():
    options = FSDPPlusOptions(
        sharding_strategy=FSDP1ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True),
        cpu_offload=CPUOffload(offload_params=True),
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    )
    assert options.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert options.mixed_precision == MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=True)
    assert options.cpu_offload is True and options.backward_prefetch == "BACKWARD_POST"
    zero2 = _plan(sharding_strategy="_HYBRID_SHARD_ZERO2")
    assert zero2.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert not any(u.reshard_after_forward for u in zero2.units)  # HSDP that keeps parameters until backward
    with pytest.warns(UserWarning, match="buffer_dtype=torch.bfloat16 is not applied: FSDP2 does not cast buffers"):
        FSDPPlusOptions(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))


def test_ignored_modules_are_replicated_and_left_out_of_fsdp():
    module = TinyLM()
    head = module.model.head
    for ignored in ([head], [head.weight]):
        options = FSDPPlusOptions(ignored_modules=ignored)
        plan = plan_model(module, options, layout=MeshLayout(1, 2), precision="32-true", device_type="cpu")
        assert [p.name for p in plan.replicated] == ["model.head.weight"]
    by_class = _plan(ignored_modules=["LayerNorm"]).replicated
    assert by_class and all(".norm" in p.name for p in by_class)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"use_orig_params": False}, ValueError, "use_orig_params=False is not supported.*valid choices: True"),
        ({"backward_prefetch": None}, ValueError, "backward_prefetch=None is not supported: FSDP2 always prefetches"),
        ({"mixed_precision": MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True)}, ValueError,
         "keep_low_precision_grads=True has no FSDP2 meaning"),
        ({"activation_checkpointing": Block, "activation_checkpointing_policy": {Block}}, ValueError,
         r"activation_checkpointing=\.\.\. and activation_checkpointing_policy=\.\.\. are mutually exclusive"),
    ],
)  # fmt: skip
def test_what_has_no_fsdp2_meaning_is_refused_with_the_reason(kwargs, error, message):
    with pytest.raises(error, match=message):
        FSDPPlusStrategy(**kwargs)


def test_lightning_plumbing_arguments_and_fsdp_precision_are_taken():
    strategy = FSDPPlusStrategy(precision_plugin=FSDPPrecision("bf16-mixed"), device_id=0, limit_all_gathers=False,
                                state_dict_type="full", device_mesh=(1, 2),
                                sharding_strategy="HYBRID_SHARD")  # fmt: skip
    assert isinstance(strategy.precision_plugin, FSDPPlusPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.mesh_layout == MeshLayout(replicate=1, shard=2, two_d=True)


def test_process_group_becomes_the_mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        strategy = FSDPPlusStrategy(process_group=dist.group.WORLD)
        assert strategy.options.mesh_layout(world_size=1) == MeshLayout(replicate=1, shard=1)
    finally:
        dist.destroy_process_group()


def test_fsdpstrategy_arguments_train_like_the_native_ones(strategy_runs):
    """2 ranks: FSDPStrategy-style arguments (sets, FSDP1 enum, MixedPrecision, sync_module_states) vs ours."""
    native = load_case(strategy_runs[0], "bf16_mixed")
    lightning = load_case(strategy_runs[0], "lightning_fsdp_args")
    for ours, theirs in zip(native.ranks, lightning.ranks, strict=True):
        assert theirs["losses"] == pytest.approx(ours["losses"], abs=1e-6)  # rank 1's other weights were replaced
    for name, tensor in native.state.items():
        torch.testing.assert_close(lightning.state[name], tensor, atol=1e-6, rtol=0)
