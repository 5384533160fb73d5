"""Every config group composes, every strategy preset instantiates the intended FSDPPlusStrategy, and bad
keys, types and values fail at compose time with the full key path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate

from lightning_fsdp_plus import FSDPPlusStrategy, ShardingStrategy
from lightning_fsdp_plus.app.config import register_configs
from lightning_fsdp_plus.app.config.validate import ConfigError, validate_run_config

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(autouse=True)
def hydra_config_module():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_fsdp_plus.conf", version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_the_default_config_composes_and_validates():
    cfg = compose("config")
    assert cfg.strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.precision.name == "32-true"
    validate_run_config(cfg)


@pytest.mark.parametrize("group", ["strategy", "precision", "model", "data", "trainer", "callbacks", "logger"])
def test_every_option_of_every_group_composes(group):
    for option in options(group):
        overrides = [f"{group}={option}"]
        if (group, option) == ("model", "pretrained"):
            overrides.append("model.name_or_path=some-org/some-model")
        cfg = compose("config", overrides=overrides)
        assert cfg is not None


def test_lora_options_fill_strategy_lora_and_experiment_and_sweeps_compose():
    for option in options("lora"):
        cfg = compose("config", overrides=["strategy=lora_only", f"lora@strategy.lora={option}"])
        assert cfg.strategy.lora.r > 0 and cfg.strategy.lora.target_modules
    cfg = compose("config", overrides=["experiment=tiny_lora_int8"])
    assert cfg.task_name == "tiny_lora_int8" and cfg.strategy.quantize_base == "int8"
    for option in options("sweep"):
        cfg = compose("config", overrides=[f"sweep={option}"], return_hydra_config=True)
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN" and "strategy" in cfg.hydra.sweeper.params
    import yaml

    swept = yaml.safe_load((CONF / "sweep" / "lora_modes.yaml").read_text())["hydra"]["sweeper"]["params"]["strategy"]
    assert {"lora_nf4_replicated", "lora_nf4_sharded", "lora_int8_sharded"} <= set(swept.split(","))
    for experiment in ("medical_lora", "legal_lora"):  # the examples run on a 4-bit base too
        cfg = compose("config", overrides=[f"experiment={experiment}", "strategy=lora_nf4_sharded"])
        assert cfg.strategy.quantize_base == "nf4" and cfg.strategy.quantize_blocksize == 32
        validate_run_config(cfg)


EXPECTED = {
    "full_shard": {"sharding_strategy": ShardingStrategy.FULL_SHARD, "lora_only": False, "quantize_base": None},
    "shard_grad_op": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "lora_only": False, "quantize_base": None},
    "no_shard": {"sharding_strategy": ShardingStrategy.NO_SHARD, "lora_only": False, "quantize_base": None},
    "hybrid_shard": {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "hybrid_shard_size": None},
    "lora_only": {"sharding_strategy": ShardingStrategy.FULL_SHARD, "lora_only": True, "quantize_base": None},
    "lora_int8_replicated": {"lora_only": True, "quantize_base": "int8"},
    "lora_int8_sharded": {"lora_only": False, "quantize_base": "int8"},
    "lora_nf4_replicated": {"lora_only": True, "quantize_base": "nf4", "quantize_blocksize": 64},
    "lora_nf4_sharded": {"lora_only": False, "quantize_base": "nf4", "quantize_double": False},
    "auto": {"sharding_strategy": "auto", "memory_margin": 0.1, "allow_quantize": ()},
    "auto_lora": {"sharding_strategy": "auto", "allow_quantize": ()},
    "tp2d": {"sharding_strategy": ShardingStrategy.FULL_SHARD, "tensor_parallel_size": 2, "quantize_base": None},
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_strategy_presets_instantiate_the_intended_strategy(preset):
    assert sorted(EXPECTED) == options("strategy")
    cfg = compose("config", overrides=[f"strategy={preset}"])
    if preset.startswith("auto"):  # the budget is the one thing the auto presets cannot know
        needs = r"strategy\.sharding_strategy='auto' needs memory_budget: .* memory_budget: the memory"
        with pytest.raises(ConfigError, match=needs):
            validate_run_config(cfg)
        cfg = compose("config", overrides=[f"strategy={preset}", "strategy.memory_budget=40GiB"])
        validate_run_config(cfg)  # plans for the data's batch and sequence length
        assert (cfg.strategy.plan_batch_size, cfg.strategy.plan_seq_len) == (cfg.data.batch_size, cfg.data.seq_len)
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, FSDPPlusStrategy)
    for key, value in EXPECTED[preset].items():
        assert getattr(strategy, key) == value, key
    if preset.startswith("lora") or preset == "auto_lora":
        assert strategy.lora.r == 8 and set(strategy.lora.target_modules) >= {"q_proj", "down_proj"}
    else:
        assert strategy.lora is None


@pytest.mark.parametrize(
    ("override", "exception", "message"),
    [
        ("strategy.sharding_strategy=FULLSHARD", ConfigCompositionException,
         r"Invalid value 'FULLSHARD', expected one of \[FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, AUTO\]"),
        ("strategy.nosuchkey=1", ConfigCompositionException, r"Key 'nosuchkey' not in 'StrategySchema'"),
        ("strategy.cpu_offload=maybe", ConfigCompositionException, r"Value 'maybe' is not a valid bool"),
        ("trainer.max_steps=many", ConfigCompositionException, r"Value 'many' of type 'str' could not be converted"),
        ("precision=fp8", MissingConfigException, r"Could not find 'precision/fp8'"),
    ],
)  # fmt: skip
def test_bad_keys_and_types_fail_at_compose_time_with_the_key_path(override, exception, message):
    with pytest.raises(exception) as info:
        compose("config", overrides=[override])
    text = f"{info.value}\n{info.value.__cause__}"
    assert re.search(message, text), text
    if exception is ConfigCompositionException:
        assert f"full_key: {override.split('=')[0]}" in text


def test_compile_takes_true_or_torch_compile_arguments_from_the_command_line():
    from lightning_fsdp_plus.compile import CompileSpec

    assert compose("config").strategy.compile is False
    cfg = compose("config", overrides=["strategy.compile=true"])
    validate_run_config(cfg)
    assert instantiate(cfg.strategy, _convert_="all").options.compile == CompileSpec()
    cfg = compose("config", overrides=["strategy.compile={backend:aot_eager,dynamic:true}"])
    validate_run_config(cfg)
    spec = instantiate(cfg.strategy, _convert_="all").options.compile
    assert dict(spec.kwargs) == {"backend": "aot_eager", "dynamic": True}


def test_sharding_strategy_is_case_insensitive_in_configs_too():
    cfg = compose("config", overrides=["strategy.sharding_strategy=shard_grad_op"])
    assert cfg.strategy.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    assert instantiate(cfg.strategy, _convert_="all").sharding_strategy is ShardingStrategy.SHARD_GRAD_OP


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.devices=0"], r"trainer.devices=0 is not valid; choose a positive integer"),
        (["strategy.hybrid_shard_size=3"],
         r"strategy.hybrid_shard_size=3 does not divide the world size 2; valid choices: 1, 2"),
        (["model.name_or_path=/nonexistent/model"],
         r"model.name_or_path='/nonexistent/model' does not exist \(relative to"),
        (["precision.name=fp8"], r"precision.name='fp8' is not supported by fsdp_plus; choose one of 32-true"),
        (["strategy.quantize_base=int4"], r"strategy.quantize_base='int4' is not one of None, int8, nf4, fp4"),
        (["strategy.quantize_base=nf4", "strategy.quantize_blocksize=100"],
         r"strategy.quantize_blocksize=100 is not one of 32, 64"),
        (["trainer.gradient_clip_algorithm=l2"], r"trainer.gradient_clip_algorithm='l2' is not one of norm, value"),
        (["checkpoint.every_n_train_steps=0"], r"checkpoint.every_n_train_steps=0 must be a positive integer"),
        (["+nosuch=1"], r"nosuch: nothing reads this key; valid keys there: strategy, precision, model"),
        (["+ckpt_pth=last"], r"ckpt_pth: nothing reads this key \(did you mean ckpt_path\?\)"),
        (["+trainer.ckpt_path=last"], r"trainer.ckpt_path: nothing reads this key \(did you mean the top-level key"),
        (["strategy=lora_only", "strategy.lora.r=0"], r"strategy.lora.r=0 must be a positive integer"),
        (["strategy.compile={backend:eager,fulgraph:true}"],
         r"strategy.compile has 'fulgraph'=True, which is not a torch.compile argument it takes; valid keys: backend,"
         r" mode, fullgraph, dynamic, options"),
        (["strategy.compile=yes"], r"strategy.compile='yes' must be false, true, or a dict of torch.compile"),
        (["strategy=lora_only", "strategy.lora.dropout=1.5"], r"strategy.lora.dropout=1.5 must be a probability"),
        (["model=pretrained", "model.name_or_path=examples/assets/tiny-lama"],
         r"model.name_or_path='examples/assets/tiny-lama' does not exist \(relative to .*\) \(did you mean"
         r" examples/assets/tiny-llama\?\)"),
    ],
)  # fmt: skip
def test_value_rules_raise_config_errors_with_key_and_choices(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_run_config(compose("config", overrides=overrides))


def test_a_users_own_app_can_use_our_configs_through_the_searchpath(tmp_path):
    (tmp_path / "my_app.yaml").write_text(
        "defaults:\n  - strategy: lora_int8_sharded\n  - _self_\n"
        "hydra:\n  searchpath:\n    - pkg://lightning_fsdp_plus.conf\n"
    )
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = compose("my_app")
    assert cfg.strategy.quantize_base == "int8" and cfg.strategy.lora.r == 8


def test_a_pretrained_model_loads_by_streaming_unless_low_memory_load_is_false(tmp_path):
    from lightning_fsdp_plus.app.train import build_module
    from lightning_fsdp_plus.loading import has_pending_weights, pretrained_source
    from tests.helpers.checkpoints import save_checkpoint

    save_checkpoint(tmp_path, "llama")
    cfg = compose("config", overrides=["model=pretrained", f"model.name_or_path={tmp_path}"])
    assert cfg.model.low_memory_load is True
    validate_run_config(cfg)
    streamed = build_module(cfg.model)
    assert has_pending_weights(streamed) and pretrained_source(streamed.model).checkpoint.directory == tmp_path
    loaded = build_module(compose("config", overrides=["model=pretrained", f"model.name_or_path={tmp_path}",
                                                        "model.low_memory_load=false"]).model)  # fmt: skip
    assert not has_pending_weights(loaded) and not any(p.is_meta for p in loaded.parameters())


def test_a_checkpoint_without_safetensors_fails_validation_with_the_fix(tmp_path):
    import torch

    from tests.helpers.checkpoints import tiny_causal_lm

    model = tiny_causal_lm("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # an older checkpoint: pickled weights only
    overrides = ["model=pretrained", f"model.name_or_path={tmp_path}"]
    with pytest.raises(ConfigError, match=r"model\.name_or_path: .* has no \*\.safetensors.*low_memory_load=false"):
        validate_run_config(compose("config", overrides=overrides))
    validate_run_config(compose("config", overrides=[*overrides, "model.low_memory_load=false"]))


def test_auto_plans_for_the_instruction_datas_longest_sequence_unless_told_otherwise():
    cfg = compose("config", overrides=["experiment=medical_lora", "strategy=auto_lora", "strategy.memory_budget=0.5"])
    validate_run_config(cfg)
    assert (cfg.strategy.plan_batch_size, cfg.strategy.plan_seq_len) == (cfg.data.batch_size, cfg.data.max_seq_len)
    cfg = compose("config", overrides=["strategy=auto", "strategy.memory_budget=8GiB", "strategy.plan_seq_len=7"])
    validate_run_config(cfg)
    assert cfg.strategy.plan_seq_len == 7
    with pytest.raises(ConfigError, match=r"strategy.memory_budget='lots' is not a size"):
        validate_run_config(compose("config", overrides=["strategy=auto", "strategy.memory_budget=lots"]))


def test_own_data_composes_with_the_default_model_and_data_columns_maps_each_field_by_name():
    cfg = compose("config", overrides=["data=instruction", "data.columns.response=output",
                                       "data.columns.messages=conversations"])  # fmt: skip
    # the model built from a config reads bytes: no tokenizer to name, its vocabulary sized from the data's
    assert cfg.data.tokenizer is None and cfg.model.config.vocab_size is None
    assert cfg.model.config.max_position_embeddings == cfg.data.max_seq_len == 256
    assert dict(cfg.data.columns) == {"instruction": "instruction", "input": "input", "response": "output",
                                      "messages": "conversations"}  # fmt: skip
    with pytest.raises(ConfigCompositionException) as info:
        compose("config", overrides=["data=instruction", "data.columns.respones=output"])
    assert "full_key: data.columns.respones" in str(info.value.__cause__)


def test_a_config_built_model_without_a_vocabulary_size_or_a_tokenizer_to_take_it_from_is_refused():
    from lightning_fsdp_plus.app.train import build_module

    cfg = compose("config", overrides=["model.config.vocab_size=null"])
    with pytest.raises(ConfigError, match=r"model.config.vocab_size is null .* set model.config.vocab_size=N"):
        build_module(cfg.model)
    assert build_module(cfg.model, tokenizer=list(range(300))).model.config.vocab_size == 300  # len(tokenizer)


def test_a_hub_id_neither_cached_nor_reachable_is_refused_at_once(monkeypatch):
    """No network (a closed port stands for it): one ConfigError saying what to do, not minutes of retries."""
    from huggingface_hub import constants

    from lightning_fsdp_plus.app.config.validate import check_hub_id, hub_reachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert not hub_reachable(timeout=1)
    with pytest.raises(ConfigError, match=r"model.name_or_path='nosuch-org/nosuch-model' is not a local directory,"
                                          r" not in the Hugging Face cache \(.*\), and http://127.0.0.1:9 cannot be"
                                          r" reached: give a local model directory"):  # fmt: skip
        check_hub_id("nosuch-org/nosuch-model")
    with pytest.raises(ConfigError, match=r"is neither a local directory nor a valid Hugging Face model id"):
        check_hub_id("not a/valid//id")


def test_a_budget_beside_a_pinned_strategy_is_refused_in_a_run_and_cleared_for_a_sweeps_pinned_jobs():
    """``-m strategy=full_shard,auto strategy.memory_budget=1GiB`` gives every job the budget: the auto job reads it,
    the FULL_SHARD job is told it runs without it; one run with the same two values is refused."""
    from lightning_fsdp_plus.app.config.validate import unread_in_this_sweep_job

    pinned = ["strategy=full_shard", "strategy.memory_budget=1GiB", "strategy.allow_quantize=[int8]"]
    with pytest.raises(
        ConfigError,
        match=r"strategy.memory_budget='1GiB', allow_quantize=\('int8',\): read only by"
        r" sharding_strategy='auto', and sharding_strategy='FULL_SHARD' is pinned",
    ):
        validate_run_config(compose("config", overrides=pinned))
    cfg = compose("config", overrides=pinned)
    assert unread_in_this_sweep_job(cfg) == {
        "strategy.memory_budget": ("1GiB", "strategy.memory_budget=null"),
        "strategy.allow_quantize": (["int8"], "strategy.allow_quantize=[]"),
    }
    validate_run_config(cfg)  # cleared: the job runs as pinned
    auto = compose("config", overrides=["strategy=auto", "strategy.memory_budget=1GiB"])
    assert unread_in_this_sweep_job(auto) == {} and auto.strategy.memory_budget == "1GiB"
