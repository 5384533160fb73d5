"""Precision: Lightning's ``precision=`` presets mapped onto FSDP2, and the precision plugin.

============ ================================== ============================= =========================
preset       stored (sharded) parameters        FSDP2 ``MixedPrecisionPolicy``  forward context
============ ================================== ============================= =========================
32-true      fp32                               none                          none
bf16-mixed   fp32                               param bf16, reduce fp32       autocast(bf16) on device
16-mixed     fp32                               param fp16, reduce fp32       autocast(fp16) + scaler
bf16-true    bf16 (module converted)            none                          default dtype bf16
16-true      fp16 (module converted)            none                          default dtype fp16
============ ================================== ============================= =========================

``16-mixed`` uses torch's ``ShardedGradScaler``, which all-reduces the inf/NaN check across ranks so
that every rank skips the same steps. Autocast targets the real device type (``cpu`` or ``cuda``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal, get_args

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp_plus.clipping import (
    clip_grad_norm_across_shards,
    clip_grad_value_across_shards,
    grad_norm_across_shards,
)

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
"""The ``Trainer(precision=...)`` values the strategy supports."""
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "16": torch.float16,
}  # fmt: skip
_POLICY_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_MIXED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def stored_dtype(precision: str) -> torch.dtype:
    """The dtype parameters are kept in under ``precision`` (the module is converted for ``-true`` presets)."""
    return _TRUE_DTYPES.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forward math runs in under ``precision``."""
    return {**_TRUE_DTYPES, **_MIXED_DTYPES}.get(precision, torch.float32)


def parse_dtype(value: str | torch.dtype | None, *, key: str) -> torch.dtype | None:
    """A dtype from a torch dtype or a name like ``"bf16"``/``"bfloat16"``; errors list the names."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def cast_floating(module: Module, *, dtype: torch.dtype) -> Module:
    """Cast ``module``'s floating-point parameters and buffers to ``dtype`` in place, and nothing else.

    ``module.to(dtype)`` (what Lightning's precision plugins call) casts complex tensors too, and casting complex to
    real drops the imaginary part with only a warning: a complex64 rotary table (``freqs_cis``) would silently become
    its real part. Integer tensors (int8 bases, positions) are left alone by both. Works on sharded (DTensor)
    modules too: FSDP2 reshards through ``_apply``.
    """
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def check_precision(precision: str, *, device_type: str, key: str = "precision") -> None:
    """Raise a ValueError if the strategy or the device cannot run ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"{key}={precision!r} is not supported by fsdp_plus; choose one of {', '.join(PRECISIONS)}")
    if device_type == "cuda" and "bf16" in precision and not torch.cuda.is_bf16_supported():
        can = [p for p in PRECISIONS if "bf16" not in p]
        raise ValueError(
            f"{key}={precision!r} needs bfloat16, which this CUDA device does not support;"
            f" choose one of {', '.join(can)}"
        )


def mixed_precision_from_mapping(mapping: Any, *, key: str = "mixed_precision") -> MixedPrecisionPolicy:
    """FSDP2's policy from ``{param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}`` (dtype names ok)."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{key}={mapping!r} must be None or a mapping with keys {', '.join(_POLICY_KEYS)}")
    kwargs: dict[str, Any] = {}
    for name, value in mapping.items():
        if name not in _POLICY_KEYS:
            raise ValueError(f"{key}.{name} is not a valid key; choose from {', '.join(_POLICY_KEYS)}")
        if name == "cast_forward_inputs":
            if not isinstance(value, bool):
                raise ValueError(f"{key}.cast_forward_inputs={value!r} must be true or false")
            kwargs[name] = value
        else:
            kwargs[name] = parse_dtype(value, key=f"{key}.{name}")
    return MixedPrecisionPolicy(**kwargs)


def validate_mixed_precision(mapping: Any, *, key: str = "mixed_precision") -> None:
    """Check a ``mixed_precision`` mapping (keys and dtype names) without using it."""
    if mapping is not None:
        mixed_precision_from_mapping(mapping, key=key)


def mixed_precision_policy(
    *, precision: str, mapping: MixedPrecisionPolicy | Mapping[str, Any] | None = None
) -> MixedPrecisionPolicy:
    """The FSDP2 policy: the user's (a policy or a mapping) when given, else the preset's."""
    if isinstance(mapping, MixedPrecisionPolicy):
        return mapping
    if mapping is not None:
        return mixed_precision_from_mapping(mapping)
    if precision in _MIXED_DTYPES:
        return MixedPrecisionPolicy(param_dtype=_MIXED_DTYPES[precision], reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def logs_this_step(model: Any) -> bool:
    """Whether the trainer of ``model`` sends this training step's values to its loggers (every
    ``log_every_n_steps``, or when it stops); True outside a trainer."""
    trainer = getattr(model, "_trainer", None)
    return trainer is None or trainer._logger_connector.should_update_logs


class FSDPPlusPrecision(FSDPPrecision):
    """Precision plugin for :class:`~lightning_fsdp_plus.FSDPPlusStrategy`: Lightning's ``FSDPPrecision`` with
    autocast on the real device, a scaler for that device, and gradient clipping across shards.

    Arguments:
        precision: One of ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed``, ``16-true``.
        device: Device type for autocast (``"cpu"`` or ``"cuda"``); the strategy sets it from its root device.
        scaler: A gradient scaler for ``16-mixed``; defaults to torch's ``ShardedGradScaler`` for ``device``.
        log_grad_norm: Log the pre-clip global gradient norm as ``grad_norm`` on the steps the trainer logs (every
            ``log_every_n_steps``); clipping by norm measures it every step (``last_grad_norm``).

    Inherited unchanged from ``FSDPPrecision``: module conversion and init contexts for the ``-true`` presets,
    input/output casts, loss scaling in ``pre_backward`` and the scaler's ``optimizer_step``.
    Lightning rewrites ``Trainer(accelerator="cpu", precision="16-mixed")`` into ``bf16-mixed`` before any
    strategy sees it; for real fp16 autocast on CPU pass ``Trainer(plugins=[FSDPPlusPrecision("16-mixed")])``.
    """

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        *,
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        log_grad_norm: bool = True,
    ) -> None:
        check_precision(precision, device_type=device or "cpu")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a gradient scaler, but one was given")
        # FSDPPrecision.__init__ would build a CUDA-only scaler (and check the scaler before setting precision):
        # set the three attributes its methods read ourselves
        self.precision = precision  # type: ignore[assignment]
        self._desired_input_dtype = stored_dtype(precision)
        self._owns_scaler = scaler is None and precision == "16-mixed"
        self.scaler = scaler
        self.device = device or "cpu"
        self.log_grad_norm = log_grad_norm
        self.last_grad_norm: Tensor | None = None

    @property
    def device(self) -> str:
        """Device type autocast and the default scaler run on."""
        return self._device

    @device.setter
    def device(self, value: str) -> None:
        self._device = value
        if self._owns_scaler:  # our default scaler follows the device the strategy settles on
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=value)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward math runs in."""
        return compute_dtype(self.precision)

    defer_conversion: bool = False
    """Set by the Fabric strategy: ``convert_module`` (which ``fabric.setup`` calls before the strategy sees the
    model) leaves the model as it is, and the pipeline converts it with :meth:`convert_now` after quantization, as
    under the Trainer (an int8 or 4-bit base is quantized from the float weights, not from bf16-cast ones)."""

    @override
    def convert_module(self, module: Module) -> Module:
        """``-true`` presets store the parameters in their dtype (:meth:`convert_now`), unless
        :attr:`defer_conversion`."""
        return module if self.defer_conversion else self.convert_now(module)

    def convert_now(self, module: Module) -> Module:
        """``-true`` presets: :func:`cast_floating` (complex and integer tensors, e.g. a complex64 RoPE table or an
        int8 base, keep their dtype); other presets leave the module as it is."""
        if "true" in self.precision:
            return cast_floating(module, dtype=self._desired_input_dtype)
        return module

    @override
    def forward_context(self) -> AbstractContextManager:
        if self.precision in _MIXED_DTYPES:  # FSDPPrecision's autocast is CUDA-only
            return torch.autocast(self.device, dtype=_MIXED_DTYPES[self.precision], cache_enabled=False)
        return super().forward_context()

    @override
    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.last_grad_norm = None
        # only on the steps the trainer logs: a norm costs a pass over the gradients and an all-reduce, and even a
        # norm that clipping measured anyway costs ~1 ms per self.log call (Lightning's result collection)
        log = self.log_grad_norm and getattr(model, "automatic_optimization", False) and logs_this_step(model)
        if log and not (clip_val and gradient_clip_algorithm == "norm"):
            # no norm clipping will measure it: measure before any value clipping changes the gradients
            self.last_grad_norm = grad_norm_across_shards(self.main_params(optimizer))
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)
        if log and self.last_grad_norm is not None:  # stays on the device: Lightning reads it when it logs
            model.log("grad_norm", self.last_grad_norm.detach().float(), on_step=True, prog_bar=False)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.last_grad_norm = clip_grad_norm_across_shards(self.main_params(optimizer), max_norm=float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_value_across_shards(self.main_params(optimizer), clip_value=float(clip_val))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:  # a checkpoint saved without a scaler (another preset) has none to load
            super().load_state_dict(state_dict)

    @classmethod
    def from_lightning(cls, plugin: Precision, *, device: str | None = None) -> FSDPPlusPrecision:
        """Convert the plugin Lightning built from ``Trainer(precision=...)`` into ours."""
        if isinstance(plugin, cls):
            return plugin
        if type(plugin) not in (*_LIGHTNING_PLUGINS(), FSDPPrecision):
            raise ValueError(
                f"precision plugin {type(plugin).__name__} is not supported by fsdp_plus; use"
                f" Trainer(precision=...) with one of {', '.join(PRECISIONS)} or FSDPPlusPrecision"
            )
        precision = str(getattr(plugin, "precision", "32-true"))
        if precision == "16-mixed" and getattr(plugin, "scaler", None) is not None:
            rank_zero_warn("fsdp_plus replaces the given gradient scaler with a ShardedGradScaler")
        return cls(precision, device=device or getattr(plugin, "device", None))  # type: ignore[arg-type]


def from_fabric(plugin: Any, *, device: str | None = None) -> FSDPPlusPrecision:
    """Convert the plugin Fabric built from ``Fabric(precision=...)`` into ours (conversion deferred to the
    pipeline: :attr:`FSDPPlusPrecision.defer_conversion`)."""
    from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDP
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
    from lightning.fabric.plugins.precision import Precision as FabricPrecision

    if isinstance(plugin, FSDPPlusPrecision):
        converted = plugin
    elif type(plugin) in (FabricPrecision, MixedPrecision, HalfPrecision, FabricFSDP):
        converted = FSDPPlusPrecision(str(plugin.precision), device=device or getattr(plugin, "device", None))  # type: ignore[arg-type]
    else:
        raise ValueError(
            f"precision plugin {type(plugin).__name__} is not supported by fsdp_plus; use Fabric(precision=...) with"
            f" one of {', '.join(PRECISIONS)}, and quantize_base='int8'|'nf4'|'fp4' for a quantized base (fsdp_plus"
            " quantizes the frozen layers itself, and shards them)"
        )
    converted.defer_conversion = True
    return converted


def _LIGHTNING_PLUGINS() -> tuple[type, ...]:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    return (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
