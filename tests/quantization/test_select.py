"""Which frozen layers ``quantize_base`` converts: by what they compute, not by their class or name."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fsdp_plus.quantization import int8_candidates, kept_float
from tests.helpers.models import tiny_bert_mlm, tiny_falcon, tiny_llama


class ScaledLinear(nn.Linear):
    """A subclass that computes something else: never quantized as if it were a plain linear map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class NamedLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward: a plain linear map."""


def test_linear_subclasses_are_quantized_when_they_compute_the_same_map():
    falcon = tiny_falcon().requires_grad_(False)
    layers = int8_candidates(falcon)
    assert "transformer.h.0.self_attention.query_key_value" in layers and len(layers) == 8  # FalconLinear, 4 a layer
    model = nn.Sequential(NamedLinear(4, 4), ScaledLinear(4, 4), nn.Linear(4, 4)).requires_grad_(False)
    assert int8_candidates(model) == ["0", "2"]
    assert kept_float(model, skip=()) == {"1": "ScaledLinear overrides nn.Linear.forward (not known to be a plain"
                                               " linear map)"}  # fmt: skip


def test_output_heads_and_tied_weights_stay_float_whatever_their_name():
    bert = tiny_bert_mlm().requires_grad_(False)
    assert "cls.predictions.decoder" not in int8_candidates(bert)
    assert kept_float(bert, skip=()) == {"cls.predictions.decoder": "output embeddings (get_output_embeddings)"}
    tied = tiny_llama(tied=True).requires_grad_(False)
    assert "lm_head" not in int8_candidates(tied, skip=())  # no name to skip it by, still the head
    embedding_and_head = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)).requires_grad_(False)
    embedding_and_head[1].weight = embedding_and_head[0].weight  # tied outside transformers
    assert kept_float(embedding_and_head, skip=()) == {"1": "tied to 0.weight"}
    assert int8_candidates(embedding_and_head, skip=()) == []
