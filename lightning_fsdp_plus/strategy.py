"""``FSDPPlusStrategy``: Lightning's hooks, delegating to the plan, sharding and precision modules."""

from __future__ import annotations

import atexit
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_fsdp_plus._dist import shutdown
from lightning_fsdp_plus.checkpoint import (
    is_sharded_checkpoint,
    load_full,
    load_sharded,
    save_full,
    save_sharded,
    state_dict_options,
)
from lightning_fsdp_plus.launchers import FSDPPlusSpawnLauncher
from lightning_fsdp_plus.lora import apply_lora, check_trainable, find_peft_model, frozen_parameters, make_lora_config
from lightning_fsdp_plus.plan import (
    MeshLayout,
    ShardingPlan,
    ShardingStrategy,
    build_sharding_plan,
    check_hybrid_shard_size,
    resolve_mesh_layout,
)
from lightning_fsdp_plus.policies import WrapPolicy, resolve_module_classes, select_unit_paths, validate_wrap_policy
from lightning_fsdp_plus.precision import (
    FSDPPlusPrecision,
    check_precision,
    mixed_precision_policy,
    validate_mixed_precision,
)
from lightning_fsdp_plus.quantization import Int8Linear, check_quantize_base, convert_to_int8, int8_candidates
from lightning_fsdp_plus.sharding import apply_sharding_plan, init_mesh, is_sharded, offload_policy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class FSDPPlusStrategy(ModelParallelStrategy):
    """Fully Sharded Data Parallel on FSDP2 (``fully_shard``) with no hand-written sharding code.

    Runs on CPU (gloo) and CUDA (nccl). The model is sharded in ``setup`` from a :class:`ShardingPlan`
    computed by a pure function; ``strategy.sharding_plan`` returns it and rank 0 prints it.

    Arguments:
        sharding_strategy: ``FULL_SHARD`` (default), ``SHARD_GRAD_OP``, ``NO_SHARD`` or ``HYBRID_SHARD``,
            case-insensitive. See :class:`~lightning_fsdp_plus.plan.ShardingStrategy` for the FSDP2 mapping.
        hybrid_shard_size: Ranks per shard group for ``HYBRID_SHARD``; must divide the world size.
            Defaults to the number of devices per node (shard within a node, replicate across nodes).
        auto_wrap_policy: Which submodules become FSDP units: ``"auto"`` (transformers'
            ``_no_split_modules``, else the largest repeated block class), a list of module classes or
            class names, ``{"min_num_params": N}``, a callable ``(module) -> bool``, or ``None``.
            The root module is always a unit.
        mixed_precision: ``None`` derives FSDP2's ``MixedPrecisionPolicy`` from ``Trainer(precision=...)``;
            a mapping ``{param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}`` sets it explicitly.
        activation_checkpointing: Module classes or class names whose forward is recomputed in backward.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2
            ``CPUOffloadPolicy``); meaningful on GPU, a no-op on CPU.
        forward_prefetch: Explicitly prefetch the next unit's all-gather in forward (and the previous one in
            backward) instead of relying on FSDP2's implicit prefetching.
        lora_only: Shard only the trainable (LoRA) parameters, their gradients and optimizer state; the
            frozen base (possibly int8) is kept out of FSDP (``ignored_params``) and replicated on every rank,
            so only the small adapters are all-gathered. ``False`` shards the frozen base too (memory-lean).
        lora: Apply PEFT LoRA in ``setup`` (before sharding): a ``peft.LoraConfig`` or a mapping with
            ``r``, ``alpha``, ``dropout``, ``target_modules`` (and any other ``LoraConfig`` field). It wraps the
            first transformers model inside the LightningModule with ``peft.get_peft_model``. Leave ``None`` if
            the LightningModule applies PEFT itself.
        quantize_base: ``"int8"`` turns every frozen ``nn.Linear`` (and every bitsandbytes ``Linear8bitLt``)
            outside LoRA adapters and ``quantize_skip`` into an :class:`~lightning_fsdp_plus.quantization.Int8Linear`
            computed with bitsandbytes' LLM.int8 kernels; ``None`` (default) keeps the base as it is.
        quantize_skip: Module names or ``fnmatch`` path patterns left unquantized (default: the LM head).
        int8_threshold: LLM.int8 outlier threshold for newly quantized layers (bitsandbytes' ``threshold``).
        state_dict_type: ``"sharded"`` (default): a torch.distributed.checkpoint directory every rank writes
            its shards to, loadable at any world size and sharding strategy; ``"full"``: one consolidated file
            written by rank 0 (gathered one tensor at a time onto CPU).
        save_trainable_only: Leave frozen parameters (the base, int8 included) out of checkpoints; they are
            rebuilt by the LightningModule on resume. ``None`` (default): on when frozen parameters exist.
        use_orig_params: Must be ``True``: FSDP2 always keeps the original parameters (names, ``requires_grad``).
        log_grad_norm: Log the pre-clip global gradient norm as ``grad_norm`` every optimizer step.
        start_method: ``"popen"`` (default: re-run the script for each rank, like ``ddp``), or a
            multiprocessing start method: ``"spawn"``, ``"fork"``, ``"forkserver"``.
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on CPU by default.
        timeout: Timeout for collectives; a rank that stops answering makes the others fail after it.
    """

    strategy_name = "fsdp_plus"

    def __init__(
        self,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        *,
        hybrid_shard_size: int | None = None,
        auto_wrap_policy: WrapPolicy = "auto",
        mixed_precision: Mapping[str, Any] | None = None,
        activation_checkpointing: Sequence[type[nn.Module] | str] | None = None,
        cpu_offload: bool = False,
        forward_prefetch: bool = False,
        lora_only: bool = False,
        lora: Mapping[str, Any] | Any | None = None,
        quantize_base: str | None = None,
        quantize_skip: Sequence[str] = ("lm_head",),
        int8_threshold: float = 6.0,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        save_trainable_only: bool | None = None,
        use_orig_params: bool = True,
        log_grad_norm: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.sharding_strategy = ShardingStrategy.parse(sharding_strategy)
        if hybrid_shard_size is not None:
            check_hybrid_shard_size(hybrid_shard_size=hybrid_shard_size, world_size=hybrid_shard_size)
        if use_orig_params is not True:
            raise ValueError(
                f"use_orig_params={use_orig_params!r} is not supported: FSDP2 has no flat parameters, so the"
                " original parameters (names, requires_grad, optimizer view) are always kept; valid choices: True"
            )
        validate_wrap_policy(auto_wrap_policy)
        if isinstance(activation_checkpointing, (str, Mapping)) or callable(activation_checkpointing):
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} must be a list of module classes or names"
            )
        validate_wrap_policy(activation_checkpointing, key="activation_checkpointing")
        validate_mixed_precision(mixed_precision)
        check_quantize_base(quantize_base)
        if isinstance(quantize_skip, str):
            raise ValueError(f"quantize_skip={quantize_skip!r} must be a list of module names or patterns")
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type={state_dict_type!r} is not one of sharded, full")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not one of {', '.join(_START_METHODS)}")
        self.hybrid_shard_size = hybrid_shard_size
        self.auto_wrap_policy = auto_wrap_policy
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = list(activation_checkpointing or [])
        self.cpu_offload = cpu_offload
        self.forward_prefetch = forward_prefetch
        self.log_grad_norm = log_grad_norm
        self.start_method = start_method
        self.lora_only = lora_only
        self.lora = make_lora_config(lora)
        self.quantize_base = quantize_base
        self.quantize_skip = list(quantize_skip)
        self.int8_threshold = int8_threshold
        self.state_dict_type = state_dict_type
        self.save_trainable_only = save_trainable_only
        self._mesh_layout: MeshLayout | None = None
        self._sharding_plan: ShardingPlan | None = None

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
    def mesh_layout(self) -> MeshLayout:
        """Replicate x shard layout for the current world size."""
        if self._mesh_layout is None:
            hybrid = self.hybrid_shard_size
            if hybrid is None and self.sharding_strategy is ShardingStrategy.HYBRID_SHARD:
                hybrid = self.num_processes or 1
            self._mesh_layout = resolve_mesh_layout(
                sharding_strategy=self.sharding_strategy, world_size=self.world_size, hybrid_shard_size=hybrid
            )
        return self._mesh_layout

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
        if self._precision_plugin is not None:
            self._precision_plugin.log_grad_norm = getattr(self, "log_grad_norm", True)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank is a data-parallel rank in all four strategies
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ early validation (no process group yet)
    @override
    def _configure_launcher(self) -> None:
        # Called at the end of Trainer.__init__: devices, nodes and precision are known, no process group exists.
        self._mesh_layout = None
        if self.hybrid_shard_size is not None:  # a size that cannot divide the world is a mistake in any mode
            check_hybrid_shard_size(hybrid_shard_size=self.hybrid_shard_size, world_size=self.world_size)
        _ = self.mesh_layout
        device_type = self.root_device.type if self.parallel_devices else "cpu"
        plugin = self.precision_plugin
        plugin.device = device_type
        check_precision(str(plugin.precision), device_type=device_type)
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FSDPPlusSpawnLauncher(self, start_method=self.start_method)

    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_fsdp_plus_module")

    @_lightning_module.setter
    def _lightning_module(self, model: pl.LightningModule | None) -> None:
        # Trainer.fit/validate assign the module here before launching any process: the earliest moment to
        # resolve wrap and checkpointing class names against the model (unless configure_model builds layers).
        if model is not None and not is_overridden("configure_model", model):
            self._prepare_model(model)
            self._build_plan(model)
        self.__dict__["_fsdp_plus_module"] = model

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        # free the groups at exit while the interpreter is still whole (see _dist.shutdown); Lightning only
        # destroys nccl groups at exit, and a gloo group left to interpreter teardown can abort the process
        atexit.unregister(shutdown)  # once per process, however many fits
        atexit.register(shutdown)
        self._device_mesh = init_mesh(layout=self.mesh_layout, device_type=self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if is_sharded(self.model):
            if self._sharding_plan is None:  # not ours: the user called fully_shard in configure_model
                rank_zero_info(
                    "fsdp_plus: the model is already sharded (fully_shard in configure_model); using it as is."
                )
                self._sharding_plan = build_sharding_plan(
                    self.model,
                    unit_paths=[n for n, m in self.model.named_modules() if n and isinstance(m, FSDPModule)],
                    sharding_strategy=self.sharding_strategy,
                    mesh=self.mesh_layout,
                )
        else:
            self._prepare_model(self.model)
            if self.quantize_base == "int8":  # quantize from the float weights, before any dtype conversion
                converted = convert_to_int8(self.model, skip=self.quantize_skip, threshold=self.int8_threshold)
                rank_zero_info(f"fsdp_plus: {len(converted)} frozen linear layers now int8 (LLM.int8)")
            self.model = self.precision_plugin.convert_module(self.model)
            self._sharding_plan = self._build_plan(self.model)
            rank_zero_info(self._sharding_plan.format_table())
            apply_sharding_plan(
                self.model,
                self._sharding_plan,
                mesh=self.device_mesh,
                mp_policy=mixed_precision_policy(
                    precision=str(self.precision_plugin.precision), mapping=self.mixed_precision
                ),
                offload=offload_policy(cpu_offload=self.cpu_offload, device_type=self.root_device.type),
                forward_prefetch=self.forward_prefetch,
                ignored_params=self._replicated_params(self.model),
            )
        _materialize_distributed_module(self.model, self.root_device)
        if not self.cpu_offload or self.root_device.type == "cpu":
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _prepare_model(self, model: nn.Module) -> None:
        """Apply LoRA if configured and check the LoRA/int8 options against the model (idempotent)."""
        if self.lora is not None:
            apply_lora(model, self.lora)
        if self.lora_only:
            check_trainable(model)
        already = any(isinstance(m, Int8Linear) for m in model.modules())
        if self.quantize_base == "int8" and not already and not int8_candidates(model, skip=self.quantize_skip):
            raise ValueError(
                "quantize_base='int8' found no frozen nn.Linear outside LoRA adapters and quantize_skip="
                f"{self.quantize_skip}; freeze the base (e.g. apply LoRA) or set quantize_base=None"
            )

    def _replicated_params(self, model: nn.Module) -> set[nn.Parameter]:
        return frozen_parameters(model) if self.lora_only else set()

    def _unit_paths(self, model: nn.Module) -> list[str]:
        return select_unit_paths(model, self.auto_wrap_policy)

    def _build_plan(self, model: nn.Module) -> ShardingPlan:
        checkpointed = resolve_module_classes(model, self.activation_checkpointing, key="activation_checkpointing")
        return build_sharding_plan(
            model,
            unit_paths=self._unit_paths(model),
            sharding_strategy=self.sharding_strategy,
            mesh=self.mesh_layout,
            ignored_params=self._replicated_params(model),
            activation_checkpointing=[n for n, m in model.named_modules() if n and isinstance(m, tuple(checkpointed))],
        )

    # ------------------------------------------------------------------ checkpoints (see checkpoint.py)
    @property
    def trainable_only(self) -> bool:
        """Whether checkpoints leave frozen parameters out (``save_trainable_only``, or auto)."""
        if self.save_trainable_only is not None:
            return self.save_trainable_only
        assert self.model is not None
        return any(not p.requires_grad for p in self.model.parameters())

    def _state_options(self) -> Any:
        return state_dict_options(full=self.state_dict_type == "full", trainable_only=self.trainable_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=self._state_options())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer),
                                        options=self._state_options())  # fmt: skip

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FSDPPlusStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["fsdp_plus"] = {
            "state_dict_type": self.state_dict_type,
            "trainable_only": self.trainable_only,
            "sharding_strategy": self.sharding_strategy.value,
            "world_size": self.world_size,
            "peft": self._peft_info(),
        }
        if self.state_dict_type == "full":
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
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded_checkpoint(path):
            return load_sharded(path, model=self.model, optimizers=self.optimizers)
        checkpoint = load_full(path)
        trainable_only = checkpoint.get("fsdp_plus", {}).get("trainable_only", False)
        options = StateDictOptions(full_state_dict=True, strict=not trainable_only)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", []), strict=False):
            set_optimizer_state_dict(self.model, optimizer, state, options=options)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        sidecar = Path(f"{filepath}.sha256")
        if self.is_global_zero and sidecar.is_file():
            sidecar.unlink()

    # ------------------------------------------------------------------ steps run through the root's FSDP hooks
    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # The root unit is the LightningModule itself; calling training_step directly would bypass FSDP2's
        # forward hooks (unshard of root parameters, backward finalisation). Route it through __call__.
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh: 1-D ``("shard",)`` or 2-D ``("replicate", "shard")``."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have initialized (setup_environment).")
        return self._device_mesh

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sharding_strategy={self.sharding_strategy.value})"
