"""Lightning 2.6's own FSDPStrategy / ModelParallelStrategy multi-GPU tests, adapted to fsdp_plus on 2 CPU ranks.

Run under ``torchrun --nproc_per_node 2`` (so DDP and fsdp_plus trainers join the same two processes); each case
runs on both ranks, its assertions inside the processes as in Lightning's tests, and each rank records
``OUT/<case>.rank<r>.json`` = ``{"ok": bool, "error": traceback}``. tests/lightning_compat/test_integration.py
reads them. Sources (lightning 2.6, tests/tests_pytorch/strategies/): ``fsdp__*`` from test_fsdp.py,
``mp__*`` from test_model_parallel_integration.py. Adaptations, the same for every case:

- ``accelerator="cpu"`` and the ``fsdp_plus`` strategy where the original uses ``fsdp`` / ``ModelParallelStrategy``;
  FSDP1 ``wrap()`` calls and ``FullyShardedDataParallel`` instance checks become fsdp_plus wrap policies and
  FSDP2 ``FSDPModule`` checks (the mixed-precision dtype is read from each unit's FSDP2 policy);
- ``16-mixed`` becomes ``bf16-mixed`` on CPU (Lightning does the same for the string), and
  ``save_distributed_checkpoint`` becomes ``state_dict_type``;
- batches are limited (``LIMITS``) to keep the suite in its time budget; what each test checks is unchanged;
- the sharded checkpoint's file list also holds our manifest and per-rank RNG files.

Not adapted: tensor parallelism (``test_setup_device_mesh``, ``test_tensor_parallel``, ``test_fsdp2_tensor_parallel``;
Lightning's tensor-parallel example runs unchanged instead, tests/test_lightning_tp_example_distributed.py) and
``torch.compile`` (``..._single_file_checkpoint_with_compile``: inductor's C++
build takes minutes on CPU); see tests/lightning_compat/test_integration.py.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.utils.data import DataLoader
from torchmetrics import Accuracy

from lightning_fsdp_plus import FSDPPlusStrategy

LIMITS = {"limit_train_batches": 4, "limit_val_batches": 2, "limit_test_batches": 2, "limit_predict_batches": 2}
"""Batches per stage (Lightning's tests run whole 64-sample epochs)."""
CASES: dict[str, Callable[[Path], None]] = {}


def case(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    CASES[fn.__name__] = fn
    return fn


def trainer(tmp: Path, **kwargs) -> Trainer:
    """A 2-rank CPU trainer (``fsdp_plus`` unless ``strategy`` is given)."""
    kwargs.setdefault("strategy", "fsdp_plus")
    return Trainer(default_root_dir=tmp, accelerator="cpu", devices=2, **{**LIMITS, **kwargs})


def unit_dtype(module: FSDPModule) -> torch.dtype:
    """The parameter dtype of an FSDP2 unit's mixed-precision policy (fp32 when it casts nothing)."""
    policy = module._get_fsdp_state()._mp_policy
    return policy.param_dtype or torch.float32


def expected_dtype(precision: str) -> torch.dtype:
    return {"16": torch.float16, "bf16": torch.bfloat16}.get(precision.split("-")[0], torch.float32)


# ------------------------------------------------------------------------------------------ test_fsdp.py models
class StageChecks:
    """The batch hooks both of test_fsdp.py's checking models define: fp32 batches, units checked every stage."""

    def on_train_batch_start(self, batch, batch_idx):
        assert batch.dtype == torch.float32

    def on_train_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    on_test_batch_end = on_validation_batch_end = on_predict_batch_end = on_train_batch_end

    def _assert_layer_fsdp_instance(self) -> None:
        raise NotImplementedError


class TestFSDPModel(StageChecks, BoringModel):
    """test_fsdp.py's ``TestFSDPModel``: layers built in configure_model; every stage checks units and dtypes."""

    def __init__(self):
        super().__init__()
        self.layer: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layer is None:  # fsdp_plus wraps by policy (Linear units + the root) instead of wrap() calls
            self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

    def _assert_layer_fsdp_instance(self) -> None:
        assert isinstance(self, FSDPModule)  # the root unit
        expected = expected_dtype(self.trainer.precision)
        for layer_num in [0, 2]:
            assert isinstance(self.layer[layer_num], FSDPModule)
            assert unit_dtype(self.layer[layer_num]) == expected


class TestBoringModel(BoringModel):
    def __init__(self, wrap_min_params: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.should_be_wrapped = [wrap_min_params < (32 * 32 + 32), None, wrap_min_params < (32 * 2 + 2)]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class TestFSDPModelAutoWrapped(StageChecks, TestBoringModel):
    def _assert_layer_fsdp_instance(self) -> None:
        assert isinstance(self.layer, nn.Sequential)
        expected = expected_dtype(self.trainer.precision)
        for layer_num in [0, 2]:
            if not self.should_be_wrapped[layer_num]:
                assert not isinstance(self.layer[layer_num], FSDPModule)
                continue
            assert isinstance(self.layer[layer_num], FSDPModule)
            assert unit_dtype(self.layer[layer_num]) == expected


def _run_multiple_stages(trainer, model, model_path: str | None = None):
    trainer.fit(model)
    trainer.test(model)

    model_path = trainer.strategy.broadcast(model_path)
    model_path = Path(model_path if model_path else trainer.checkpoint_callback.last_model_path)

    # Save another checkpoint after testing, without optimizer states
    trainer.save_checkpoint(model_path.with_name("after-test"))
    trainer.save_checkpoint(model_path, weights_only=True)

    if not model_path.is_dir():
        _assert_save_equality(trainer, model_path, cls=model.__class__)

    with torch.inference_mode():
        trainer.test(model)  # model is sharded, will not call `configure_model`
        trainer.test(ckpt_path=model_path)
        trainer.predict(model)
        trainer.predict(ckpt_path=model_path)


def _assert_save_equality(trainer, ckpt_path, cls=TestFSDPModel):
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        saved_model = cls.load_from_checkpoint(ckpt_path)
        if is_overridden_configure_model(saved_model):
            saved_model.configure_model()
        for ddp_param, shard_param in zip(model_state_dict.values(), saved_model.state_dict().values(), strict=True):
            assert torch.equal(ddp_param, shard_param)


def is_overridden_configure_model(model: LightningModule) -> bool:
    # TestFSDPModel builds its layers in configure_model: a model loaded outside a trainer needs that call first
    # (Lightning's FSDP1 test loads the wrapped layers' keys; ours are the plain module's keys)
    return type(model).configure_model is not LightningModule.configure_model


def custom_auto_wrap_policy(module, recurse, nonwrapped_numel: int) -> bool:
    return nonwrapped_numel >= 2


# ------------------------------------------------------------------------------------------ test_fsdp.py cases
@case
def fsdp__strategy_sync_batchnorm(tmp: Path) -> None:
    model = TestFSDPModel()
    t = trainer(tmp, precision="32-true", max_epochs=1, sync_batchnorm=True)
    _run_multiple_stages(t, model, os.path.join(tmp, "last.ckpt"))


def _strategy_checkpoint(tmp: Path, *, state_dict_type: str, precision: str) -> None:
    model = TestFSDPModel()
    strategy = FSDPPlusStrategy(state_dict_type=state_dict_type)
    t = trainer(tmp, strategy=strategy, precision=precision, max_epochs=1)
    _run_multiple_stages(t, model, os.path.join(tmp, "last.ckpt"))


for _sdt in ("sharded", "full"):
    for _precision in ("32-true", "bf16-mixed"):
        _name = f"fsdp__strategy_checkpoint[{_sdt}-{_precision}]"
        CASES[_name] = partial(_strategy_checkpoint, state_dict_type=_sdt, precision=_precision)


@case
def fsdp__modules_without_parameters(tmp: Path) -> None:
    class MetricsModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            assert self.metric.device == self.metric.tp.device == self.trainer.strategy.root_device
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return loss

    trainer(tmp, max_steps=1).fit(MetricsModel())


def _strategy_full_state_dict(tmp: Path, *, wrap_min_params: int) -> None:
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    correct_state_dict = model.state_dict()
    strategy = FSDPPlusStrategy(
        auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params), state_dict_type="full"
    )
    t = trainer(tmp, strategy=strategy, precision="16-mixed", max_epochs=1, barebones=True)
    t.fit(model)
    full_state_dict = t.strategy.lightning_module_state_dict()
    if t.global_rank != 0:
        assert len(full_state_dict) == 0
        return
    assert len(correct_state_dict) == len(full_state_dict)
    assert list(full_state_dict) == list(correct_state_dict)


def _checkpoint_multi_gpus(tmp: Path, *, make_model, strategy) -> None:
    t = trainer(
        tmp, strategy=strategy(), precision="32-true", max_epochs=1, callbacks=[ModelCheckpoint(save_last=True)]
    )
    _run_multiple_stages(t, make_model())


CASES["fsdp__checkpoint_multi_gpus[manually_wrapped]"] = partial(
    _checkpoint_multi_gpus, make_model=TestFSDPModel, strategy=FSDPPlusStrategy
)
CASES["fsdp__checkpoint_multi_gpus[autowrap_2x]"] = partial(
    _checkpoint_multi_gpus,
    make_model=TestFSDPModelAutoWrapped,
    strategy=partial(FSDPPlusStrategy, auto_wrap_policy=custom_auto_wrap_policy),
)
CASES["fsdp__checkpoint_multi_gpus[autowrap_use_orig_params]"] = partial(
    _checkpoint_multi_gpus,
    make_model=TestFSDPModelAutoWrapped,
    strategy=partial(FSDPPlusStrategy, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True),
)


@case
def fsdp__invalid_parameters_in_optimizer(tmp: Path) -> None:
    # FSDP2 keeps the original parameters (FSDP1's use_orig_params=True), where both models train
    class EmptyParametersModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class NoFlatParametersModel(BoringModel):
        def configure_optimizers(self):
            layer = torch.nn.Linear(4, 5)
            return torch.optim.Adam(layer.parameters(), lr=1e-2)

    t = trainer(tmp, fast_dev_run=1)
    t.fit(EmptyParametersModel())
    t.fit(NoFlatParametersModel())


def _states(t: Trainer, model: LightningModule) -> tuple[dict, dict]:
    return t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(model.optimizers())


def _assert_same(t: Trainer, saved: tuple[dict, dict], restored: tuple[dict, dict]) -> None:
    if t.global_rank == 0:
        for a, b in zip(saved, restored, strict=True):
            assert len(a) == len(b)
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    t.strategy.barrier()


def _strategy_save_optimizer_states(tmp: Path, *, wrap_min_params: int) -> None:
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    strategy = FSDPPlusStrategy(
        auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params), state_dict_type="full"
    )
    t = trainer(tmp, strategy=strategy, precision="16-mixed", max_epochs=1, barebones=True)
    t.fit(model)
    model_path = t.strategy.broadcast(os.path.join(tmp, "last.ckpt"))
    t.save_checkpoint(model_path)
    saved = _states(t, model)
    if t.global_rank != 0:
        assert len(saved[0]) == 0 and len(saved[1]) == 0

    model = TestBoringModel()  # restore the model into DDP
    t = trainer(tmp, strategy="ddp", max_epochs=1)
    t.fit(model, ckpt_path=model_path)
    _assert_same(t, saved, _states(t, model))


def _strategy_load_optimizer_states(tmp: Path, *, wrap_min_params: int) -> None:
    model = TestBoringModel()
    t = trainer(tmp, strategy="ddp", max_epochs=1)
    t.fit(model)
    model_path = t.strategy.broadcast(os.path.join(tmp, "last.ckpt"))
    t.save_checkpoint(model_path)
    saved = _states(t, model)

    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    strategy = FSDPPlusStrategy(
        auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params), state_dict_type="full"
    )
    t = trainer(tmp, strategy=strategy, precision="16-mixed", max_epochs=1, barebones=True)
    t.fit(model, ckpt_path=model_path)
    restored = _states(t, model)
    if t.global_rank != 0:
        assert len(restored[0]) == 0 and len(restored[1]) == 0
    _assert_same(t, saved, restored)


for _wrap in (2, 1024, 100000000):
    CASES[f"fsdp__strategy_full_state_dict[{_wrap}]"] = partial(_strategy_full_state_dict, wrap_min_params=_wrap)
    CASES[f"fsdp__strategy_save_optimizer_states[{_wrap}]"] = partial(
        _strategy_save_optimizer_states, wrap_min_params=_wrap
    )
    CASES[f"fsdp__strategy_load_optimizer_states[{_wrap}]"] = partial(
        _strategy_load_optimizer_states, wrap_min_params=_wrap
    )


@case
def fsdp__configure_model(tmp: Path) -> None:
    class MyModel(BoringModel):
        def configure_model(self):
            self.layer = torch.nn.Linear(32, 2)
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == torch.float32

        def configure_optimizers(self):
            return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

        def on_fit_start(self):
            assert self.layer.weight.device == self.trainer.strategy.root_device
            assert self.layer.weight.dtype == torch.float32

    t = trainer(tmp, strategy=FSDPPlusStrategy(auto_wrap_policy={nn.Linear}), precision="32-true", max_epochs=1,
                enable_checkpointing=False, logger=False)  # fmt: skip
    t.fit(MyModel())


class TestFSDPCheckpointModel(BoringModel):
    def __init__(self, params_to_compare=None):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.params_to_compare = params_to_compare

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def on_train_start(self):
        if self.params_to_compare is None:
            return
        for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p0, p1, atol=0, rtol=0, equal_nan=True)


SHARDED_FILES = {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}
"""Lightning's sharded layout; ours adds a manifest and per-rank RNG states."""
OUR_FILES = {"manifest.json", "rng_rank0.pt", "rng_rank1.pt"}


def _save_load_sharded(tmp: Path, *, model_cls, strategy, snapshot) -> None:
    seed_everything(0)
    kwargs = {"max_epochs": 1, "enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    model = model_cls()
    t = trainer(tmp, strategy=strategy(), **kwargs)
    t.fit(model)
    params_before = snapshot(t.model)

    checkpoint_path = Path(t.strategy.broadcast(t.checkpoint_callback.best_model_path))
    assert set(os.listdir(checkpoint_path)) == SHARDED_FILES | OUR_FILES
    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1  # model checkpoint callback
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata

    model = model_cls(params_to_compare=params_before)
    t = trainer(tmp, strategy=strategy(), **{**kwargs, "max_epochs": 2})
    t.fit(model, ckpt_path=checkpoint_path)


CASES["fsdp__save_load_sharded_state_dict"] = partial(
    _save_load_sharded,
    model_cls=TestFSDPCheckpointModel,
    strategy=partial(FSDPPlusStrategy, auto_wrap_policy={nn.Linear}, state_dict_type="sharded"),
    snapshot=lambda model: deepcopy(list(model.parameters())),
)


def _module_init_context(tmp: Path, *, precision: str, make_model, policy) -> None:
    expected = expected_dtype(precision)

    def run(empty_init: bool, expected_device: torch.device) -> None:
        t = trainer(tmp, strategy=FSDPPlusStrategy(auto_wrap_policy=policy), precision=precision, max_steps=1,
                    barebones=True, enable_checkpointing=False, logger=False)  # fmt: skip
        with t.init_module(empty_init=empty_init):
            model = make_model(expected)
        assert next(model.parameters()).device == expected_device
        assert next(model.parameters()).dtype == expected
        t.fit(model)

    run(empty_init=False, expected_device=torch.device("cpu"))
    run(empty_init=True, expected_device=torch.device("meta"))


def _boring_init_model(expected: torch.dtype) -> LightningModule:
    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def on_train_start(self):
            assert self.layer.weight.device == self.trainer.strategy.root_device
            assert self.layer.weight.dtype == expected
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device == self.trainer.strategy.root_device

    return Model()


for _precision in ("32-true", "16-true", "bf16-true"):
    CASES[f"fsdp__module_init_context[{_precision}]"] = partial(
        _module_init_context, precision=_precision, make_model=_boring_init_model, policy={nn.Linear}
    )


@case
def fsdp__save_sharded_and_consolidate_and_load(tmp: Path) -> None:
    class CustomModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    t = trainer(tmp, strategy=FSDPPlusStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded"), max_steps=3)
    t.fit(CustomModel())
    checkpoint_path_sharded = t.strategy.broadcast(str(t.checkpoint_callback.best_model_path))
    assert set(os.listdir(checkpoint_path_sharded)) == SHARDED_FILES | OUR_FILES

    checkpoint_path_full = t.strategy.broadcast(str(tmp / "checkpoint_full.ckpt"))
    if t.global_rank == 0:  # Lightning's own consolidation utility reads our sharded layout
        checkpoint = _load_distributed_checkpoint(Path(checkpoint_path_sharded))
        # the layout is ModelParallelStrategy's ("state_dict"), the utility expects FSDPStrategy's key ("model")
        checkpoint["model"] = checkpoint.pop("state_dict")
        checkpoint = _format_checkpoint(checkpoint)
        torch.save(checkpoint, checkpoint_path_full)
    t.strategy.barrier()
    trainer(tmp, strategy="ddp", max_steps=4).fit(CustomModel(), ckpt_path=checkpoint_path_full)


# ---------------------------------------------------------------------- test_model_parallel_integration.py
class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(nn.functional.silu(self.w1(x)) * self.w2(x))


class TemplateModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch):
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class FSDP2Model(TemplateModel):
    """``fully_shard`` written by the user in configure_model (the original also applies tensor parallelism)."""

    def configure_model(self):
        for module in (self.model.w1, self.model.w2, self.model.w3, self.model):
            fully_shard(module, mesh=self.device_mesh)


@case
def mp__modules_without_parameters(tmp: Path) -> None:
    class MetricsModel(FSDP2Model):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage) -> None:
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch):
            assert self.metric.device.type == self.metric.tp.device.type == "cpu"
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return super().training_step(batch)

    trainer(tmp, max_steps=1, enable_checkpointing=False, logger=False).fit(MetricsModel())


def _fsdp2_init_model(expected: torch.dtype) -> LightningModule:
    class Model(FSDP2Model):
        def on_train_start(self):
            assert self.model.w1.weight.device == self.trainer.strategy.root_device
            assert self.model.w1.weight.dtype == expected
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"

    return Model()


for _precision in ("32-true", "16-true", "bf16-true"):
    CASES[f"mp__module_init_context[{_precision}]"] = partial(
        _module_init_context, precision=_precision, make_model=_fsdp2_init_model, policy=None
    )


def _strategy_state_dict(tmp: Path, *, state_dict_type: str) -> None:
    model = FSDP2Model()
    correct_state_dict = model.state_dict()
    t = trainer(tmp, strategy=FSDPPlusStrategy(state_dict_type=state_dict_type), max_epochs=1, barebones=True)
    t.fit(model)
    state_dict = t.strategy.lightning_module_state_dict()
    if state_dict_type == "sharded":
        assert len(state_dict) > 0
        assert list(state_dict.keys()) == list(correct_state_dict.keys())
    elif t.global_rank != 0:
        assert len(state_dict) == 0
    else:
        assert list(state_dict.keys()) == list(correct_state_dict.keys())


for _sdt in ("sharded", "full"):
    CASES[f"mp__strategy_state_dict[{_sdt}]"] = partial(_strategy_state_dict, state_dict_type=_sdt)


@case
def mp__load_full_state_checkpoint_into_regular_model(tmp: Path) -> None:
    model = FSDP2Model()
    t = trainer(tmp, strategy=FSDPPlusStrategy(state_dict_type="full"), max_epochs=1, barebones=True)
    t.fit(model)
    model_path = t.strategy.broadcast(tmp / "last.ckpt")
    t.save_checkpoint(model_path)
    saved = _states(t, model)
    if t.global_rank != 0:
        assert len(saved[0]) == 0 and len(saved[1]) == 0
    if t.global_rank == 0:  # also resumed on a single device, by the pytest process
        torch.save({"model": saved[0], "optimizer": saved[1]}, tmp.parent / "full_for_single_device.states.pt")
        (tmp.parent / "full_for_single_device.ckpt").write_bytes(Path(model_path).read_bytes())

    model = TemplateModel()
    t = trainer(tmp, strategy="ddp", max_epochs=1)
    t.fit(model, ckpt_path=model_path)
    _assert_same(t, saved, _states(t, model))


@case
def mp__load_standard_checkpoint_into_distributed_model(tmp: Path) -> None:
    model = TemplateModel()
    t = trainer(tmp, strategy="ddp", max_epochs=1)
    t.fit(model)
    model_path = t.strategy.broadcast(tmp / "last.ckpt")
    t.save_checkpoint(model_path)
    saved = _states(t, model)

    model = FSDP2Model()
    t = trainer(tmp, strategy=FSDPPlusStrategy(state_dict_type="full"), max_epochs=1, barebones=True)
    t.fit(model, ckpt_path=model_path)
    restored = _states(t, model)
    if t.global_rank != 0:
        assert len(restored[0]) == 0 and len(restored[1]) == 0
    _assert_same(t, saved, restored)


class CheckpointModel(FSDP2Model):
    def __init__(self, params_to_compare=None):
        super().__init__()
        self.params_to_compare = params_to_compare

    def on_train_start(self):
        if self.params_to_compare is None:
            return
        for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters(), strict=True):
            assert torch.equal(p0, p1.full_tensor())


CASES["mp__save_load_sharded_state_dict"] = partial(
    _save_load_sharded,
    model_cls=CheckpointModel,
    strategy=partial(FSDPPlusStrategy, state_dict_type="sharded"),
    snapshot=lambda model: [p.full_tensor() for p in model.parameters()],
)


# ------------------------------------------------------------------------------------------------ ours
OWN_CASES: dict[str, Callable[[Path], None]] = {}
"""Cases of our own that need DDP and fsdp_plus trainers in the same processes (not adapted from Lightning)."""


class PlainSGDModel(BoringModel):
    """Lightning's ``BoringModel`` with plain SGD (no momentum): its optimizer never holds per-parameter state."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _full_params(t: Trainer) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 (empty elsewhere), whatever the strategy (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(t.lightning_module, options=options)


def plain_sgd_checkpoints(tmp: Path) -> None:
    """Issue 35: a checkpoint whose optimizer has no state (plain SGD; likewise one saved before the first step)
    loads — a full one from DDP (torch's ``set_optimizer_state_dict`` failed: "Expected device to be set") and a
    sharded one of ours — with the learning rate it was saved with, and training goes on as DDP's resume does."""
    seed_everything(0)
    t = trainer(tmp, strategy="ddp", max_steps=2, barebones=True)
    t.fit(PlainSGDModel())
    t.optimizers[0].param_groups[0]["lr"] = 0.05  # as a scheduler would have left it: restored from the checkpoint
    path = t.strategy.broadcast(tmp / "ddp.ckpt")
    t.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["optimizer_states"][0]["state"] == {}

    def resume(strategy: Any, ckpt: Path, steps: int = 4) -> Trainer:
        seed_everything(1)  # the same data for every resumed run
        resumed = trainer(tmp, strategy=strategy, max_steps=steps, barebones=True)
        resumed.fit(PlainSGDModel(), ckpt_path=ckpt)
        assert resumed.global_step == steps and resumed.optimizers[0].param_groups[0]["lr"] == 0.05
        return resumed

    reference = _full_params(resume("ddp", path))
    full = _full_params(resume(FSDPPlusStrategy(state_dict_type="full"), path))
    sharded_run = resume(FSDPPlusStrategy(state_dict_type="sharded"), path)  # a full checkpoint, read by a sharded run
    sharded_path = sharded_run.strategy.broadcast(tmp / "sharded.ckpt")
    sharded_run.save_checkpoint(sharded_path)  # its optimizer holds no state either
    saved = _full_params(sharded_run)
    restored = _full_params(resume(FSDPPlusStrategy(state_dict_type="sharded"), sharded_path))  # at step 4: restores
    if dist.get_rank() == 0:
        torch.testing.assert_close(full, reference, atol=1e-6, rtol=1e-5)  # DDP's all-reduce vs reduce-scatter
        torch.testing.assert_close(restored, saved, atol=0, rtol=0)


OWN_CASES["ours__plain_sgd_checkpoints"] = plain_sgd_checkpoints


# ------------------------------------------------------------------------------------------------ runner
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=None, help="names (default: all)")
    args = parser.parse_args()
    everything = {**CASES, **OWN_CASES}
    names = args.cases or list(everything)
    for name in names:
        tmp = args.out / name.replace("[", "_").replace("]", "")
        rank = int(os.environ.get("RANK", "0"))
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            seed_everything(0)
            everything[name](tmp)
            result = {"ok": True, "error": ""}
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
            print(f"[rank {rank}] case {name} failed:\n{result['error']}", flush=True)
        (args.out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
        if not result["ok"]:
            # the other rank may wait in a collective this one left: end the launch (torchrun stops both), and
            # the cases after this one report that they did not run
            os._exit(1)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
