"""Every private torch and Lightning API this package touches, in one place.

Checked with torch 2.13.0 and lightning 2.6.6 (``constraints.txt``); ``scripts/check_oldest.sh`` runs the quick
test subset at the oldest versions ``pyproject.toml`` admits. When one of these moves, this module is where the
adaptation goes. Heavy or optional ones are imported on first use.

Lightning (2.6.6):

- ``_SubprocessScriptLauncher``: the ``popen`` launch (as ``ddp`` does);
- ``_SignalConnector``: the trainer's signal handling (``trainer._signal_connector``), which
  :mod:`~lightning_fsdp_plus.preemption` replaces with flag-only handlers; there it also reads
  ``trainer._accelerator_connector.cluster_environment`` (SLURM), ``ModelCheckpoint._monitor_candidates`` (the
  "last" file's name) and runs ``_SignalConnector._slurm_sigusr_handler_fn`` (HPC checkpoint + requeue);
- ``_MultiProcessingLauncher``, ``_WorkerOutput``: the ``spawn`` launch that returns gathered weights;
- ``_materialize_distributed_module``, ``_optimizers_to_device``: meta tensors made real, optimizer state moved;
- ``_DtypeContextManager``: the estimator builds its meta model in a dtype;
- ``_collect_rng_states``, ``_set_rng_states``: per-rank RNG in checkpoints;
- ``_init_dist_connection``, ``reset_seed`` and ``ModelParallelStrategy``'s members that ``FSDPPlusStrategy``
  reuses (process group start, barrier, broadcast, ...; see the strategy);
- ``_distributed_checkpoint_save``, ``_METADATA_FILENAME``, ``_is_sharded_checkpoint``: Lightning's sharded
  checkpoint layout, which ours keeps;
- Fabric: ``_SubprocessScriptLauncher`` (Fabric's own, for ``FSDPPlusFabricStrategy``) and
  ``_ParallelBackwardSyncControl`` (``fabric.no_backward_sync``: ``requires_gradient_sync`` on every FSDP2 unit);
- ``Trainer.fit``/``validate``/... assign ``strategy._lightning_module`` after ``_maybe_unwrap_optimized`` and
  before ``_verify_strategy_supports_compile``: ``FSDPPlusStrategy``'s setter takes a compiled module's dynamo
  context there and undoes the whole-module compilation (``to_uncompiled``), so that units are compiled instead
  (``tests/test_compile_distributed.py`` fails if Lightning moves the check before the assignment);
- ``FSDPPrecision._desired_input_dtype`` (set by ``FSDPPlusPrecision``, which skips ``FSDPPrecision.__init__``)
  and ``Strategy._forward_redirection`` (steps run through the root unit's ``__call__``).

torch (2.13.0):

- ``fsdp.wrap._Policy``, ``fsdp.wrap._recursive_wrap``: FSDP1 wrap policies turned into FSDP2 units;
- ``distributed._composable.checkpoint``: composable activation checkpointing;
- ``distributed_c10d._get_default_store``: the default group's store, where one rank's failure is recorded
  (:mod:`~lightning_fsdp_plus.failures`);
- ``FSDPModule._get_fsdp_state``, ``_fully_shard._fsdp_param.ShardedState``: FSDP2's parameter records (memory);
- DTensor's caches (``_redistribute``, ``_collective_utils.MeshTopoInfo``, ``debug``): freeing groups at exit;
- ``_subclasses.fake_tensor.FakeTensorMode``, ``_tools.fsdp2_mem_tracker``, ``testing._internal...FakeStore``:
  the estimator's FakeTensor model and ``--simulate``;
- ``_dynamo.utils.counters``: graphs compiled and graph breaks (:mod:`~lightning_fsdp_plus.compile`);
- ``torch._C._nn._parse_to``: ``Tensor.to``'s argument parser (as ``nn.Module.to`` uses it), to see where a
  ``.to`` call sends a tensor (:func:`~lightning_fsdp_plus.lora.adapters_stay_real`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save, _is_sharded_checkpoint
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
)
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _ParallelBackwardSyncControl
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

__all__ = [
    "_METADATA_FILENAME",
    "_DtypeContextManager",
    "_FabricSubprocessScriptLauncher",
    "_MultiProcessingLauncher",
    "_ParallelBackwardSyncControl",
    "_SignalConnector",
    "_SubprocessScriptLauncher",
    "_WorkerOutput",
    "_collect_rng_states",
    "_convert_fp_tensor",
    "_distributed_checkpoint_save",
    "_init_dist_connection",
    "_is_sharded_checkpoint",
    "_materialize_distributed_module",
    "_optimizers_to_device",
    "_set_rng_states",
    "clear_dtensor_caches",
    "composable_checkpoint",
    "default_store",
    "dynamo_counters",
    "fake_store",
    "fake_tensor_mode",
    "fsdp1_policy_base",
    "fsdp1_recursive_wrap",
    "fsdp2_mem_tracker",
    "fsdp_param_records",
    "parse_to",
    "reset_seed",
    "sharded_state",
]


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, bool, Any]:
    """``(device, dtype, non_blocking, memory_format)`` of ``Tensor.to``'s arguments (after the tensor)."""
    return torch._C._nn._parse_to(*args, **kwargs)


def fsdp1_policy_base() -> type:
    """FSDP1's ``_Policy`` base class (``ModuleWrapPolicy``, ``CustomPolicy``)."""
    from torch.distributed.fsdp.wrap import _Policy

    return _Policy


def fsdp1_recursive_wrap() -> Any:
    """FSDP1's ``_recursive_wrap``: walks a model as an FSDP1 wrap policy would."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    return _recursive_wrap


def composable_checkpoint() -> Any:
    """torch's composable (non-reentrant) activation checkpointing."""
    from torch.distributed._composable import checkpoint

    return checkpoint


def dynamo_counters() -> Any:
    """dynamo's process-wide counters (``stats``: ``unique_graphs``; ``graph_break``: reason -> count)."""
    from torch._dynamo.utils import counters

    return counters


def default_store() -> Any:
    """The default process group's store (the rendezvous key/value server)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fsdp_param_records(module: Any) -> list[Any]:
    """FSDP2's ``FSDPParam`` records of one ``FSDPModule`` (empty when it manages no parameter)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def sharded_state() -> Any:
    """FSDP2's ``ShardedState`` enum (``SHARDED`` / ``UNSHARDED``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return ShardedState


def fake_tensor_mode() -> Any:
    """torch's ``FakeTensorMode``: tensors with shapes and dtypes but no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def fsdp2_mem_tracker() -> Any:
    """torch's ``FSDPMemTracker``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker


def fake_store() -> Any:
    """The store of torch's ``fake`` process group backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def clear_dtensor_caches() -> None:
    """Empty DTensor's memo caches: their keys and values hold device meshes, and a mesh holds its groups.

    The caches are torch internals. One this torch version lacks is skipped; with the pinned torch,
    ``tests/test_dist.py`` fails if one that holds a group is missed.
    """
    from torch.distributed.tensor import DTensor, debug
    from torch.distributed.tensor import _redistribute as redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    def cache_clear(fn: object) -> Callable[[], object] | None:
        return getattr(fn, "cache_clear", None)

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = (
        getattr(debug, "_clear_sharding_prop_cache", None),  # op sharding decisions (Python and fast path)
        cache_clear(getattr(propagator, "_propagate_tensor_meta_cached", None)),
        getattr(redistribute, "clear_redistribute_planner_cache", None),  # weakly keyed; planners hold meshes
        cache_clear(getattr(redistribute, "_gen_transform_infos", None)),
        cache_clear(getattr(MeshTopoInfo, "build_from_mesh", None)),
    )
    for clear in clears:
        if clear is not None:
            clear()
