"""Wrap-policy resolution against real models."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_fsdp_plus.policies import (
    largest_repeated_block_class,
    no_split_module_classes,
    select_unit_paths,
    validate_wrap_policy,
)
from tests.helpers.models import Block, make_model, tiny_llama


def test_auto_uses_transformers_no_split_modules():
    model = tiny_llama(layers=2)
    assert no_split_module_classes(model) == ["LlamaDecoderLayer"]
    assert select_unit_paths(model, "auto") == ["model.layers.0", "model.layers.1"]


def test_auto_falls_back_to_largest_repeated_block():
    model = make_model(layers=3)
    assert largest_repeated_block_class(model) is Block  # Linear repeats more often, but is smaller
    assert select_unit_paths(model, "auto") == ["blocks.0", "blocks.1", "blocks.2"]


def test_auto_on_a_model_without_repeats_gives_root_only():
    assert select_unit_paths(nn.Linear(3, 3), "auto") == []


def test_class_names_and_classes_resolve():
    model = make_model(layers=2)
    assert select_unit_paths(model, ["Block"]) == ["blocks.0", "blocks.1"]
    assert select_unit_paths(model, [nn.LayerNorm]) == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1",
                                                        "blocks.1.norm2", "norm"]  # fmt: skip
    assert select_unit_paths(model, ["tests.helpers.models.Block"]) == ["blocks.0", "blocks.1"]


def test_unknown_class_name_lists_candidates():
    with pytest.raises(ValueError, match="auto_wrap_policy: module class 'DecoderLayer' is not in the model; "
                                         "candidates: Block, Embedding, LayerNorm, Linear, ModuleList"):  # fmt: skip
        select_unit_paths(make_model(layers=1), ["DecoderLayer"])


def test_min_num_params_is_bottom_up():
    model = make_model(layers=2)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    paths = select_unit_paths(model, {"min_num_params": block})
    assert sorted(paths) == ["blocks.0", "blocks.1"]
    # a larger threshold groups both blocks into their container
    assert select_unit_paths(model, {"min_num_params": block + 1}) == ["blocks"]


def test_callable_policy():
    model = make_model(layers=2)
    assert select_unit_paths(model, lambda m: isinstance(m, nn.Embedding)) == ["embed"]


def test_none_means_root_only():
    assert select_unit_paths(make_model(layers=1), None) == []


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("blocks", "auto_wrap_policy='blocks' is not valid"),
        ({"min_params": 3}, "takes exactly one key, 'min_num_params'"),
        ({"min_num_params": 0}, "min_num_params=0 must be a positive integer"),
        ([3], "entry 3 is neither an nn.Module subclass nor a class name"),
    ],
)
def test_invalid_policies(policy, message):
    with pytest.raises(ValueError, match=message):
        validate_wrap_policy(policy)


def test_class_names_still_resolve_once_fsdp2_swapped_the_classes():
    """A fit after validate plans the sharded model again: each unit is then FSDP2's ``FSDP<Name>`` subclass, and a
    policy naming ``Name`` must still find it (it failed with 'module class ... is not in the model')."""
    from torch import nn

    from lightning_fsdp_plus.policies import select_unit_paths

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    class FSDPBlock(Block):  # what fully_shard makes of a Block instance's class
        pass

    model = nn.Sequential(Block(), Block())
    model[0].__class__ = FSDPBlock
    assert select_unit_paths(model, ["Block"]) == ["0", "1"]


def test_auto_makes_every_torch_transformer_block_a_unit_encoder_and_decoder_alike():
    """Lightning's docs language model (``lightning.pytorch.demos.Transformer``, an ``nn.Transformer``): the largest
    repeated class alone is the decoder layer, which left the encoder layers in the root."""
    from lightning.pytorch.demos import Transformer

    model = Transformer(vocab_size=100, nlayers=2)
    assert select_unit_paths(model, "auto") == [
        "transformer.encoder.layers.0", "transformer.encoder.layers.1",
        "transformer.decoder.layers.0", "transformer.decoder.layers.1",
    ]  # fmt: skip

    class MyLayer(nn.TransformerEncoderLayer):
        pass

    encoder = nn.TransformerEncoder(MyLayer(d_model=16, nhead=2), num_layers=3, enable_nested_tensor=False)
    assert select_unit_paths(encoder, "auto") == ["layers.0", "layers.1", "layers.2"]
