"""FSDPPlusOptions: one declaration of every option — defaults, validation, docs, and every consumer using it."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.app.config.schema import StrategyChoice, StrategySchema
from lightning_fsdp_plus.compat import compat_markdown
from lightning_fsdp_plus.memory.cli import build_parser
from lightning_fsdp_plus.options import FSDPPlusOptions, field_docs, options_markdown
from lightning_fsdp_plus.plan import MeshLayout, ShardingStrategy
from tests.helpers.launch import REPO

FIELDS = [f.name for f in dataclasses.fields(FSDPPlusOptions)]


def test_every_option_has_one_docstring_and_the_docs_tables_are_generated_from_it():
    docs = field_docs()
    assert set(docs) == set(FIELDS) and all(len(docs[name]) > 20 for name in FIELDS)
    assert options_markdown() in (REPO / "docs" / "reference" / "options.md").read_text()
    assert compat_markdown() in (REPO / "docs" / "migrating.md").read_text()
    assert f"`{FIELDS[0]}` |" in options_markdown() and options_markdown().count("\n") == len(FIELDS) + 2
    # the strategy's docstring and the estimator's help are generated from the same text, not written again
    assert docs["lora_only"] in " ".join(FSDPPlusStrategy.__doc__.split())
    help_text = " ".join(build_parser().format_help().split())
    assert " ".join(docs["lora_only"].split()[:8]) in help_text


def test_the_hydra_schema_is_derived_field_by_field():
    schema = {f.name: f for f in dataclasses.fields(StrategySchema)}
    assert list(schema) == ["_target_", *FIELDS]
    assert schema["timeout"].default == FSDPPlusOptions().timeout.total_seconds()
    assert schema["quantize_skip"].default_factory() == list(FSDPPlusOptions().quantize_skip)
    # a strategy name or "auto" (the options validate both); the auto plan's list and optional number
    assert schema["sharding_strategy"].type is StrategyChoice and schema["sharding_strategy"].default == "FULL_SHARD"
    assert [c.name for c in StrategyChoice] == [*ShardingStrategy.__members__, "AUTO"]
    assert schema["cpu_offload"].type is bool and schema["allow_quantize"].default_factory() == []
    assert schema["link_bandwidth"].type == float | None and schema["plan_batch_size"].type == int | None


def test_defaults_and_normalisation():
    options = FSDPPlusOptions(sharding_strategy="shard_grad_op", timeout=60, quantize_skip=["lm_head", "head*"],
                              mixed_precision={"param_dtype": "bf16"},
                              activation_checkpointing=torch.nn.Linear)  # fmt: skip
    assert options.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP and not options.resharded_after_forward
    assert options.timeout == timedelta(seconds=60) and options.quantize_skip == ("lm_head", "head*")
    assert options.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert options.activation_checkpointing == [torch.nn.Linear]
    assert options.replace() == options  # normalised values validate again unchanged
    assert FSDPPlusOptions(lora={"r": 4, "target_modules": ["q_proj"]}).lora.r == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sharding_strategy": "ZERO3"}, "sharding_strategy='ZERO3' is not one of FULL_SHARD, SHARD_GRAD_OP"),
        ({"cpu_offload": "yes"}, "cpu_offload='yes' must be true or false"),
        ({"state_dict_type": "local"}, "state_dict_type='local' is not one of sharded, full"),
        ({"backward_prefetch": "EARLY"}, "backward_prefetch='EARLY' is not one of BACKWARD_PRE, BACKWARD_POST"),
        ({"timeout": -1}, "timeout=-1 must be a datetime.timedelta or a positive number of seconds"),
        ({"device_mesh": (2, 0)}, r"device_mesh=\(2, 0\) must be a \(replicate, shard\) tuple"),
        ({"int8_threshold": "high"}, "int8_threshold='high' must be a number"),
        ({"param_init_fn": 3}, "param_init_fn=3 must be a callable"),
        ({"ignored_modules": [3]}, "ignored_modules entry 3 is neither a module, a parameter nor a class name"),
        ({"reshard_after_forward": 2}, "reshard_after_forward=2 must be true or false"),
        ({"sharding_strategy": "fastest"}, r"'fastest' is not one of FULL_SHARD, .*HYBRID_SHARD, or auto"),
        ({"sharding_strategy": "auto"}, "sharding_strategy='auto' needs memory_budget, plan_batch_size, plan_seq_len"),
        (
            {"sharding_strategy": "AUTO", "memory_budget": "8GiB", "plan_batch_size": 1},
            "needs plan_seq_len: it picks the configuration whose peak memory for one step fits, so it must know"
            " plan_seq_len: the longest sequence in tokens those batches carry",
        ),
        ({"memory_budget": "lots"}, r"memory_budget='lots' is not a size \(a number of bytes.* or a fraction"),
        ({"memory_budget": 1.5}, "memory_budget=1.5 is not a size"),
        ({"memory_margin": 1.0}, r"memory_margin=1.0 must be a fraction of memory_budget in \[0, 1\)"),
        ({"allow_quantize": "int8"}, "allow_quantize='int8' must be a list of int8, nf4, fp4"),
        ({"allow_quantize": ["int4"]}, "allow_quantize has 'int4', which is not one of int8, nf4, fp4"),
        ({"link_bandwidth": 0}, "link_bandwidth=0 must be a positive number of GB/s"),
        ({"plan_seq_len": 0}, "plan_seq_len=0 must be a positive integer"),
        (
            {
                "sharding_strategy": "auto",
                "memory_budget": 0.9,
                "plan_batch_size": 1,
                "plan_seq_len": 8,
                "device_mesh": (1, 2),
            },
            "sharding_strategy='auto' chooses the mesh: device_mesh must be None",
        ),
    ],
)
def test_bad_values_name_the_key_the_value_and_the_choices(fields, message):
    with pytest.raises(ValueError, match=message):
        FSDPPlusOptions(**fields)


def test_auto_is_kept_until_the_plan_resolves_it():
    options = FSDPPlusOptions(sharding_strategy="Auto", memory_budget="40GiB", plan_batch_size=2, plan_seq_len=512,
                              allow_quantize=["nf4", "int8", "nf4"])  # fmt: skip
    assert options.auto and options.sharding_strategy == "auto" and options.allow_quantize == ("nf4", "int8")
    with pytest.raises(RuntimeError, match="resolved by the auto plan"):
        options.mesh_layout(world_size=2)
    assert not FSDPPlusOptions(memory_budget="1GiB").auto  # a budget alone changes nothing


def test_mesh_layout_follows_the_strategy_hybrid_size_and_a_mesh_tuple():
    assert FSDPPlusOptions().mesh_layout(world_size=4) == MeshLayout(replicate=1, shard=4)
    hybrid = FSDPPlusOptions(sharding_strategy="HYBRID_SHARD")
    assert hybrid.mesh_layout(world_size=8, devices_per_node=4) == MeshLayout(replicate=2, shard=4, two_d=True)
    assert FSDPPlusOptions(device_mesh=(2, 2)).mesh_layout(world_size=4) == MeshLayout(2, 2, two_d=True)
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\) has 4 ranks but the world size is 8"):
        FSDPPlusOptions(device_mesh=(2, 2)).mesh_layout(world_size=8)
    with pytest.raises(ValueError, match="hybrid_shard_size=3 does not divide the world size 4; valid choices: 1, 2"):
        FSDPPlusOptions(hybrid_shard_size=3).mesh_layout(world_size=4)


def test_the_strategy_takes_an_options_object_and_keywords_override_it():
    options = FSDPPlusOptions(sharding_strategy="NO_SHARD", lora_only=True)
    strategy = FSDPPlusStrategy(options=options, log_grad_norm=False)
    assert strategy.options == options.replace(log_grad_norm=False)
    assert strategy.sharding_strategy is ShardingStrategy.NO_SHARD
    assert strategy.lora_only and not strategy.log_grad_norm
    assert FSDPPlusStrategy("hybrid_shard").options.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert FSDPPlusStrategy("shard_grad_op", options=options).sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(TypeError, match=r"unexpected argument 'shard_size'; valid arguments: .*auto_wrap_policy"):
        FSDPPlusStrategy(shard_size=2)
    with pytest.raises(AttributeError, match="no attribute 'no_such_option'"):
        _ = strategy.no_such_option


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"memory_budget": "20GiB"}, "memory_budget='20GiB': read only by sharding_strategy='auto', and"
         " sharding_strategy='FULL_SHARD' is pinned, so it would be ignored; set sharding_strategy='auto'"),
        ({"sharding_strategy": "NO_SHARD", "plan_batch_size": 4, "allow_quantize": ["int8"]},
         "plan_batch_size=4, allow_quantize=('int8',): read only by .* they would be ignored; .* or drop"
         " plan_batch_size, allow_quantize"),
    ],
)  # fmt: skip
def test_auto_plan_options_beside_a_pinned_strategy_are_refused_where_users_give_them(fields, message):
    from lightning_fsdp_plus import FSDPPlusStrategy
    from lightning_fsdp_plus.options import refuse_ignored

    options = FSDPPlusOptions(**fields)  # the plan's own copies pin a strategy and keep the budget: allowed
    with pytest.raises(ValueError, match=re.escape(message).replace(r"\.\*", ".*")):
        refuse_ignored(options)
    with pytest.raises(ValueError, match=re.escape(message).replace(r"\.\*", ".*")):
        FSDPPlusStrategy(**fields)
    refuse_ignored(options.replace(sharding_strategy="auto", memory_budget=0.9, plan_batch_size=1, plan_seq_len=8))
