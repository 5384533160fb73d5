"""``Fabric(strategy="fsdp_plus")``: the same FSDP2 strategy for Lightning Fabric (and LitGPT) users.

Every option, the preparation pipeline (LoRA, int8/4-bit bases, tensor parallelism, activation checkpointing,
compile, FSDP2 units, streaming loading), the plan, precision, clipping across shards, checkpoints and failure
handling are the ones :class:`~lightning_fsdp_plus.FSDPPlusStrategy` uses; this module only speaks Fabric's
contract (``setup_module``/``setup_module_and_optimizers``, ``backward``, ``optimizer_step``,
``clip_gradients_*``, ``save_checkpoint``/``load_checkpoint``, ``no_backward_sync``). Fabric leaves the loop to
the user, so preemption is a question the loop asks: :meth:`FSDPPlusFabricStrategy.stop_requested`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_fsdp_plus._private import _FabricSubprocessScriptLauncher, _ParallelBackwardSyncControl
from lightning_fsdp_plus.checkpoint import (
    checkpoint_settings,
    load_into,
    model_state,
    optimizer_state,
    save_full,
    save_sharded,
    saves_trainable_only,
)
from lightning_fsdp_plus.clipping import clip_grad_norm_across_shards, clip_grad_value_across_shards
from lightning_fsdp_plus.cpu_threads import restore_threads
from lightning_fsdp_plus.failures import announce_failure
from lightning_fsdp_plus.front import OptionsFront
from lightning_fsdp_plus.options import FSDPPlusOptions, strategy_options
from lightning_fsdp_plus.pipeline import (
    build_sharded_model,
    check_tensor_parallel,
    materialize_model,
    prepare_model,
    refuse_fsdp1,
    user_sharding_plan,
)
from lightning_fsdp_plus.plan import MeshLayout, ShardingPlan
from lightning_fsdp_plus.precision import FSDPPlusPrecision, check_precision, from_fabric
from lightning_fsdp_plus.preemption import PreemptionSignals, agreement_group
from lightning_fsdp_plus.process import start_rank_services
from lightning_fsdp_plus.sharding import build_mesh, is_sharded

_FABRIC_REFUSED = (
    (lambda o: o.auto, "sharding_strategy='auto'", "the auto plan measures a model before any process starts,"
     " which Fabric's setup_module comes too late for: pin a sharding_strategy (fsdp-plus-plan prints the choice)"),
    (lambda o: o.loss_parallel, "loss_parallel=True", "Fabric's loop computes the loss outside the model: wrap it"
     " in torch.distributed.tensor.parallel.loss_parallel() yourself, with the head split by tensor_parallel_plan"),
    (lambda o: o.start_method != "popen", "start_method", "Fabric launches its own processes (fabric.launch):"
     " leave start_method unset"),
)  # fmt: skip
"""(test, option, why) for the options Fabric's contract cannot honour."""


def check_fabric_options(options: FSDPPlusOptions) -> None:
    """Refuse the options Fabric cannot honour (:data:`_FABRIC_REFUSED`), naming the option and why."""
    for refused, name, why in _FABRIC_REFUSED:
        if refused(options):
            raise ValueError(f"FSDPPlusFabricStrategy: {name} is not supported under Fabric: {why}")


class FSDPPlusFabricStrategy(OptionsFront, ParallelStrategy):
    """Fully Sharded Data Parallel on FSDP2 for Lightning Fabric, with no hand-written sharding code.

    ``Fabric(strategy="fsdp_plus")`` or ``Fabric(strategy=FSDPPlusFabricStrategy(...))``; every keyword argument
    is a field of :class:`~lightning_fsdp_plus.options.FSDPPlusOptions` (or ``options=``), as for
    ``FSDPPlusStrategy``. ``fabric.setup_module(model)`` runs the preparation pipeline and shards the model by its
    plan (``strategy.sharding_plan``, printed on rank 0); ``fabric.setup(model, optimizer)`` also rebinds the
    optimizer to the sharded parameters. Runs on CPU (gloo) and CUDA (nccl).
    """

    strategy_name = "fsdp_plus"

    def __init__(
        self,
        sharding_strategy: Any = "FULL_SHARD",
        *,
        options: FSDPPlusOptions | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision: Precision | None = None,
        **kwargs: Any,
    ) -> None:
        opts = strategy_options(sharding_strategy, options=options, kwargs=kwargs)
        check_fabric_options(opts)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)  # fmt: skip
        self.options = opts
        self._process_group_backend: str | None = opts.process_group_backend
        self._timeout = opts.timeout
        self._num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        self._mesh_layout: MeshLayout | None = None
        self._sharding_plan: ShardingPlan | None = None
        self._preemption: PreemptionSignals | None = None
        self._backward_sync_control = _ParallelBackwardSyncControl()

    # ------------------------------------------------------------------ shared with Fabric's ModelParallelStrategy
    # Process, device and collective handling is Fabric's ModelParallelStrategy's, reused as is (these members do not
    # call super(), so they work on any ParallelStrategy with the attributes __init__ sets).
    root_device = ModelParallelStrategy.root_device
    num_nodes = ModelParallelStrategy.num_nodes
    num_processes = ModelParallelStrategy.num_processes
    process_group_backend = ModelParallelStrategy.process_group_backend
    all_reduce = ModelParallelStrategy.all_reduce
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    module_init_context = ModelParallelStrategy.module_init_context
    _setup_distributed = ModelParallelStrategy._setup_distributed
    _get_process_group_backend = ModelParallelStrategy._get_process_group_backend
    _set_world_ranks = ModelParallelStrategy._set_world_ranks

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fsdp_plus"`` with Fabric's strategy registry."""
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 with declarative sharding (fsdp_plus)")

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> FSDPPlusPrecision:
        """Our precision plugin, made from the one Fabric built from ``Fabric(precision=...)``."""
        if not isinstance(self._precision, FSDPPlusPrecision):  # none given: 32-true
            self._precision = from_fabric(Precision(), device=self._device_type)
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = None if precision is None else from_fabric(precision, device=self._device_type)

    @property
    def _device_type(self) -> str:
        devices = getattr(self, "parallel_devices", None)
        return devices[0].type if devices else "cpu"

    # ------------------------------------------------------------------ layout and launch
    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh (``["data_parallel"]`` and ``["tensor_parallel"]`` answer too)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have initialized (setup_environment).")
        return self._device_mesh

    @property
    def sharding_plan(self) -> ShardingPlan:
        """The plan ``setup_module`` sharded the model by: every FSDP unit, its parameters and bytes per rank."""
        if self._sharding_plan is None:
            raise RuntimeError("The sharding plan is computed in setup_module(); call fabric.setup(model) first.")
        return self._sharding_plan

    def _configure_launcher(self) -> None:
        # Fabric calls this once devices, nodes and precision are known, before any process group exists
        self._mesh_layout = None
        _ = self.mesh_layout  # a world size the layout does not divide fails here
        check_precision(str(self.precision.precision), device_type=self._device_type)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _FabricSubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                             self.num_nodes)  # fmt: skip

    def setup_environment(self) -> None:
        """Start the process group, the failure watch, the signal flags and the mesh."""
        super().setup_environment()
        self._setup_distributed()
        start_rank_services(device_type=self.root_device.type, local_ranks=self.num_processes)
        _announce_uncaught_failures()
        self.precision.device = self.root_device.type
        self._device_mesh = build_mesh(layout=self.mesh_layout, device_type=self.root_device.type,
                                       given=self.options.device_mesh)  # fmt: skip
        self._preemption = PreemptionSignals(None, group=agreement_group(
            backend=self._process_group_backend or "gloo", timeout=self._timeout),
            environment=self.cluster_environment)  # fmt: skip
        self._preemption.register_signal_handlers()

    def teardown(self) -> None:
        """Restore the signal handlers and CPU threads, then Fabric's teardown."""
        if self._preemption is not None:
            self._preemption.teardown()
        restore_threads()
        super().teardown()

    # ------------------------------------------------------------------ the model and optimizers
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Run the preparation pipeline and shard ``module`` by its plan (a module the user sharded with
        ``fully_shard`` is used as it is, its meta tensors made real)."""
        refuse_fsdp1(module)
        if is_sharded(module):
            rank_zero_info("fsdp_plus: the model is already sharded (fully_shard before setup); using it as is.")
            self._sharding_plan = user_sharding_plan(module, self.options, layout=self.mesh_layout)
            materialize_model(module, device=self.root_device, param_init_fn=self.options.param_init_fn,
                              report=rank_zero_info)  # fmt: skip
            return self.precision.convert_now(module)
        prepare_model(module, self.options)
        check_tensor_parallel(module, self.options)
        module, self._sharding_plan = build_sharded_model(
            module, self.options, mesh=self.device_mesh, layout=self.mesh_layout, precision=self.precision,
            device=self.root_device, report=rank_zero_info,
        )  # fmt: skip
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard ``module``, then point each optimizer at the sharded parameters (matched by name: sharding
        replaces every parameter). The optimizers must not have taken a step yet."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError("fabric.setup(model, optimizer): the optimizer already holds state (it took a"
                                 " step); create it fresh, or set up the model first and create it after")  # fmt: skip
        module = self.setup_module(module)
        sharded = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            lost = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]
                    if names.get(id(p)) not in sharded]  # fmt: skip
            if lost:
                raise ValueError(
                    f"fabric.setup(model, optimizer): the optimizer's parameter {lost[0]!r} is not in the set-up model"
                    " (LoRA or quantization from the strategy's options renamed or replaced it): create the optimizer"
                    " after model = fabric.setup_module(model), over its trainable parameters"
                )
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: ``setup_module`` places the shards on this rank's device (Fabric calls this before it)."""

    # ------------------------------------------------------------------ a step
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``tensor.backward()``, scaled by the gradient scaler under ``16-mixed``."""
        scaler = self.precision.scaler
        (tensor if scaler is None else scaler.scale(tensor)).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step (through the gradient scaler under ``16-mixed``)."""
        scaler = self.precision.scaler
        if scaler is None:
            return optimizer.step(**kwargs)
        step = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm of every shard's gradients together (``fabric.clip_gradients(max_norm=...)``);
        returns that total norm, before clipping."""
        self._unscale(optimizer)
        norm = clip_grad_norm_across_shards(self.precision.main_params(optimizer), max_norm=float(max_norm),
                                            norm_type=float(norm_type))  # fmt: skip
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {norm.item()}: non-finite"
                               " (set error_if_nonfinite=False to clip anyway)")  # fmt: skip
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip each gradient element to ``[-clip_val, clip_val]`` (``fabric.clip_gradients(clip_val=...)``)."""
        self._unscale(optimizer)
        clip_grad_value_across_shards(self.precision.main_params(optimizer), clip_value=float(clip_val))

    def _unscale(self, optimizer: Optimizer) -> None:
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(optimizer)

    # ------------------------------------------------------------------ checkpoints (see checkpoint.py)
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save(path, state)``: one model, its optimizers and anything else in ``state``; sharded
        (``torch.distributed.checkpoint``, the default) or full (``state_dict_type="full"``), atomic as under
        the Trainer. Frozen parameters are left out when any parameter is frozen (``save_trainable_only``)."""
        if storage_options is not None:
            raise TypeError("FSDPPlusFabricStrategy.save_checkpoint does not take storage_options")
        if filter is not None:
            raise ValueError("fabric.save(..., filter=...) is not supported by fsdp_plus: trainable-only saving is"
                             " the save_trainable_only option")  # fmt: skip
        path = Path(self.broadcast(str(path)))
        key, module = _the_module(state)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        full = self.options.state_dict_type == "full"
        trainable_only = saves_trainable_only(module, option=self.options.save_trainable_only)
        rest = {k: v for k, v in state.items() if k != key and k not in optimizers}
        metadata = {**rest, "fabric": {"module": key, "optimizers": list(optimizers)},
                    "fsdp_plus": checkpoint_settings(options=self.options, trainable_only=trainable_only,
                                                     world_size=self.world_size)}  # fmt: skip
        model = model_state(module, full=full, trainable_only=trainable_only)
        optimizer_states = [optimizer_state(module, o, full=full, trainable_only=trainable_only)
                            for o in optimizers.values()]  # fmt: skip
        if full:
            save_full(path, checkpoint={"state_dict": model, "optimizer_states": optimizer_states, **metadata})
        else:
            save_sharded(path, model_state=model, optimizer_states=optimizer_states, metadata=metadata)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: the model and optimizers in ``state`` loaded in place (resharded to this
        world size and strategy), its other keys replaced by the saved values; returns what else the checkpoint
        holds. ``fabric.load_raw(path, model)``: a plain ``state_dict`` file into the sharded model."""
        if not state:
            raise ValueError("fabric.load(path, state): give the state to restore, at least {'model': model}")
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            _load_raw(path, module=state, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError("loading an optimizer alone is not supported: fabric.load(path, {'model':"
                                      " model, 'optimizer': optimizer})")  # fmt: skip
        key, module = _the_module(state)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        trainable_only = saves_trainable_only(module, option=self.options.save_trainable_only)
        with torch.inference_mode(False):
            rest = load_into(path, model=module, optimizers=list(optimizers.values()), strict=strict,
                             trainable_only=trainable_only)  # fmt: skip
        for ours in ("fabric", "fsdp_plus", "fsdp_plus_format"):
            rest.pop(ours, None)
        for name in [k for k in state if k != key and k not in optimizers]:
            if name in rest:
                state[name] = rest.pop(name)
            elif strict:
                raise KeyError(f"fabric.load: {name!r} is not in the checkpoint {path} (it holds {sorted(rest)})")
        return rest

    # ------------------------------------------------------------------ preemption
    def stop_requested(self) -> int:
        """Whether any rank received SIGTERM, SIGINT, SIGUSR2 or the requeue signal: 0 to go on, else the signal
        every rank agreed to stop for (the same answer on every rank). A collective: call it on every rank at the
        same point of the loop, e.g. after each optimizer step; then save and exit with
        :func:`~lightning_fsdp_plus.preemption.exit_code` of it."""
        if self._preemption is None:
            return 0
        return self._preemption.agreed if self._preemption.agree() else 0


def _the_module(state: dict[str, Any]) -> tuple[str, nn.Module]:
    """The one model in a ``fabric.save``/``fabric.load`` state (its key)."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise ValueError(f"fsdp_plus saves and loads one model per checkpoint; the state has {len(modules)}:"
                         f" {[k for k, _ in modules]}")  # fmt: skip
    key, module = modules[0]
    return key, getattr(module, "_forward_module", module)


def _load_raw(path: Path, *, module: nn.Module, strict: bool) -> None:
    """A plain ``torch.save``d state dict (or our full checkpoint's) into the sharded ``module``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module = getattr(module, "_forward_module", module)
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    with torch.inference_mode(False):
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def _announce_uncaught_failures() -> None:
    """An exception that ends a Fabric script on one rank is recorded for the other ranks (whose failure watch
    then ends them within seconds, with its message), before Python prints it: Fabric has no hook of its own."""
    previous = sys.excepthook
    if getattr(previous, "_fsdp_plus", False):
        return

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if not isinstance(error, (KeyboardInterrupt, SystemExit)):
            announce_failure(error)
        previous(kind, error, trace)

    hook._fsdp_plus = True  # type: ignore[attr-defined]
    sys.excepthook = hook
