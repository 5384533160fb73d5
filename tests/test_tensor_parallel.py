"""The tensor-parallel plan on one process (issue 48): which layers a plan splits, in what style, through PEFT's
LoRA wrappers; the errors for a model without a plan, a pattern that matches nothing, and sizes that do not divide;
the options tensor parallelism refuses, before any process group exists."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.lora import apply_lora
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import MeshLayout
from lightning_fsdp_plus.tensor_parallel import (
    LOSS_PARALLEL,
    TensorParallelError,
    declared_plan,
    local_loss,
    local_shapes,
    resolve_plan,
)
from tests.helpers.ac_cases import LORA, UserLM


def _model(arch: str = "llama", **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    if arch == "gpt2":
        sizes = dict(vocab_size=96, n_embd=64, n_layer=2, n_head=4)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**sizes, **config}))


def test_the_declared_plan_splits_every_projection_and_lora_wrappers_are_followed():
    model = _model()
    layers = resolve_plan(model, size=2)
    assert declared_plan(model)["layers.*.self_attn.o_proj"] == "rowwise"
    assert layers["model.layers.1.self_attn.q_proj"] == "colwise"
    assert layers["model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(layers) == 2 * 7 and "lm_head" not in layers  # the head stays whole: no loss parallel by default
    module = UserLM(model)
    apply_lora(module, LORA)
    wrapped = resolve_plan(module, size=2)
    assert wrapped["model.base_model.model.model.layers.0.self_attn.k_proj"] == "colwise"  # PEFT's wrapper path


def test_a_given_plan_overrides_the_declared_one_and_bad_plans_say_what_to_give():
    model = _model()
    given = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    assert set(resolve_plan(model, size=2, given=given).values()) == {"colwise", "rowwise"}
    assert len(resolve_plan(model, size=2, given=given)) == 4
    with pytest.raises(TensorParallelError, match=r"GPT2LMHeadModel declares no tensor-parallel plan .*"
                                                  r"tensor_parallel_plan=\{'<path>\.q_proj': 'colwise'"):  # fmt: skip
        resolve_plan(_model("gpt2"), size=2)
    with pytest.raises(TensorParallelError, match=r"key 'layers\.\*\.attn\.c_attn' matches no module"):
        resolve_plan(model, size=2, given={"layers.*.attn.c_attn": "colwise"})
    with pytest.raises(TensorParallelError, match=r"model\.layers\.0\.input_layernorm is a LlamaRMSNorm, not an"):
        resolve_plan(model, size=2, given={"layers.*.input_layernorm": "colwise"})
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['x'\]='diagonal' is not one of colwise, rowwise"):
        FSDPPlusOptions(tensor_parallel_size=2, tensor_parallel_plan={"x": "diagonal"})


def test_heads_and_features_the_tensor_ranks_do_not_divide_are_refused_with_the_numbers():
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        resolve_plan(_model(), size=4)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=3 does not divide .*out_features=64"):
        resolve_plan(_model(), size=3)


def test_loss_parallel_splits_an_untied_head_over_the_vocabulary_and_refuses_what_it_cannot_split():
    model = _model()
    layers = resolve_plan(model, size=2, loss_parallel=True)
    assert layers["lm_head"] == LOSS_PARALLEL and len(layers) == 2 * 7 + 1
    assert local_shapes(model, layers, size=2)["lm_head.weight"] == (48, 64)  # half the vocabulary's rows
    module = UserLM(model)
    apply_lora(module, LORA)
    assert resolve_plan(module, size=2, loss_parallel=True)["model.base_model.model.lm_head"] == LOSS_PARALLEL
    with pytest.raises(TensorParallelError, match=r"lm_head shares its weight with the input embedding"
                                                  r" \(tie_word_embeddings\)"):  # fmt: skip
        resolve_plan(_model(tie_word_embeddings=True), size=2, loss_parallel=True)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2 does not divide the vocabulary of"
                                                  r" lm_head \(out_features=95\)"):  # fmt: skip
        resolve_plan(_model(vocab_size=95), size=2, loss_parallel=True)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(TensorParallelError, match=r"loss_parallel=True: Sequential has no output head"):
        resolve_plan(plain, size=2, given={"0": "colwise", "1": "rowwise"}, loss_parallel=True)
    with pytest.raises(ValueError, match=r"loss_parallel=True needs tensor_parallel_size > 1 .*tensor_parallel_size=1"):
        FSDPPlusOptions(loss_parallel=True)
    with pytest.raises(ValueError, match=r"loss_parallel='yes' must be true or false"):
        FSDPPlusOptions(tensor_parallel_size=2, loss_parallel="yes")


def test_a_replicated_dtensor_loss_reaches_lightning_as_a_plain_tensor_with_its_gradient():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        weight = torch.ones(3, requires_grad=True)
        loss = DTensor.from_local((weight * 2).sum(), init_device_mesh("cpu", (1,)), [Replicate()])
        out = local_loss({"loss": loss, "n": 1})
        assert type(out["loss"]) is torch.Tensor and out["n"] == 1 and out["loss"].item() == 6.0
        out["loss"].backward()
        assert weight.grad.tolist() == [2.0, 2.0, 2.0]
        plain = torch.tensor(1.0)
        assert local_loss(plain) is plain
    finally:
        dist.destroy_process_group()


def test_the_layout_divides_the_world_by_the_tensor_ranks():
    options = FSDPPlusOptions(tensor_parallel_size=2)
    assert options.mesh_layout(world_size=8) == MeshLayout(replicate=1, shard=4, tensor=2)
    assert options.mesh_layout(world_size=8).data_parallel == 4
    hybrid = FSDPPlusOptions(tensor_parallel_size=2, sharding_strategy="HYBRID_SHARD", hybrid_shard_size=2)
    assert hybrid.mesh_layout(world_size=8) == MeshLayout(replicate=2, shard=2, two_d=True, tensor=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the world size 6 .* valid sizes:"
                                         r" 1, 2, 3, 6"):  # fmt: skip
        FSDPPlusOptions(tensor_parallel_size=4).mesh_layout(world_size=6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantize_base": "int8", "lora": LORA}, r"with quantize_base='int8': bitsandbytes' int8/4-bit layers"),
        ({"lora": LORA, "lora_only": True}, r"with lora_only=True: the frozen base of a LoRA-only run is replicated"),
        (
            {"sharding_strategy": "auto", "memory_budget": "1GiB", "plan_batch_size": 1, "plan_seq_len": 8},
            r"with sharding_strategy='auto': the auto plan does not consider tensor parallelism",
        ),
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be a positive integer"),
    ],
)
def test_combinations_tensor_parallelism_does_not_take_are_refused_with_the_reason(options, message):
    with pytest.raises(ValueError, match=message):
        FSDPPlusOptions(**{"tensor_parallel_size": 2, **options})


def test_a_bad_layout_fails_in_the_trainer_and_in_fit_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the world size 3"):
        Trainer(strategy=FSDPPlusStrategy(tensor_parallel_size=2), accelerator="cpu", devices=3)
    trainer = Trainer(strategy=FSDPPlusStrategy(tensor_parallel_size=4), accelerator="cpu", devices=4,
                      logger=False, enable_checkpointing=False)  # fmt: skip
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a process group started"))
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        trainer.fit(UserLM(_model()), train_dataloaders=[{"input_ids": torch.zeros(1, 4, dtype=torch.long)}])
    assert not dist.is_initialized()
