"""``FSDPPlusStrategy``: Lightning's hooks, delegating to the plan, sharding and precision modules."""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_fsdp_plus._private import (
    _init_dist_connection,
    _optimizers_to_device,
    _SubprocessScriptLauncher,
    reset_seed,
)
from lightning_fsdp_plus.autoplan.choose import AutoPlan
from lightning_fsdp_plus.autoplan.resolve import decide, planning_options, predict_for_module
from lightning_fsdp_plus.checkpoint import (
    checkpoint_settings,
    load_into,
    model_state,
    optimizer_state,
    save_full,
    save_sharded,
    saves_trainable_only,
)
from lightning_fsdp_plus.compile import from_compiled_module
from lightning_fsdp_plus.cpu_threads import restore_threads
from lightning_fsdp_plus.failures import announce_failure
from lightning_fsdp_plus.front import OptionsFront
from lightning_fsdp_plus.launchers import FSDPPlusSpawnLauncher
from lightning_fsdp_plus.lora import find_peft_model
from lightning_fsdp_plus.options import FSDPPlusOptions, arguments_docstring, strategy_options
from lightning_fsdp_plus.pipeline import (
    batch_norms,
    build_sharded_model,
    check_tensor_parallel,
    materialize_model,
    plan_model,
    prepare_model,
    refuse_fsdp1,
    sync_batch_norm,
    user_sharding_plan,
)
from lightning_fsdp_plus.plan import MeshLayout, ShardingPlan, ShardingStrategy, node_boundaries
from lightning_fsdp_plus.precision import FSDPPlusPrecision, check_precision
from lightning_fsdp_plus.preemption import (
    PreemptionSignals,
    agreement_group,
    handle_preemption,
    install,
    resolve_on_preempt,
)
from lightning_fsdp_plus.process import start_rank_services
from lightning_fsdp_plus.sharding import build_mesh, is_sharded
from lightning_fsdp_plus.slurm import check_slurm_allocation
from lightning_fsdp_plus.tensor_parallel import local_loss, loss_parallel_context

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

"""The keyword arguments that are options (everything ``FSDPPlusOptions`` declares)."""


class FSDPPlusStrategy(OptionsFront, ParallelStrategy):
    """Fully Sharded Data Parallel on FSDP2 (``fully_shard``) with no hand-written sharding code.

    Runs on CPU (gloo) and CUDA (nccl). The model is sharded in ``setup`` by the preparation pipeline
    (:mod:`~lightning_fsdp_plus.pipeline`) from a :class:`ShardingPlan`; ``strategy.sharding_plan`` returns it and
    rank 0 prints it. Every keyword argument is a field of :class:`~lightning_fsdp_plus.options.FSDPPlusOptions`
    (pass ``options=`` to give them as one object: its ``sharding_strategy`` holds unless the first argument names
    another); the arguments of Lightning's ``FSDPStrategy`` are accepted
    too, mapped onto FSDP2 (:mod:`~lightning_fsdp_plus.compat`). Option values read as attributes:
    ``strategy.sharding_strategy``, ``strategy.lora``, ...

    It shares Lightning's ``ModelParallelStrategy`` process handling (the members assigned from it below) but is
    not a subclass: Lightning refuses ``precision="16-mixed"`` for any ``ModelParallelStrategy`` instance, and
    fp16 mixed precision is what T4/V100 GPUs have.

    """

    strategy_name = "fsdp_plus"

    def __init__(
        self,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        *,
        options: FSDPPlusOptions | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        device_id: int | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        opts = strategy_options(sharding_strategy, options=options, kwargs=kwargs)
        super().__init__()
        self.options = opts
        self._process_group_backend: str | None = opts.process_group_backend
        self._timeout = opts.timeout
        self._device_mesh: DeviceMesh | None = None
        self.num_nodes = 1
        self._device_id = device_id
        for name, value in (("accelerator", accelerator), ("parallel_devices", parallel_devices),
                            ("cluster_environment", cluster_environment), ("checkpoint_io", checkpoint_io),
                            ("precision_plugin", precision_plugin)):  # fmt: skip
            if value is not None:
                setattr(self, name, value)
        self._mesh_layout: MeshLayout | None = None
        self._sharding_plan: ShardingPlan | None = None
        self._auto_plan: AutoPlan | None = None
        self._preemption: PreemptionSignals | None = None
        self._agreement: tuple[Any, Any] | None = None  # (default group, agreement group) it was built for
        self._steps_at_start = 0
        self._on_preempt = "exit"

    # ------------------------------------------------------------------ shared with ModelParallelStrategy
    # Process, device and collective handling is ModelParallelStrategy's, reused as is (these members do not
    # call super(), so they work on any ParallelStrategy with the attributes __init__ sets).
    root_device = ModelParallelStrategy.root_device
    num_processes = ModelParallelStrategy.num_processes
    process_group_backend = ModelParallelStrategy.process_group_backend
    restore_checkpoint_after_setup = ModelParallelStrategy.restore_checkpoint_after_setup
    lightning_restore_optimizer = ModelParallelStrategy.lightning_restore_optimizer
    tensor_init_context = ModelParallelStrategy.tensor_init_context
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    reduce = ModelParallelStrategy.reduce
    _determine_device_ids = ModelParallelStrategy._determine_device_ids
    load_model_state_dict = ModelParallelStrategy.load_model_state_dict
    load_optimizer_state_dict = ModelParallelStrategy.load_optimizer_state_dict
    _get_process_group_backend = ModelParallelStrategy._get_process_group_backend
    set_world_ranks = ModelParallelStrategy.set_world_ranks

    @override
    def model_to_device(self) -> None:
        """Move what is not on the root device yet; a no-op for a model already placed (e.g. from the last stage).

        FSDP2's ``_apply`` swaps every parameter even when nothing moves, which fails inside
        ``torch.inference_mode()`` ("Cannot set version_counter for inference tensor"); moves that are needed run
        with inference mode off.
        """
        assert self.model is not None
        device = self.root_device
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if all(t.device == device for t in tensors):
            return
        with torch.inference_mode(False):
            self.model.to(device)

    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning asks this of strategies it does not know (e.g. to add a DistributedSampler)."""
        return True

    def _setup_distributed(self) -> None:
        # ModelParallelStrategy._setup_distributed, written against ParallelStrategy (it calls super())
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)  # fmt: skip

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # a model sharded again for another stage has new parameters: optimizers of the last stage cannot be reused
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    # ------------------------------------------------------------------ registration and properties
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fsdp_plus"`` (and its spawn variant) with Lightning's strategy registry."""
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 with declarative sharding (fsdp_plus)")
        strategy_registry.register(
            f"{cls.strategy_name}_spawn", cls, description="fsdp_plus, launched with spawn", start_method="spawn"
        )

    @property
    def sharding_plan(self) -> ShardingPlan:
        """The plan applied in ``setup``: every FSDP unit, its parameters and its bytes per rank."""
        if self._sharding_plan is None:
            raise RuntimeError("The sharding plan is computed in setup(); call trainer.fit/validate first.")
        return self._sharding_plan

    @property
    @override
    def precision_plugin(self) -> FSDPPlusPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, FSDPPlusPrecision) else FSDPPlusPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        devices = getattr(self, "parallel_devices", None)
        device = devices[0].type if devices else None
        self._precision_plugin = None if plugin is None else FSDPPlusPrecision.from_lightning(plugin, device=device)
        options = self.__dict__.get("options")
        if self._precision_plugin is not None and options is not None:
            self._precision_plugin.log_grad_norm = options.log_grad_norm

    # ------------------------------------------------------------------ early validation (no process group yet)
    @override
    def _configure_launcher(self) -> None:
        # Called at the end of Trainer.__init__: devices, nodes and precision are known, no process group exists.
        if isinstance(self.cluster_environment, SLURMEnvironment):  # before anything reads this rank's device
            check_slurm_allocation(devices=self.num_processes, num_nodes=self.num_nodes)
        self._mesh_layout = None
        _ = self.mesh_layout
        device_type = self._device_type
        plugin = self.precision_plugin
        plugin.device = device_type
        plugin.log_grad_norm = self.options.log_grad_norm
        check_precision(str(plugin.precision), device_type=device_type)
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.options.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FSDPPlusSpawnLauncher(self, start_method=self.options.start_method)

    @property
    def _device_type(self) -> str:
        return self.root_device.type if self.parallel_devices else "cpu"

    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_fsdp_plus_module")

    @_lightning_module.setter
    def _lightning_module(self, model: pl.LightningModule | None) -> None:
        # Trainer.fit/validate assign the module here before launching any process: the earliest moment to
        # resolve wrap and checkpointing class names against the model (unless configure_model builds layers),
        # and to take a compiled module's compiler for the units (before Lightning checks compile support).
        compiled = None if model is None else from_compiled_module(model, option=self.options.compile)
        if compiled is not None:
            self.options = self.options.replace(compile=compiled)
        if model is not None and not is_overridden("configure_model", model):
            prepare_model(model, self.options)
            check_tensor_parallel(model, self.options)
            if self.options.auto:  # a budget nothing fits fails here, before any process starts
                self._auto_plan = self._predict_auto(model)
            else:
                plan_model(model, self.options, layout=self.mesh_layout,
                           precision=str(self.precision_plugin.precision), device_type=self._device_type)  # fmt: skip
        self.__dict__["_fsdp_plus_module"] = model

    # ------------------------------------------------------------------ the auto plan (see autoplan/)
    def _predict_auto(self, module: torch.nn.Module) -> AutoPlan:
        """Every candidate's memory for ``module`` (NoFitError when none fits)."""
        return predict_for_module(
            module, self.options, world_size=self.num_nodes * self.num_processes,
            precision=str(self.precision_plugin.precision), device=self.root_device if self.parallel_devices else
            torch.device("cpu"), ranks_per_node=self.num_processes or 1,
        )  # fmt: skip

    def _resolve_auto(self) -> None:
        """Probe, choose, print the table on rank 0, and continue with the chosen options and their mesh."""
        assert self.model is not None and self.lightning_module is not None
        prepare_model(self.model, self.options)  # a model built in configure_model gets its LoRA now
        memory = self._auto_plan
        if memory is None or memory.world_size != self.world_size:
            memory = self._predict_auto(self.model)
        config, _, _ = planning_options(self.model, self.options)
        plan = decide(memory, self.options, config=config, device=self.root_device)
        rank_zero_info(plan.format_table())
        self._auto_plan = plan
        self.options = plan.choice.candidate.options(self.options)
        self._mesh_layout = None
        self._device_mesh = build_mesh(layout=self.mesh_layout, device_type=self.root_device.type, given=None)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def auto_plan(self) -> AutoPlan | None:
        """With ``sharding_strategy="auto"``: the candidates, their predictions and (after setup) the choice."""
        return self._auto_plan

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._check_device_id()
        trainer = getattr(self.lightning_module, "_trainer", None)  # None when driven without a Trainer
        attached = isinstance(trainer, Trainer)
        if attached:  # before any process group
            self._on_preempt = resolve_on_preempt(self.options.on_preempt, trainer=trainer)
        self._setup_distributed()
        if attached:
            # signals only set a flag from now until the stage's teardown (preemption.py); Lightning's own
            # handler would issue a collective from inside the signal handler
            self._preemption = install(trainer, group=self._agreement_group())
        start_rank_services(device_type=self.root_device.type, local_ranks=self.num_processes)
        self._device_mesh = build_mesh(
            layout=self.mesh_layout, device_type=self.root_device.type, given=self.options.device_mesh
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def teardown(self) -> None:
        ModelParallelStrategy.teardown(self)
        restore_threads()

    def _agreement_group(self) -> Any:
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_initialized() else None
        if self._agreement is None or self._agreement[0] is not world:
            group = agreement_group(backend=self._process_group_backend or "gloo", timeout=self._timeout)
            self._agreement = (world, group)
        return self._agreement[1]

    def _agree_on_preemption(self) -> bool:
        """Whether any rank was signalled (a collective at a step boundary; see preemption.py)."""
        return self._preemption is not None and self._preemption.agree()

    @property
    def preemption(self) -> PreemptionSignals | None:
        """The signal handling of the running stage (``None`` before ``setup_environment``)."""
        return self._preemption

    def _check_device_id(self) -> None:
        if self._device_id is None:
            return
        given = self._device_id
        device = torch.device(self.root_device.type, given) if isinstance(given, int) else torch.device(given)
        if device != self.root_device:
            raise ValueError(
                f"device_id={given!r} is not this rank's device {self.root_device}; FSDP2 places shards on the"
                " strategy's root device: leave device_id unset"
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1(self.model)
        if is_sharded(self.model):
            if self.options.auto:
                raise ValueError(
                    "sharding_strategy='auto' chooses how to shard, but configure_model already called fully_shard:"
                    " remove those calls or pin a sharding_strategy"
                )
            user_sharded = self._sharding_plan is None  # not ours: the user called fully_shard in configure_model
            if user_sharded:
                rank_zero_info(
                    "fsdp_plus: the model is already sharded (fully_shard in configure_model); using it as is."
                )
                self._check_layer_sync_before_user_sharding()
                self._sharding_plan = user_sharding_plan(self.model, self.options, layout=self.mesh_layout)
            materialize_model(self.model, device=self.root_device, param_init_fn=self.options.param_init_fn,
                              report=rank_zero_info)  # fmt: skip
            if user_sharded:  # as ModelParallelStrategy does: "-true" precisions store the parameters in their dtype
                self.model = self.precision_plugin.convert_module(self.model)
        else:
            if self.options.auto:
                self._resolve_auto()
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:  # Trainer(sync_batchnorm=True)
                self.model = sync_batch_norm(self.model, layer_sync=self._layer_sync, device=self.root_device)
            self.model, self._sharding_plan = build_sharded_model(
                self.model,
                self.options,
                mesh=self.device_mesh,
                layout=self.mesh_layout,
                precision=self.precision_plugin,
                device=self.root_device,
                report=rank_zero_info,
            )
            if self._auto_plan is not None:
                self._sharding_plan = dataclasses.replace(self._sharding_plan, auto_plan=self._auto_plan)
            if self.num_nodes > 1:
                rank_zero_info(
                    f"mesh across nodes: {node_boundaries(self.mesh_layout, ranks_per_node=self.num_processes)}"
                )
        offloaded = self.options.cpu_offload and self.root_device.type != "cpu"
        if not offloaded:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not offloaded:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_layer_sync_before_user_sharding(self) -> None:
        """``sync_batchnorm=True`` cannot convert layers the user sharded already: FSDP2 keeps the old modules."""
        assert self.model is not None
        norms = batch_norms(self.model)
        if self._layer_sync and norms:
            raise ValueError(
                f"Trainer(sync_batchnorm=True) with a model sharded in configure_model: {norms[0]} is a BatchNorm"
                " that fully_shard already manages, so it cannot be swapped for SyncBatchNorm. Convert before"
                " fully_shard (torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)) or let fsdp_plus shard"
            )

    # ------------------------------------------------------------------ checkpoints (see checkpoint.py)
    @property
    def trainable_only(self) -> bool:
        """Whether checkpoints leave frozen parameters out (``save_trainable_only``, or auto)."""
        assert self.model is not None
        return saves_trainable_only(self.model, option=self.options.save_trainable_only)

    def reshard(self) -> None:
        """Put every FSDP unit back in its sharded state (outside ``torch.inference_mode``).

        FSDP2 keeps the root unit's parameters unsharded after a forward (they are needed for backward); after an
        evaluation stage nothing calls backward, so they would stay whole (memory) and plain, inference-mode
        tensors, which state-dict calls cannot read ("Cannot set version_counter for inference tensor").
        """
        if self.model is None:
            return
        with torch.inference_mode(False):
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    @override
    def on_validation_end(self) -> None:
        self.reshard()
        self._stop_if_preempted()

    @override
    def on_test_end(self) -> None:
        self.reshard()
        self._stop_if_preempted()

    @override
    def on_predict_end(self) -> None:
        self.reshard()
        self._stop_if_preempted()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        self.reshard()  # ModelCheckpoint saves in on_validation_end, before the strategy's hook
        return model_state(self.model, full=self.options.state_dict_type == "full", trainable_only=self.trainable_only)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state; with ``state_dict_type="full"`` the whole state on rank 0 (empty elsewhere)
        keyed by parameter ids like ``torch.optim.Optimizer.state_dict``, so DDP or one device can resume it."""
        assert self.model is not None
        return optimizer_state(self.model, optimizer, full=self.options.state_dict_type == "full",
                               trainable_only=self.trainable_only)  # fmt: skip

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FSDPPlusStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["fsdp_plus"] = {
            **checkpoint_settings(options=self.options, trainable_only=self.trainable_only, world_size=self.world_size),
            "peft": self._peft_info(),
        }
        if self.options.state_dict_type == "full":
            save_full(path, checkpoint=checkpoint)
            return
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        save_sharded(path, model_state=model_state, optimizer_states=optimizer_states, metadata=checkpoint)

    def _peft_info(self) -> dict[str, Any] | None:
        found = find_peft_model(self.lightning_module) if self.lightning_module is not None else None
        if found is None:
            return None
        path, peft_model = found
        adapter = peft_model.active_adapter
        # plain JSON types only, so the metadata loads with weights_only=True (sets become sorted lists)
        as_json = json.dumps(peft_model.peft_config[adapter].to_dict(),
                             default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o))  # fmt: skip
        return {"path": path, "adapter_name": adapter, "config": json.loads(as_json)}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        self.reshard()
        with torch.inference_mode(False):  # trainer.test(ckpt_path=...) may run inside torch.inference_mode()
            return self._load_checkpoint(path)

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        # optimizer states are restored when fitting (Lightning's rule); test/predict after fit keep fit's optimizers
        optimizers = self.optimizers if self.lightning_module.trainer.state.fn == TrainerFn.FITTING else []
        return load_into(path, model=self.model, optimizers=optimizers, strict=self.lightning_module.strict_loading,
                         trainable_only=self.trainable_only)  # fmt: skip

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        sidecar = Path(f"{filepath}.sha256")
        if self.is_global_zero and sidecar.is_file():
            sidecar.unlink()

    # ------------------------------------------------------------------ preemption (see preemption.py)
    @override
    def on_train_start(self) -> None:
        assert self.lightning_module is not None
        self._steps_at_start = self.lightning_module.trainer.global_step
        if self._agree_on_preemption():  # signalled while loading or restoring: stop before the first step
            raise SIGTERMException

    @override
    def on_train_end(self) -> None:
        if self._agree_on_preemption():  # signalled after the last step: save and exit all the same
            raise SIGTERMException

    def _stop_if_preempted(self) -> None:
        # the end of an evaluation stage is a boundary too (a signal after its last batch would be lost);
        # inside fit, the training loop stops at its next check instead, so that its state stays resumable
        assert self.lightning_module is not None
        if self._agree_on_preemption() and self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            raise SIGTERMException

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # torchtune's order: the gradients go as soon as they are applied. Lightning zeroes them only after the next
        # training_step, so every forward (and the loss, a vocabulary's peak) would hold the last step's gradient
        # shards: 4 bytes a trained parameter over the shard size. Its on_before_zero_grad hook then sees None.
        optimizer.zero_grad(set_to_none=True)
        # every rank stops after the same step (Lightning's loop checks the flag); in flight: no barrier per step
        if self._preemption is not None:
            self._preemption.agree_in_flight()
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        # no collective here: the other ranks may be inside one of their own (failures.py)
        preempted = isinstance(exception, SIGTERMException) and bool(self._preemption and self._preemption.agreed)
        if not preempted:
            announce_failure(exception)
        if self._preemption is None or self.lightning_module is None:
            return
        handle_preemption(self.lightning_module.trainer, exception, connector=self._preemption,
                          on_preempt=self._on_preempt, steps_at_start=self._steps_at_start)  # fmt: skip

    # ------------------------------------------------------------------ steps run through the root's FSDP hooks
    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # The root unit is the LightningModule itself; calling training_step directly would bypass FSDP2's
        # forward hooks (unshard of root parameters, backward finalisation). Route it through __call__.
        assert self.model is not None and self.lightning_module is not None
        with loss_parallel_context(self.options.loss_parallel):
            output = self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)
        return local_loss(output) if self.options.loss_parallel else output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # loss parallel: the cross-entropy's backward on vocabulary-sharded logits runs inside torch's context too
        with loss_parallel_context(self.options.loss_parallel):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree_on_preemption()  # Lightning's evaluation loop stops after this batch when agreed
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree_on_preemption()
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._agree_on_preemption():  # Lightning's prediction loop does not check the flag
            raise SIGTERMException
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh: 1-D ``("shard",)`` or 2-D ``("replicate", "shard")``."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have initialized (setup_environment).")
        return self._device_mesh


def _init_signature() -> inspect.Signature:
    """``FSDPPlusStrategy.__init__``'s signature for help() and IDEs: the Lightning plumbing, then every option."""
    own = inspect.signature(FSDPPlusStrategy.__init__).parameters
    head = [p for name, p in own.items() if name not in ("sharding_strategy", "kwargs")]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(FSDPPlusOptions)
        if f.name != "sharding_strategy"
    ]
    first = inspect.Parameter("sharding_strategy", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="FULL_SHARD")
    return inspect.Signature([head[0], first, *head[1:], *options])


FSDPPlusStrategy.__init__.__signature__ = _init_signature()  # type: ignore[attr-defined]
FSDPPlusStrategy.__doc__ = f"{FSDPPlusStrategy.__doc__}{textwrap.indent(arguments_docstring(), '    ')}\n"
