"""Lightning's own single-process FSDPStrategy / ModelParallelStrategy tests, adapted to FSDPPlusStrategy.

Sources: lightning 2.6, tests/tests_pytorch/strategies/test_fsdp.py and test_model_parallel.py. ``ADAPTED`` maps
each Lightning test to the test here; ``NOT_ADAPTED`` says why the rest have no counterpart. Where fsdp_plus
differs from ``FSDPStrategy`` on purpose, the test asserts our behaviour and says so (docs/migrating.md: "What
differs from FSDPStrategy on purpose").
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import HalfPrecision
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as FSDP1ShardingStrategy

from lightning_fsdp_plus import FSDPPlusPrecision, FSDPPlusStrategy, ShardingStrategy
from lightning_fsdp_plus.checkpoint import CheckpointError
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import materialize_model, plan_model
from lightning_fsdp_plus.plan import MeshLayout

LIGHTNING_TESTS = [f"test_fsdp.py::test_{name}" for name in (
    "invalid_on_cpu", "custom_mixed_precision", "strategy_sync_batchnorm", "modules_without_parameters",
    "strategy_checkpoint", "strategy_full_state_dict", "checkpoint_multi_gpus", "invalid_parameters_in_optimizer",
    "forbidden_precision_raises", "activation_checkpointing", "setup_model_device_id_cpu",
    "model_sharded_context_device_id_cpu", "strategy_cpu_offload", "sharding_strategy", "hybrid_shard_configuration",
    "use_orig_params", "set_timeout", "strategy_load_optimizer_states_multiple", "strategy_save_optimizer_states",
    "strategy_load_optimizer_states", "configure_model", "save_checkpoint_storage_options",
    "save_checkpoint_path_exists", "save_checkpoint_unknown_state_dict_type", "load_unknown_checkpoint_type",
    "save_load_sharded_state_dict", "lazy_load_full_state_dict",
    "load_full_checkpoint_remote_honors_explicit_weights_only",
    "load_full_checkpoint_remote_allows_non_tensor_objects", "load_sharded_checkpoint_metadata_weights_only",
    "module_init_context", "save_sharded_and_consolidate_and_load", "device_mesh_type_annotation",
    "pl_save_checkpoint_does_not_corrupt_remote_path")] + [f"test_model_parallel.py::test_{name}" for name in (
    "torch_greater_equal_2_4", "device_mesh_access", "validate_device_mesh_dimensions", "fsdp_v1_modules_unsupported",
    "configure_model_required", "save_checkpoint_storage_options", "save_checkpoint_path_exists",
    "load_unknown_checkpoint_type", "set_timeout", "meta_device_materialization",
    "align_compiled_param_names_with_module", "align_compiled_param_names_no_compile",
    "model_parallel_pytorch_save_checkpoint_remote_path")] + [
    f"test_model_parallel_integration.py::test_{name}" for name in (
    "setup_device_mesh", "tensor_parallel", "model_parallel_single_file_checkpoint_with_compile",
    "fsdp2_tensor_parallel", "modules_without_parameters", "module_init_context", "strategy_state_dict",
    "load_full_state_checkpoint_into_regular_model", "load_standard_checkpoint_into_distributed_model",
    "save_load_sharded_state_dict")]  # fmt: skip
"""Every test function of the three Lightning files (parametrizations aside)."""

ADAPTED = {
    "test_fsdp.py::test_invalid_on_cpu": "test_cpu_is_supported",
    "test_fsdp.py::test_custom_mixed_precision": "test_custom_mixed_precision",
    "test_fsdp.py::test_forbidden_precision_raises": "test_other_precision_plugins_are_converted",
    "test_fsdp.py::test_activation_checkpointing": "test_activation_checkpointing",
    "test_fsdp.py::test_strategy_cpu_offload": "test_strategy_cpu_offload",
    "test_fsdp.py::test_sharding_strategy": "test_sharding_strategy",
    "test_fsdp.py::test_hybrid_shard_configuration": "test_hybrid_shard_configuration",
    "test_fsdp.py::test_use_orig_params": "test_use_orig_params",
    "test_fsdp.py::test_set_timeout": "test_set_timeout",
    "test_model_parallel.py::test_set_timeout": "test_set_timeout",
    "test_fsdp.py::test_strategy_load_optimizer_states_multiple": "test_strategy_load_optimizer_states_multiple",
    "test_fsdp.py::test_save_checkpoint_storage_options": "test_save_checkpoint_storage_options",
    "test_model_parallel.py::test_save_checkpoint_storage_options": "test_save_checkpoint_storage_options",
    "test_fsdp.py::test_save_checkpoint_path_exists": "test_save_checkpoint_path_exists",
    "test_model_parallel.py::test_save_checkpoint_path_exists": "test_save_checkpoint_path_exists",
    "test_fsdp.py::test_save_checkpoint_unknown_state_dict_type": "test_unknown_state_dict_type",
    "test_fsdp.py::test_load_unknown_checkpoint_type": "test_load_unknown_checkpoint_type",
    "test_model_parallel.py::test_load_unknown_checkpoint_type": "test_load_unknown_checkpoint_type",
    "test_fsdp.py::test_lazy_load_full_state_dict": "test_full_checkpoints_load_memory_mapped",
    "test_model_parallel.py::test_device_mesh_access": "test_device_mesh_access",
    "test_model_parallel.py::test_validate_device_mesh_dimensions": "test_validate_device_mesh_dimensions",
    "test_model_parallel.py::test_fsdp_v1_modules_unsupported": "test_fsdp_v1_modules_unsupported",
    "test_model_parallel.py::test_configure_model_required": "test_configure_model_is_not_required",
    "test_model_parallel.py::test_meta_device_materialization": "test_meta_device_materialization",
}
"""Lightning test -> its adaptation in this module (the multi-process ones are in cases.py)."""

_REMOTE = "remote (fsspec) paths: checkpoints are committed by an atomic rename, which needs a local file system"
NOT_ADAPTED = {
    "test_fsdp.py::test_setup_model_device_id_cpu": "FSDP1 internals (FSDPStrategy._setup_model's device_id)",
    "test_fsdp.py::test_model_sharded_context_device_id_cpu": "FSDP1 internals (enable_wrap's device_id)",
    "test_fsdp.py::test_load_full_checkpoint_remote_honors_explicit_weights_only": _REMOTE,
    "test_fsdp.py::test_load_full_checkpoint_remote_allows_non_tensor_objects": _REMOTE,
    "test_fsdp.py::test_load_sharded_checkpoint_metadata_weights_only": _REMOTE,
    "test_fsdp.py::test_pl_save_checkpoint_does_not_corrupt_remote_path": _REMOTE,
    "test_model_parallel.py::test_model_parallel_pytorch_save_checkpoint_remote_path": _REMOTE,
    "test_fsdp.py::test_device_mesh_type_annotation": "LightningCLI/jsonargparse typing; our config front end is "
    "Hydra, whose schema types device_mesh (tests/config)",
    "test_model_parallel.py::test_torch_greater_equal_2_4": "the package requires torch>=2.13 at install time",
    "test_model_parallel.py::test_align_compiled_param_names_with_module": "tests a private Lightning helper; we use "
    "torch's state-dict API, which maps compiled (_orig_mod) names itself",
    "test_model_parallel.py::test_align_compiled_param_names_no_compile": "as above",
}
"""Lightning tests without an fsdp_plus counterpart, and why."""


def test_cpu_is_supported(tmp_path):
    # FSDPStrategy raises "requires a GPU accelerator"; fsdp_plus runs on CPU (gloo)
    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, fast_dev_run=True, strategy="fsdp_plus")
    assert isinstance(trainer.strategy, FSDPPlusStrategy) and trainer.strategy.root_device == torch.device("cpu")


def test_custom_mixed_precision():
    config = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = FSDPPlusStrategy(mixed_precision=config)
    policy = strategy.mixed_precision  # FSDP1's config as FSDP2's MixedPrecisionPolicy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_other_precision_plugins_are_converted():
    # FSDPStrategy refuses anything but FSDPPrecision; fsdp_plus converts Lightning's plugins to its own
    strategy = FSDPPlusStrategy(precision_plugin=HalfPrecision("bf16-true"))
    assert isinstance(strategy.precision_plugin, FSDPPlusPrecision)
    assert strategy.precision_plugin.precision == "bf16-true"
    strategy.precision_plugin = HalfPrecision("16-true")
    assert isinstance(strategy.precision_plugin, FSDPPlusPrecision) and strategy.precision_plugin.precision == "16-true"


def test_activation_checkpointing():
    class Block1(nn.Linear):
        pass

    class Block2(nn.Linear):
        pass

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.layer0 = nn.Sequential(Block1(4, 4), Block1(5, 5))
            self.layer1 = Block2(2, 2)
            self.layer2 = nn.Linear(3, 3)

    layout = MeshLayout(replicate=1, shard=2)
    for policy, expected in (
        ({Block1}, ["layer0.0", "layer0.1"]),
        ({Block1, Block2}, ["layer0.0", "layer0.1", "layer1"]),
    ):
        options = FSDPPlusStrategy(activation_checkpointing_policy=policy).options
        plan = plan_model(Model(), options, layout=layout, precision="32-true", device_type="cpu")
        assert sorted(plan.activation_checkpointing) == expected


def test_strategy_cpu_offload():
    assert FSDPPlusStrategy(cpu_offload=True).cpu_offload is True
    assert FSDPPlusStrategy(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert FSDPPlusStrategy(cpu_offload=CPUOffload()).cpu_offload is False


def test_sharding_strategy():
    assert FSDPPlusStrategy().sharding_strategy is ShardingStrategy.FULL_SHARD
    assert FSDPPlusStrategy(sharding_strategy=FSDP1ShardingStrategy.SHARD_GRAD_OP).sharding_strategy is (
        ShardingStrategy.SHARD_GRAD_OP
    )
    assert FSDPPlusStrategy(sharding_strategy="NO_SHARD").sharding_strategy is ShardingStrategy.NO_SHARD
    assert FSDPPlusStrategy(sharding_strategy="no_shard").sharding_strategy is ShardingStrategy.NO_SHARD


@pytest.mark.parametrize("sharding_strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid_shard_configuration(sharding_strategy):
    # FSDPStrategy needs a wrap policy or a process group for hybrid sharding; FSDP2 units need neither
    strategy = FSDPPlusStrategy(sharding_strategy=sharding_strategy)
    assert strategy.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert strategy.options.resharded_after_forward is (sharding_strategy == "HYBRID_SHARD")
    mesh = (1, 2)  # replicate x shard
    assert FSDPPlusStrategy(sharding_strategy=sharding_strategy, device_mesh=mesh).options.device_mesh == mesh
    with pytest.raises(ValueError, match=r"process_group=\.\.\. and device_mesh=\.\.\. are mutually exclusive"):
        FSDPPlusStrategy(sharding_strategy=sharding_strategy, process_group=Mock(), device_mesh=mesh)


def test_use_orig_params():
    # FSDP2 always keeps the original parameters: True is accepted, False has no meaning and is refused
    assert FSDPPlusStrategy().use_orig_params is True
    with pytest.raises(ValueError, match="use_orig_params=False is not supported"):
        FSDPPlusStrategy(use_orig_params=False)


@mock.patch("torch.distributed.init_process_group")
def test_set_timeout(init_process_group_mock):
    test_timedelta = timedelta(seconds=30)
    strategy = FSDPPlusStrategy(timeout=test_timedelta, parallel_devices=[torch.device("cpu")])
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = Mock()
    strategy.__dict__["_fsdp_plus_module"] = Mock()
    with mock.patch("lightning_fsdp_plus.strategy.build_mesh"):
        strategy.setup_environment()
    init_process_group_mock.assert_called_with(
        strategy._get_process_group_backend(), rank=strategy.cluster_environment.global_rank(),
        world_size=strategy.cluster_environment.world_size(), timeout=test_timedelta, device_id=None,
    )  # fmt: skip


def _loading_strategy(model: nn.Module, optimizers: list) -> FSDPPlusStrategy:
    strategy = FSDPPlusStrategy(parallel_devices=[torch.device("cpu")], state_dict_type="full")
    trainer = Trainer(accelerator="cpu", logger=False)
    trainer.state.fn = TrainerFn.FITTING
    strategy.__dict__["_fsdp_plus_module"] = Mock(trainer=trainer, strict_loading=True)
    strategy.model = model
    strategy.optimizers = optimizers
    return strategy


def test_strategy_load_optimizer_states_multiple(tmp_path):
    model = nn.Linear(2, 2)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [{"state": {}}, {"state": {}}]}
    torch.save(checkpoint, tmp_path / "two-states.ckpt")
    strategy = _loading_strategy(model, [Mock(spec=torch.optim.Optimizer)])
    with pytest.raises(RuntimeError, match="1 optimizers but the checkpoint contains 2 optimizers to load"):
        strategy.load_checkpoint(tmp_path / "two-states.ckpt")
    checkpoint["optimizer_states"] = [{"state": {}}]
    torch.save(checkpoint, tmp_path / "one-state.ckpt")
    strategy = _loading_strategy(model, [Mock(spec=torch.optim.Optimizer), Mock(spec=torch.optim.Optimizer)])
    with pytest.raises(RuntimeError, match="2 optimizers but the checkpoint contains 1 optimizers to load"):
        strategy.load_checkpoint(tmp_path / "one-state.ckpt")


def test_save_checkpoint_storage_options(tmp_path):
    with pytest.raises(TypeError, match=r"FSDPPlusStrategy\.save_checkpoint does not take storage_options"):
        FSDPPlusStrategy().save_checkpoint(filepath=tmp_path, checkpoint=Mock(), storage_options=Mock())


def _saving_strategy(state_dict_type: str) -> FSDPPlusStrategy:
    strategy = FSDPPlusStrategy(state_dict_type=state_dict_type)
    strategy.model = nn.Linear(2, 2)
    strategy.__dict__["_fsdp_plus_module"] = BoringModel()
    return strategy


def _checkpoint(strategy: FSDPPlusStrategy) -> dict:
    return {"state_dict": strategy.model.state_dict(), "optimizer_states": []}


def test_save_checkpoint_path_exists(tmp_path):
    # Lightning's cases with real files instead of mocks; what fsdp_plus does differently: a full checkpoint never
    # replaces a sharded one that holds other files (tests/test_checkpoint.py)
    strategy = _saving_strategy("full")
    path = tmp_path / "not-empty"
    path.mkdir()
    (path / "file").touch()
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(_checkpoint(strategy), filepath=path)

    sharded = tmp_path / "sharded-checkpoint"
    _saving_strategy("sharded").save_checkpoint(_checkpoint(strategy), filepath=sharded)
    strategy.save_checkpoint(_checkpoint(strategy), filepath=sharded)  # a sharded checkpoint: overwritten
    assert sharded.is_file()

    file = tmp_path / "file.pt"
    file.touch()
    strategy.save_checkpoint(_checkpoint(strategy), filepath=file)
    assert torch.load(file, weights_only=True)["state_dict"].keys() == {"weight", "bias"}

    strategy = _saving_strategy("sharded")
    path = tmp_path / "not-empty-2"
    path.mkdir()
    (path / "file").touch()
    strategy.save_checkpoint(_checkpoint(strategy), filepath=path)
    assert (path / "file").exists() and (path / "meta.pt").is_file()

    path = tmp_path / "file-2.pt"
    path.touch()
    strategy.save_checkpoint(_checkpoint(strategy), filepath=path)
    assert path.is_dir()


def test_unknown_state_dict_type():
    # FSDPStrategy raises when saving; fsdp_plus when constructed, with the valid choices
    with pytest.raises(ValueError, match="state_dict_type='invalid' is not one of sharded, full"):
        FSDPPlusStrategy(state_dict_type="invalid")


def test_load_unknown_checkpoint_type(tmp_path):
    strategy = _loading_strategy(nn.Linear(2, 2), [])
    path = tmp_path / "empty_dir"
    path.mkdir()
    with pytest.raises(CheckpointError, match="does not point to a valid checkpoint"):
        strategy.load_checkpoint(checkpoint_path=path)


def test_full_checkpoints_load_memory_mapped(tmp_path):
    model = BoringModel()
    file = tmp_path / "test.ckpt"
    torch.save({"state_dict": model.state_dict()}, file)
    strategy = _loading_strategy(model, [])
    with mock.patch("torch.load", wraps=torch.load) as load:
        strategy.load_checkpoint(checkpoint_path=file)
    assert load.call_args.kwargs["mmap"] is True  # tensors are read when copied into shards, not all at once


def test_device_mesh_access():
    with pytest.raises(RuntimeError, match="The device mesh exists once the processes have initialized"):
        _ = FSDPPlusStrategy().device_mesh


@pytest.mark.parametrize(("world_size", "hybrid_shard_size"), [(4, 3), (8, 3), (4, 8)])
def test_validate_device_mesh_dimensions(world_size, hybrid_shard_size):
    # ModelParallelStrategy checks data x tensor parallel sizes; fsdp_plus checks replicate x shard sizes
    options = FSDPPlusOptions(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=hybrid_shard_size)
    with pytest.raises(ValueError, match=f"hybrid_shard_size={hybrid_shard_size} does not divide the world size"):
        options.mesh_layout(world_size=world_size, devices_per_node=world_size)


def test_fsdp_v1_modules_unsupported():
    class Model(LightningModule):
        def configure_model(self):
            pass

    model = Model()
    model.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    strategy = FSDPPlusStrategy()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()
    with pytest.raises(TypeError, match="fsdp_plus shards with FSDP2"):
        strategy.setup(Mock())


def test_configure_model_is_not_required():
    # ModelParallelStrategy requires configure_model with hand-written fully_shard calls; fsdp_plus plans units
    # for a plain model as soon as the trainer hands it over (the multi-process cases then train such models)
    strategy = Trainer(accelerator="cpu", devices=2, strategy=FSDPPlusStrategy(auto_wrap_policy={nn.Linear}),
                       logger=False).strategy  # fmt: skip
    strategy._lightning_module = BoringModel()
    assert strategy.lightning_module is not None


def test_meta_device_materialization():
    class NoResetParameters(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    class CustomModel(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Sequential(NoResetParameters(), NoResetParameters())
            self.layer2 = nn.Linear(4, 4)
            self.register_buffer("buffer", torch.rand(2))

        def reset_parameters(self):
            self.buffer.fill_(1.0)

    with torch.device("meta"):
        model = CustomModel()
    assert model.layer1[0].weight.is_meta and model.layer2.weight.is_meta and model.buffer.is_meta
    with pytest.warns(UserWarning, match=r"`reset_parameters\(\)` method for re-initialization: NoResetParameters"):
        materialize_model(model, device=torch.device("cpu"))  # what setup runs after sharding
    assert all(not p.is_meta for p in model.parameters()) and all(not b.is_meta for b in model.buffers())


def test_every_listed_adaptation_exists():
    for name in ADAPTED.values():
        assert callable(globals().get(name)), name
    assert Path(__file__).with_name("cases.py").is_file()
