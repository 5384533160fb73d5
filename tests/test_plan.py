"""The sharding plan as pure data: strategies, mesh layouts, unit ownership and bytes per rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fsdp_plus.plan import (
    MeshLayout,
    ShardingStrategy,
    build_sharding_plan,
    resolve_mesh_layout,
    sharded_bytes,
)
from tests.helpers.models import make_model, tiny_bert_mlm, tiny_llama


@pytest.mark.parametrize("name", ["full_shard", "FULL_SHARD", "Full_Shard"])
def test_strategy_names_are_case_insensitive(name):
    assert ShardingStrategy.parse(name) is ShardingStrategy.FULL_SHARD


def test_unknown_strategy_error_names_key_value_and_choices():
    with pytest.raises(ValueError, match="sharding_strategy='FULLSHARD' is not one of FULL_SHARD, SHARD_GRAD_OP, "
                                         "NO_SHARD, HYBRID_SHARD"):  # fmt: skip
        ShardingStrategy.parse("FULLSHARD")


@pytest.mark.parametrize(
    ("strategy", "hybrid", "expected", "reshard"),
    [
        ("FULL_SHARD", None, MeshLayout(1, 8), True),
        ("SHARD_GRAD_OP", None, MeshLayout(1, 8), False),
        ("NO_SHARD", None, MeshLayout(8, 1, two_d=True), False),
        ("HYBRID_SHARD", 4, MeshLayout(2, 4, two_d=True), True),
        ("HYBRID_SHARD", None, MeshLayout(1, 8, two_d=True), True),
    ],
)
def test_fsdp2_mapping(strategy, hybrid, expected, reshard):
    parsed = ShardingStrategy.parse(strategy)
    assert resolve_mesh_layout(sharding_strategy=parsed, world_size=8, hybrid_shard_size=hybrid) == expected
    assert parsed.reshard_after_forward is reshard


def test_hybrid_shard_size_must_divide_world_size():
    with pytest.raises(
        ValueError, match=r"hybrid_shard_size=3 does not divide the world size 8; valid choices: 1, 2, 4, 8"
    ):
        resolve_mesh_layout(sharding_strategy=ShardingStrategy.HYBRID_SHARD, world_size=8, hybrid_shard_size=3)


def test_sharded_bytes_pad_dim_zero_like_fsdp2():
    assert sharded_bytes((10, 3), torch.float32, 4) == 3 * 3 * 4  # ceil(10/4) rows
    assert sharded_bytes((8,), torch.bfloat16, 2) == 4 * 2
    assert sharded_bytes((), torch.float32, 2) == 4
    assert sharded_bytes((5, 7), torch.int8, 1) == 35


def test_plan_assigns_each_parameter_to_its_innermost_unit():
    model = make_model(layers=2)
    plan = build_sharding_plan(
        model, unit_paths=["blocks.0", "blocks.1"], sharding_strategy=ShardingStrategy.FULL_SHARD, mesh=MeshLayout(1, 2)
    )
    assert [u.path for u in plan.units] == ["blocks.0", "blocks.1", ""]
    block = plan.unit("blocks.0")
    assert block.num_params == sum(p.numel() for p in model.blocks[0].parameters())
    root = plan.unit("")
    assert {p.name for p in root.params} == {"embed.weight", "norm.weight", "norm.bias", "head.weight"}
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in model.parameters())
    expected = sum(sharded_bytes(p.shape, p.dtype, 2) for p in model.parameters())
    assert plan.bytes_per_rank == expected


def test_nested_units_are_applied_children_first():
    model = make_model(layers=2)
    plan = build_sharding_plan(
        model, unit_paths=["blocks", "blocks.1.up", "blocks.0"], sharding_strategy=ShardingStrategy.FULL_SHARD,
        mesh=MeshLayout(1, 2),
    )  # fmt: skip
    order = [u.path for u in plan.units]
    assert order.index("blocks.1.up") < order.index("blocks") and order.index("blocks.0") < order.index("blocks")
    assert order[-1] == ""


def test_ignored_parameters_are_replicated_and_counted_in_full():
    model = make_model(layers=1)
    frozen = {model.head.weight}
    plan = build_sharding_plan(
        model,
        unit_paths=[],
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mesh=MeshLayout(1, 4),
        ignored_params=frozen,
    )
    assert [p.name for p in plan.replicated] == ["head.weight"]
    assert plan.replicated[0].bytes_per_rank == model.head.weight.numel() * 4
    assert "head.weight" not in {p.name for p in plan.unit("").params}
    assert "<ignored by FSDP>" in plan.format_table()


def test_param_kinds_mark_trainable_frozen_and_int8():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    model[1].weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    plan = build_sharding_plan(
        model, unit_paths=[], sharding_strategy=ShardingStrategy.FULL_SHARD, mesh=MeshLayout(1, 2)
    )
    kinds = {p.name: p.kind for p in plan.unit("").params}
    assert kinds == {"0.weight": "frozen", "0.bias": "trainable", "1.weight": "int8", "1.bias": "trainable"}
    assert plan.unit("").dtypes == ("float32", "int8")


def test_table_lists_llama_decoder_layers():
    from lightning_fsdp_plus.policies import select_unit_paths

    model = tiny_llama(layers=3)
    plan = build_sharding_plan(
        model, unit_paths=select_unit_paths(model, "auto"), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mesh=MeshLayout(1, 2),
    )  # fmt: skip
    table = plan.format_table()
    assert table.splitlines()[0] == "Sharding plan: SHARD_GRAD_OP, mesh replicate=1 x shard=2, 4 FSDP units"
    for i in range(3):
        assert f"model.layers.{i}  LlamaDecoderLayer" in table
    assert plan.to_dict()["units"][-1]["path"] == "<root>"


def test_unknown_unit_path_is_rejected():
    with pytest.raises(ValueError, match=r"unit paths not found in the model: \['blocks.9'\]"):
        build_sharding_plan(
            make_model(layers=1), unit_paths=["blocks.9"], sharding_strategy=ShardingStrategy.FULL_SHARD,
            mesh=MeshLayout(1, 2),
        )  # fmt: skip


def _plan(model, policy):
    from lightning_fsdp_plus.policies import select_unit_paths

    paths = select_unit_paths(model, policy)
    return paths, build_sharding_plan(model, unit_paths=paths, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                      mesh=MeshLayout(1, 2))  # fmt: skip


def test_bert_mlm_keeps_its_tied_decoder_and_word_embeddings_in_one_unit():
    model = tiny_bert_mlm()
    paths, plan = _plan(model, "auto")
    assert "bert.embeddings" in paths  # _no_split_modules names BertEmbeddings, whose weight the decoder shares
    assert [u.path for u in plan.units] == ["bert.encoder.layer.0", "bert.encoder.layer.1", ""]
    embeddings, bias = plan.tied
    assert embeddings.names == ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")
    assert (embeddings.unit, embeddings.merged) == ("", ("bert.embeddings",))
    assert (bias.names, bias.unit, bias.merged) == (("cls.predictions.bias", "cls.predictions.decoder.bias"), "", ())
    root = {p.name for p in plan.unit("").params}
    assert {n for n, _ in model.bert.embeddings.named_parameters(prefix="bert.embeddings")} <= root
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in model.parameters())  # each tensor once
    assert ("tied weights: bert.embeddings.word_embeddings.weight = cls.predictions.decoder.weight in unit <root>"
            " (bert.embeddings: not a unit, it would split them)") in plan.format_table()  # fmt: skip
    assert plan.to_dict()["tied"][0] == {
        "names": list(embeddings.names),
        "unit": "<root>",
        "merged": ["bert.embeddings"],
    }


def test_a_tied_llama_head_stays_with_its_embedding_whatever_the_policy_chooses():
    model = tiny_llama(tied=True)
    _, auto = _plan(model, "auto")  # decoder layers only: the embedding and the head are both in the root already
    assert [(t.names, t.unit, t.merged) for t in auto.tied] == [
        (("model.embed_tokens.weight", "lm_head.weight"), "", ())
    ]
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    paths, plan = _plan(model, {nn.Embedding, LlamaDecoderLayer})
    assert "model.embed_tokens" in paths and "model.embed_tokens" not in [u.path for u in plan.units]
    assert plan.tied[0].merged == ("model.embed_tokens",)
    _, untied = _plan(tiny_llama(), {nn.Embedding, LlamaDecoderLayer})
    assert "model.embed_tokens" in [u.path for u in untied.units] and not untied.tied  # nothing to keep together


def test_units_that_exist_already_are_described_as_they_are():
    model = tiny_llama(tied=True)
    plan = build_sharding_plan(model, unit_paths=["model.embed_tokens"], sharding_strategy=ShardingStrategy.FULL_SHARD,
                               mesh=MeshLayout(1, 2), keep_tied_together=False)  # fmt: skip
    assert [u.path for u in plan.units] == ["model.embed_tokens", ""]
    assert (plan.tied[0].unit, plan.tied[0].merged) == ("model.embed_tokens", ())


def test_the_root_stays_gathered_from_forward_to_backward_unless_asked_and_the_table_says_so():
    from lightning_fsdp_plus.policies import select_unit_paths

    model = tiny_llama(layers=2)
    paths = select_unit_paths(model, "auto")

    def plan(strategy, **kwargs):
        return build_sharding_plan(model, unit_paths=paths, sharding_strategy=strategy, mesh=MeshLayout(1, 2), **kwargs)

    kept = plan(ShardingStrategy.FULL_SHARD)
    assert [u.reshard_after_forward for u in kept.units] == [True, True, False]  # the root last
    root = kept.units[-1].num_params
    assert f"root kept gathered from forward to backward: +{root:,} params'" in kept.format_table()
    lean = plan(ShardingStrategy.FULL_SHARD, reshard_root_after_forward=True)
    assert all(u.reshard_after_forward for u in lean.units) and "root kept" not in lean.format_table()
    # nothing reshards under SHARD_GRAD_OP: the root is like every unit, nothing to point out
    grad_op = plan(ShardingStrategy.SHARD_GRAD_OP, reshard_root_after_forward=True)
    assert not any(u.reshard_after_forward for u in grad_op.units) and "root kept" not in grad_op.format_table()
