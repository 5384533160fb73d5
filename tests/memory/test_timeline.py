"""The step as a timeline of moments: which moment peaks, what is live then, and the per-unit counts behind it."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp_plus.loss import causal_lm_loss
from lightning_fsdp_plus.memory.estimate import estimate_memory
from lightning_fsdp_plus.memory.monitor import SavedActivations
from lightning_fsdp_plus.memory.timeline import UnitActivations, UnitCost, peak_moment, step_timeline
from tests.helpers.models import tiny_llama


def _units(reshards: bool) -> list[UnitCost]:
    return [UnitCost(path=f"b{i}", gathered=100, unsharded_grads=10, grad_shards=5, reshards=reshards,
                     activations=1000, largest_activation=50) for i in range(3)]  # fmt: skip


def test_moments_follow_the_step_and_the_peak_is_the_largest_one():
    root = UnitCost(path="", gathered=7, unsharded_grads=0, grad_shards=0, reshards=False, activations=0)
    moments = step_timeline(units=_units(True), root=root, stored=300, optimizer=30, optimizer_temporaries=15)
    names = [m.name for m in moments]
    assert names == ["forward <root>", "forward b0", "forward b1", "forward b2", "loss", "backward b2", "backward b1",
                     "backward b0", "backward <root>", "optimizer step"]  # fmt: skip
    assert peak_moment(moments).bytes == max(m.bytes for m in moments)
    by_name = {m.name: m for m in moments}
    # backward b2: every activation still alive, b2 gathered again, b1 prefetched, b2's gradients, 2 x its largest
    assert by_name["backward b2"].parts == {"stored": 300, "optimizer": 30, "activations": 3000, "gathered": 207,
                                            "grads": 10, "transient": 100}  # fmt: skip
    assert peak_moment(moments).name == "backward b2"
    # b2's activations are freed once its backward ran; its gradient shard stays
    assert by_name["backward b1"].parts["activations"] == 2000 and by_name["backward b1"].parts["grads"] == 5 + 10 + 10
    assert by_name["optimizer step"].parts == {"stored": 300, "optimizer": 30, "grads": 15, "transient": 15}
    # the step begins with the root's all-gather; on gloo the buffer it was gathered into is alive beside it
    gloo = {m.name: m for m in step_timeline(units=_units(True), root=root, stored=300, optimizer=30, gather_copies=1)}
    assert gloo["forward <root>"].parts == {"stored": 300, "optimizer": 30, "gathered": 7, "transient": 7}


def test_units_kept_gathered_add_up_in_forward_and_gloo_copies_count_while_gathering():
    root = UnitCost(path="", gathered=0, unsharded_grads=0, grad_shards=0, reshards=False, activations=0)
    kept = {m.name: m for m in step_timeline(units=_units(False), root=root, stored=0, optimizer=0)}
    assert kept["loss"].parts["gathered"] == 300  # SHARD_GRAD_OP: every unit's copy from its forward to backward
    copies = {m.name: m for m in step_timeline(units=_units(True), root=root, stored=0, optimizer=0, gather_copies=1)}
    assert copies["forward b1"].parts["transient"] == 100  # gloo's temporary of the unit being gathered


def test_a_frozen_first_unit_is_not_gathered_for_backward():
    root = UnitCost(path="", gathered=0, unsharded_grads=0, grad_shards=0, reshards=False, activations=0)
    units = [UnitCost(path="embed", gathered=500, unsharded_grads=0, grad_shards=0, reshards=True, activations=0,
                      in_backward=False), *_units(True)]  # fmt: skip
    names = [m.name for m in step_timeline(units=units, root=root, stored=0, optimizer=0)]
    assert "forward embed" in names and "backward embed" not in names


def test_unit_counts_add_up_to_the_whole_forward_and_leave_outputs_alone():
    model = tiny_llama(layers=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    layers = {model.model.layers[i]: f"model.layers.{i}" for i in range(3)}
    with SavedActivations() as whole:
        expected = causal_lm_loss(model, {"input_ids": ids})
    with UnitActivations(layers) as counter:
        loss = causal_lm_loss(model, {"input_ids": ids})
    assert torch.equal(loss, expected)  # the counting hooks change nothing
    per_unit = counter.by_unit()
    assert sum(per_unit.values()) == whole.bytes
    assert sum(per_unit.values()) == counter.bytes and per_unit[""] > 0  # the root's share: the loss's
    assert per_unit["model.layers.1"] == per_unit["model.layers.2"] > 0  # identical blocks save the same
    assert per_unit["model.layers.0"] >= per_unit["model.layers.1"]
    assert counter.order == ["model.layers.0", "model.layers.1", "model.layers.2"]


@pytest.fixture(scope="module")
def llama3_shaped(tmp_path_factory):
    """A Llama-3-shaped config: 128,256-token vocabulary, untied, GQA (small hidden size: quick on FakeTensors)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama3")
    config = LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    config.save_pretrained(path)
    return path


def test_at_a_128k_vocabulary_the_chunked_loss_drops_the_float32_logits_from_the_estimate(llama3_shaped):
    common = {"config": llama3_shaped, "world_size": 2, "strategy": "full_shard", "precision": "bf16-mixed",
              "batch_size": 8, "seq_len": 128, "lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
    plain_model, (plain,) = estimate_memory(**common, chunked_loss=False)
    chunked_model, (chunked,) = estimate_memory(**common)
    logits = 8 * 128 * 128256 * 4
    assert plain_model.activation_bytes - chunked_model.activation_bytes >= logits * 0.99
    assert plain.peak_with_transient_bytes_per_rank - chunked.peak_with_transient_bytes_per_rank >= logits
    # the embeddings and the head are units of their own: the root holds only the final norm
    assert chunked_model.unit_paths[-1] == "" and sum(p.numel for p in chunked_model.units[-1]) == 256
    assert chunked.peak_moment is not None and chunked.timeline


def test_selective_checkpointing_keeps_more_than_full_and_less_than_none(llama3_shaped):
    common = {"config": llama3_shaped, "world_size": 2, "strategy": "full_shard", "precision": "bf16-mixed",
              "batch_size": 4, "seq_len": 64}  # fmt: skip
    none, _ = estimate_memory(**common)
    full, _ = estimate_memory(**common, activation_checkpointing=True)
    selective, _ = estimate_memory(**common, activation_checkpointing=True, activation_checkpointing_mode="selective")
    assert full.activation_bytes < selective.activation_bytes < none.activation_bytes
    blocks = [i for i, p in enumerate(selective.unit_paths) if ".layers." in p]
    assert all(0 < selective.unit_recompute[i] < full.unit_recompute[i] for i in blocks)


def test_a_checkpointed_block_holds_its_recomputed_activations_once_in_backward(tmp_path):
    """The last block's backward moment against torch's own allocation trace of a real backward (non-reentrant
    checkpoint frees each recomputed tensor once its backward node has used it: one copy, not two)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.memory_trace import allocation_events, peak_breakdown
    from lightning_fsdp_plus.memory.assumptions import GRADIENT_TEMPORARIES
    from lightning_fsdp_plus.sharding import apply_activation_checkpointing

    model = tiny_llama(layers=2, hidden=256, intermediate=1024)
    model.config.save_pretrained(tmp_path)
    described, _ = estimate_memory(config=tmp_path, world_size=1, strategy="full_shard", precision="32-true",
                                   batch_size=2, seq_len=512, activation_checkpointing=True)  # fmt: skip
    last = described.unit_paths.index("model.model.layers.1")  # under the estimator's holder
    recompute, largest = described.unit_recompute[last], described.unit_largest[last]
    assert recompute > 5 * largest > 0  # the recomputed set dominates the block's backward

    apply_activation_checkpointing(model, ["model.layers.0", "model.layers.1"])
    for p in model.parameters():
        p.requires_grad_(False)  # the weights' gradients are not what is measured
    ids = torch.randint(0, model.config.vocab_size, (2, 512))
    hidden = model.model.embed_tokens(ids).detach().requires_grad_()
    loss = model(inputs_embeds=hidden, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    measured = peak_breakdown(allocation_events(prof, device="cpu"))["peak_bytes"]
    assert measured == pytest.approx(recompute + GRADIENT_TEMPORARIES * largest, rel=0.2)
    assert measured < 1.5 * recompute  # two copies (the recomputed set and as much again) would be 2x


@pytest.mark.parametrize(("precision", "per_element"), [("32-true", 12), ("bf16-true", 14)])
def test_the_chunked_loss_holds_three_float32_tensors_of_a_chunk_and_below_float32_its_logits(
    llama3_shaped, precision, per_element
):
    """float32 logits, cross-entropy's log-probabilities and the softmax that becomes the gradient (3 x 62.6 MiB
    traced at 128 x 128,256 in float32); in bf16 the logits before their upcast too, and a trained head's
    gradient summed in float32 before it is saved in bf16."""
    from lightning_fsdp_plus.loss import default_chunk_tokens

    described, _ = estimate_memory(config=llama3_shaped, world_size=1, strategy="full_shard", precision=precision,
                                   batch_size=8, seq_len=128)  # fmt: skip
    chunk = default_chunk_tokens(tokens=8 * 128, hidden=256, vocab=128256)
    accumulator = 4 * 128256 * 256 if precision == "bf16-true" else 0
    assert described.loss_transient_bytes == chunk * 128256 * per_element + accumulator
    # the head's gradient, saved by the loss in the compute dtype, belongs to the head's unit
    size = 4 if precision == "32-true" else 2
    loss_grads = dict(zip(described.unit_paths, described.unit_loss_grads, strict=True))
    assert loss_grads.pop("model.lm_head") == 128256 * 256 * size and set(loss_grads.values()) == {0}
    lora, _ = estimate_memory(config=llama3_shaped, world_size=1, strategy="full_shard", precision=precision,
                              batch_size=8, seq_len=128, lora={"r": 8, "target_modules": ["q_proj"]})  # fmt: skip
    assert set(lora.unit_loss_grads) == {0}  # a frozen head: the loss computes no gradient of it


def test_the_heads_backward_under_the_chunked_loss_only_scales_what_the_loss_saved():
    """Its backward holds the gradients the loss saved and their scaled copy (its unsharded gradients), with no
    other temporaries; tied into the root, the saved ones are gone by the end, where the embedding's dense gradient
    of the table is added to the table's."""
    root = UnitCost(path="", gathered=7, unsharded_grads=0, grad_shards=0, reshards=False, activations=0)
    head = UnitCost(path="head", gathered=400, unsharded_grads=400, grad_shards=200, reshards=True, activations=410,
                    largest_activation=400, loss_grads=400)  # fmt: skip
    moments = {m.name: m for m in step_timeline(units=[*_units(True), head], root=root, stored=0, optimizer=0)}
    # every activation (the saved gradients too), the head gathered again, the last block prefetched, the copy
    assert moments["backward head"].parts == {"stored": 0, "optimizer": 0, "activations": 3410, "gathered": 507,
                                              "grads": 400}  # fmt: skip
    tied = UnitCost(path="", gathered=400, unsharded_grads=400, grad_shards=200, reshards=False, activations=410,
                    largest_activation=400, loss_grads=400)  # fmt: skip
    end = {m.name: m for m in step_timeline(units=_units(True), root=tied, stored=0, optimizer=0)}["backward <root>"]
    assert end.parts == {"stored": 0, "optimizer": 0, "activations": 10, "gathered": 400, "grads": 415,
                         "transient": 400}  # fmt: skip
