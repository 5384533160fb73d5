"""FSDPPlusStrategy in one process: registration, argument handling, and errors raised before any process group."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry
from torch import nn

import lightning_fsdp_plus
from lightning_fsdp_plus import FSDPPlusPrecision, FSDPPlusStrategy, ShardingStrategy
from lightning_fsdp_plus.app.lm import CausalLMModule
from tests.helpers.models import TinyLM, tiny_llama


def cpu_trainer(**kwargs) -> Trainer:
    kwargs.setdefault("strategy", "fsdp_plus")
    return Trainer(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, **kwargs)


def test_import_registers_fsdp_plus_without_the_gpu_only_check():
    assert "fsdp_plus" in StrategyRegistry and "fsdp_plus_spawn" in StrategyRegistry
    assert "fsdp_plus" not in FSDPStrategy.get_registered_strategies()
    trainer = cpu_trainer()
    assert isinstance(trainer.strategy, FSDPPlusStrategy)
    assert trainer.strategy.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert isinstance(trainer.precision_plugin, FSDPPlusPrecision)
    assert trainer.precision_plugin.device == "cpu"
    assert cpu_trainer(strategy="fsdp_plus_spawn").strategy.start_method == "spawn"
    assert lightning_fsdp_plus.__version__


def test_trainer_precision_reaches_the_plugin():
    trainer = cpu_trainer(precision="bf16-mixed")
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.device == "cpu"


def test_explicit_fp16_plugin_on_cpu_keeps_fp16():
    trainer = cpu_trainer(plugins=[FSDPPlusPrecision("16-mixed")])
    assert trainer.precision_plugin.precision == "16-mixed" and trainer.precision_plugin.scaler is not None


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "bf16-true", "32-true"])
def test_a_strategy_instance_takes_every_precision_the_string_takes(precision):
    # Lightning refuses precision="16-mixed" for any ModelParallelStrategy instance (fp16 is the only mixed
    # precision of T4/V100 GPUs); FSDPPlusStrategy is no longer one, and says it is distributed itself
    by_name = cpu_trainer(precision=precision)
    by_instance = cpu_trainer(strategy=FSDPPlusStrategy(), precision=precision)
    assert by_instance.precision_plugin.precision == by_name.precision_plugin.precision
    assert isinstance(by_instance.precision_plugin, FSDPPlusPrecision)
    assert by_instance._accelerator_connector.is_distributed
    assert not isinstance(by_instance.strategy, ModelParallelStrategy)


def test_sampler_covers_every_rank_in_every_strategy():
    strategy = cpu_trainer(strategy=FSDPPlusStrategy("hybrid_shard", hybrid_shard_size=1)).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_sharding_plan_before_setup_says_when_it_exists():
    with pytest.raises(RuntimeError, match="computed in setup"):
        _ = FSDPPlusStrategy().sharding_plan


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FSDPPlusStrategy("FULLSHARD"),
         "sharding_strategy='FULLSHARD' is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD"),
        (lambda: FSDPPlusStrategy(use_orig_params=False),
         "use_orig_params=False is not supported.*valid choices: True"),
        (lambda: FSDPPlusStrategy(hybrid_shard_size=0), "hybrid_shard_size=0 must be a positive integer"),
        (lambda: FSDPPlusStrategy(start_method="thread"), "start_method='thread' is not one of popen, spawn"),
        (lambda: FSDPPlusStrategy(activation_checkpointing="Block"), "activation_checkpointing='Block' must be a list"),
        (lambda: FSDPPlusStrategy(mixed_precision={"param_dtype": "int4"}), "mixed_precision.param_dtype='int4'"),
        (lambda: cpu_trainer(strategy=FSDPPlusStrategy("HYBRID_SHARD", hybrid_shard_size=3)),
         "hybrid_shard_size=3 does not divide the world size 2; valid choices: 1, 2"),
        (lambda: cpu_trainer(precision="64-true"), "precision='64-true' is not supported by fsdp_plus; choose one of"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_early_with_key_value_and_choices(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (FSDPPlusStrategy(auto_wrap_policy=["DecoderLayer"]),
         "auto_wrap_policy: module class 'DecoderLayer' is not in the model; candidates: Block, Embedding"),
        (FSDPPlusStrategy(activation_checkpointing=["Attention"]),
         "activation_checkpointing: module class 'Attention' is not in the model; candidates: Block"),
    ],
)  # fmt: skip
def test_unknown_classes_fail_in_fit_before_any_process_starts(strategy, message):
    trainer = cpu_trainer(strategy=strategy, max_steps=1)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyLM())
    assert not dist.is_initialized()
    assert "LOCAL_RANK" not in os.environ  # the launcher never ran


def test_lora_and_int8_argument_errors_at_construction(monkeypatch):
    with pytest.raises(ValueError, match="quantize_base='int4' is not one of None, int8, nf4, fp4"):
        FSDPPlusStrategy(quantize_base="int4")
    with pytest.raises(ValueError, match="quantize_blocksize=100 is not one of 32, 64"):
        FSDPPlusStrategy(quantize_base="nf4", quantize_blocksize=100)
    with pytest.raises(ValueError, match="quantize_double='yes' must be true or false"):
        FSDPPlusStrategy(quantize_base="nf4", quantize_double="yes")
    assert FSDPPlusStrategy(quantize_base="fp4", quantize_double=True).quantize_double is True
    with pytest.raises(ValueError, match="quantize_skip='lm_head' must be a list"):
        FSDPPlusStrategy(quantize_skip="lm_head")
    with pytest.raises(ValueError, match=r"lora has 'rank', .*valid keys"):
        FSDPPlusStrategy(lora={"rank": 4})
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match="quantize_base='int8' needs bitsandbytes"):
        FSDPPlusStrategy(quantize_base="int8")
    with pytest.raises(ImportError, match="quantize_base='nf4' needs bitsandbytes"):
        FSDPPlusStrategy(quantize_base="nf4")


def auto(**kwargs) -> FSDPPlusStrategy:
    return FSDPPlusStrategy("auto", **{"memory_budget": "1GiB", "plan_batch_size": 2, "plan_seq_len": 16, **kwargs})


@pytest.mark.parametrize(
    ("strategy", "make_module", "message"),
    [
        (lambda: FSDPPlusStrategy(lora={"target_modules": ["query"]}), lambda: CausalLMModule(tiny_llama(0)),
         r"lora.target_modules=\['query'\] matches no module; linear layers in the model: down_proj, gate_proj"),
        (lambda: FSDPPlusStrategy(lora_only=True), lambda: CausalLMModule(tiny_llama(0).requires_grad_(False)),
         "lora_only=True shards the trainable .* but the model has none"),
        (lambda: FSDPPlusStrategy(lora_only=True), lambda: CausalLMModule(tiny_llama(0)),
         r"lora_only=True replicates the frozen base .* nothing in the model is frozen: all [0-9,]+ parameters would"
         r" be sharded and trained. Give lora=\{...\}"),
        (lambda: FSDPPlusStrategy(quantize_base="int8"), lambda: TinyLM(),
         r"quantize_base='int8' found no frozen layer it converts \(nn.Linear \(and subclasses with its forward\),"
         r" transformers Conv1D, bitsandbytes "
         r"Linear8bitLt / Linear4bit\) outside LoRA adapters and quantize_skip=\['lm_head'\]; layer types with "
         r"frozen weights here: none \(nothing is frozen\)"),
        (lambda: FSDPPlusStrategy(lora={"r": 4}, quantize_base="nf4"), lambda: CausalLMModule(tiny_llama(0)),
         r"model.base_model.model.model.layers.0.self_attn.q_proj.base_layer has in_features=32, not a multiple of "
         r"quantize_blocksize=64: its 4-bit blocks would straddle rows"),
        (lambda: auto(memory_budget="64KiB", lora={"r": 4}), lambda: CausalLMModule(tiny_llama(0)),
         r"memory_budget=64KiB leaves 57.6 KiB per device after memory_margin=0.1, and none of the 15 candidates fits"
         r" at 2 rank\(s\), batch 2 x 16 tokens. Closest: [A-Z_]+( \+ [a-z_]+)* needs [0-9.]+ KiB per rank,"
         r" .* \([0-9,]+ bytes\) more than the budget allows"),
        (lambda: auto(), lambda: TinyLM(),
         "sharding_strategy='auto' predicts memory from the transformers model's config, and TinyLM holds no"
         " transformers PreTrainedModel"),
        (lambda: auto(allow_quantize=["int8"]), lambda: CausalLMModule(tiny_llama(0)),
         r"allow_quantize=\['int8'\] quantizes a frozen base, and this run trains every parameter"),
    ],
)  # fmt: skip
def test_lora_int8_and_auto_plan_errors_fail_in_fit_before_any_process_starts(strategy, make_module, message):
    trainer = cpu_trainer(strategy=strategy(), max_steps=1)
    with pytest.raises(ValueError, match=message):
        trainer.fit(make_module())
    assert not dist.is_initialized()
    assert "LOCAL_RANK" not in os.environ


def test_auto_plan_memory_is_predicted_in_fit_before_the_launch(monkeypatch):
    strategy = auto(lora={"r": 4})
    monkeypatch.setattr(strategy, "_configure_launcher", lambda: None)  # stop at the launcher: no processes
    trainer = cpu_trainer(strategy=strategy, max_steps=1)
    trainer.strategy._lightning_module = CausalLMModule(tiny_llama(0))
    plan = strategy.auto_plan
    assert plan is not None and plan.world_size == 2 and plan.chosen is None and plan.fitting
    # 3 layouts, lora_only on 2 of them; no, full and selective checkpointing
    assert len(plan.predictions) == 15 and plan.budget == 2**30
    assert repr(strategy) == "FSDPPlusStrategy(sharding_strategy=auto)"


def test_sync_batchnorm_with_a_model_the_user_sharded_is_refused_with_the_fix():
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    strategy = FSDPPlusStrategy()
    strategy._layer_sync = TorchSyncBatchNorm()  # what Trainer(sync_batchnorm=True) sets
    strategy.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"sharded in configure_model: 1 is a BatchNorm that fully_shard already"
                       r" manages.*convert_sync_batchnorm"):  # fmt: skip
        strategy._check_layer_sync_before_user_sharding()
