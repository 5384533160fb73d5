"""One training step as a timeline of moments, and the live bytes of each: the estimator's peak is the largest.

Moments, in order: the root's all-gather, each FSDP unit's forward (execution order), the loss, each unit's backward
(reverse order), the optimizer step. At each one the live tensors of a rank are

* always: the stored parameters (shards, replicated ones) and the optimizer state;
* in forward: the activations saved so far, the gathered copy of every unit that stays gathered after its forward
  (SHARD_GRAD_OP, NO_SHARD, the root unless resharded), the running unit's gathered copy and the next one's
  (FSDP2's prefetch);
* at the loss: every saved activation and what the loss itself allocates (a chunk's float32 logits and their
  gradient with the chunked loss; the plain loss's logits are saved activations of the head already);
* in a unit's backward: the activations of that unit and those before it (the later ones are freed), the gradient
  shards of the units whose backward ran, the unit's gathered copy (re-gathered when it resharded after forward)
  and its unsharded gradients, the next unit's prefetched all-gather and the last one's reduce-scatter input, the
  recomputed activations of a checkpointed unit (once: torch's non-reentrant checkpoint hands each recomputed tensor
  to the backward node that unpacks it and drops its own reference, so they are freed as the unit's backward goes),
  two tensors of the unit's largest saved activation (its gradient and the one beside it) and the largest quantized
  weight dequantized; the output head under the chunked loss allocates none of those: the loss computed its
  gradients in forward (saved activations), and its backward only scales them into its unsharded gradients;
* at the optimizer step: every gradient shard and the optimizer's temporaries.

A moment's activations are attributed to the unit that saved them (counted on a FakeTensor forward by
:class:`UnitActivations`); activations saved outside every unit but the root belong to the root and are counted
from the first moment to the last unit's backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_fsdp_plus.memory.assumptions import GRADIENT_TEMPORARIES
from lightning_fsdp_plus.memory.monitor import SavedActivations, _is_parameter


@dataclass(frozen=True)
class UnitCost:
    """What one FSDP unit adds to the moments it takes part in (bytes on one rank)."""

    path: str
    """The unit's module path (``""``: the root)."""
    gathered: int
    """Its all-gathered compute copy."""
    unsharded_grads: int
    """Its trainable parameters' unsharded gradients (compute dtype) before reduce-scatter."""
    grad_shards: int
    """Its gradient shards after reduce-scatter."""
    reshards: bool
    """Whether it frees its gathered copy after forward (and gathers it again for backward)."""
    activations: int
    """Bytes autograd saves during its forward (its own, not its nested units')."""
    recompute: int = 0
    """With activation checkpointing: what its backward recomputes (saved bytes it no longer keeps)."""
    largest_activation: int = 0
    """The largest tensor it saves (its gradient and the one beside it are backward's temporaries)."""
    loss_grads: int = 0
    """Its trainable parameters' gradients that the chunked loss computed in forward (the output head's, when it
    trains): saved as activations until its backward scales them into its unsharded gradients, which is all that
    backward allocates."""
    in_backward: bool = True
    """Whether backward reaches it: not the first unit when it trains nothing (the input embeddings of a LoRA run:
    its output needs no gradient, so FSDP2 never gathers it for backward)."""


@dataclass(frozen=True)
class Moment:
    """One moment of the step and the live bytes on one rank then."""

    name: str
    """``forward <unit>``, ``loss``, ``backward <unit>`` or ``optimizer step``."""
    bytes: int
    """Live tensor bytes."""
    parts: dict[str, int]
    """Those bytes by kind (``stored``, ``optimizer``, ``activations``, ``gathered``, ``grads``, ``transient``)."""

    def to_dict(self) -> dict[str, Any]:
        """Name, bytes and parts."""
        return {"name": self.name, "bytes": self.bytes, "parts": dict(self.parts)}


def step_timeline(
    *,
    units: Sequence[UnitCost],
    root: UnitCost,
    stored: int,
    optimizer: int,
    loss_transient: int = 0,
    dequantized: int = 0,
    optimizer_temporaries: int = 0,
    prefetch: bool = True,
    gather_copies: int = 0,
) -> list[Moment]:
    """The moments of one step for ``units`` (non-root, in forward order) under ``root`` (see the module docstring).

    ``prefetch``: FSDP2 overlaps the next unit's all-gather (and the last one's reduce-scatter) with the running
    unit's compute, so both are live at once; without sharding there is nothing to gather ahead.
    ``gather_copies``: extra copies of a unit's gathered parameters while it is gathered (gloo's all-gather
    temporary on CPU: 1, alive until the next all-gather, as traced at 128k-152k vocabularies; NCCL gathers in place:
    0). The root is gathered for the whole step: FSDP2
    gathers it again at once for backward even when it reshards after forward.
    """
    base = {"stored": stored, "optimizer": optimizer}
    moments: list[Moment] = []

    def add(name: str, **parts: int) -> None:
        parts = {**base, **{k: v for k, v in parts.items() if v}}
        moments.append(Moment(name=name, bytes=sum(parts.values()), parts=parts))

    def gathered_after_forward(upto: int) -> int:
        return sum(u.gathered for u in units[:upto] if not u.reshards)

    root_kept = root.gathered
    # the step begins with the root's all-gather: its gathered copy and, on gloo, the temporary it was gathered into
    # (traced at Qwen2.5's tied 152k vocabulary: the root's 445 MiB twice, the step's peak)
    add("forward <root>", gathered=root.gathered, transient=gather_copies * root.gathered)
    for i, unit in enumerate(units):
        ahead = units[i + 1].gathered if prefetch and i + 1 < len(units) and units[i + 1].reshards else 0
        add(f"forward {unit.path}", activations=root.activations + sum(u.activations for u in units[: i + 1]),
            gathered=root_kept + gathered_after_forward(i) + unit.gathered + ahead,
            transient=dequantized + gather_copies * unit.gathered)  # fmt: skip
    everything = root.activations + sum(u.activations for u in units)
    kept_all = gathered_after_forward(len(units))
    root_in_backward = root.gathered
    last = units[-1] if units else root
    # FSDP2 frees an all-gather's output only when the next all-gather runs: at the loss, the last unit's (the head,
    # where the chunked loss runs inside its call, or the last block when the head is tied into the root)
    regathered_last = last.gathered if last.reshards else 0
    add("loss", activations=everything, gathered=root_kept + kept_all + regathered_last,
        transient=loss_transient + gather_copies * last.gathered)  # fmt: skip
    done_grads = 0
    for i in range(len(units) - 1, -1, -1):
        unit = units[i]
        if not unit.in_backward:
            continue
        behind = (
            units[i - 1].gathered if prefetch and i > 0 and units[i - 1].reshards and units[i - 1].in_backward else 0
        )
        in_flight = units[i + 1].unsharded_grads if prefetch and i + 1 < len(units) else 0
        kept = sum(u.gathered for u in units[:i] if not u.reshards)
        # the chunked loss's head: its backward only scales the gradients the loss saved into its unsharded ones
        temporaries = 0 if unit.loss_grads else GRADIENT_TEMPORARIES * unit.largest_activation
        add(f"backward {unit.path}", activations=root.activations + sum(u.activations for u in units[: i + 1]),
            gathered=root_in_backward + kept + unit.gathered + behind,
            grads=done_grads + unit.unsharded_grads + in_flight,
            transient=unit.recompute + temporaries + dequantized
            + (gather_copies * unit.gathered if unit.reshards else 0))  # fmt: skip
        done_grads += unit.grad_shards
    # a head tied into the root (Qwen's small sizes): the loss's saved gradient of the table was freed once scaled
    # into the table's gradient, and the embedding's backward adds a dense gradient of the same size to it
    add("backward <root>", activations=root.activations - root.loss_grads, gathered=root_in_backward,
        grads=done_grads + root.unsharded_grads,
        transient=root.loss_grads or GRADIENT_TEMPORARIES * root.largest_activation)  # fmt: skip
    add("optimizer step", grads=done_grads + root.grad_shards, transient=optimizer_temporaries)
    return moments


def peak_moment(moments: Sequence[Moment]) -> Moment:
    """The moment with the most live bytes (the first of equals)."""
    return max(moments, key=lambda m: m.bytes)


class UnitActivations(SavedActivations):
    """:class:`SavedActivations` that also tells which unit saved each storage: the innermost of ``units``
    (module -> key) whose forward is running; storages saved outside all of them go to ``root_key``.

    With ``saved_ops`` it also counts, per checkpointed unit (``checkpointed``: module -> key), the output bytes
    of those operators (what selective checkpointing keeps).
    """

    def __init__(
        self,
        units: dict[nn.Module, str],
        *,
        root_key: str = "",
        checkpointed: dict[nn.Module, str] | None = None,
        saved_ops: frozenset[Any] = frozenset(),
    ) -> None:
        super().__init__()
        self._units, self._root_key = units, root_key
        self._stack: list[str] = []
        self._owner: dict[int, str] = {}
        self._largest: dict[str, int] = {}
        self._checkpointed = checkpointed or {}
        self._saved_ops = saved_ops
        self._ops_stack: list[str] = []
        self.op_outputs: dict[str, int] = {}
        """Per unit: output bytes of ``saved_ops`` run inside a checkpointed module."""
        self.order: list[str] = []
        """Unit keys in the order their forward first ran."""
        self._handles: list[Any] = []
        self._mode: Any = None

    def _pack(self, tensor: Tensor) -> Tensor:
        key = self._stack[-1] if self._stack else self._root_key
        out = super()._pack(tensor)
        if not _is_parameter(tensor):
            storage = tensor.untyped_storage()._cdata
            self._owner.setdefault(storage, key)
            size = self._storages.get(storage, 0)
            owner = self._owner[storage]
            self._largest[owner] = max(self._largest.get(owner, 0), size)
        return out

    def _enter(self, key: str) -> None:
        self._stack.append(key)
        if key not in self.order:
            self.order.append(key)

    @staticmethod
    def _leave(stack: list[str]) -> None:
        stack.pop()  # a forward hook that returned the key would replace the module's output

    def by_unit(self) -> dict[str, int]:
        """Saved bytes per unit key."""
        out: dict[str, int] = {}
        for storage, size in self._storages.items():
            key = self._owner.get(storage, self._root_key)
            out[key] = out.get(key, 0) + size
        return out

    def largest_by_unit(self) -> dict[str, int]:
        """The largest saved storage per unit key."""
        return dict(self._largest)

    def start(self) -> None:
        """Start counting and tracking which unit runs."""
        super().start()
        self._owner.clear()
        self._largest.clear()
        self.op_outputs.clear()
        self.order.clear()
        for module, key in self._units.items():
            # first in: a checkpointed module's own pre-hook saves its inputs, and they are this unit's
            self._handles += [module.register_forward_pre_hook(lambda *_, k=key: self._enter(k), prepend=True),
                              module.register_forward_hook(lambda *_: self._leave(self._stack))]  # fmt: skip
        if self._saved_ops and self._checkpointed:
            for module, key in self._checkpointed.items():
                self._handles += [module.register_forward_pre_hook(lambda *_, k=key: self._ops_stack.append(k)),
                                  module.register_forward_hook(lambda *_: self._leave(self._ops_stack))]  # fmt: skip
            self._mode = _OpOutputs(self)
            self._mode.__enter__()

    def stop(self) -> None:
        """Stop counting; the counts stay."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        super().stop()


class _OpOutputs(TorchDispatchMode):
    """Adds the output bytes of the counter's ``saved_ops`` to the checkpointed unit running."""

    def __init__(self, counter: UnitActivations) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        counter = self.counter
        if counter._ops_stack and func in counter._saved_ops and torch.is_grad_enabled():
            key = counter._stack[-1] if counter._stack else counter._root_key
            size = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, Tensor))
            counter.op_outputs[key] = counter.op_outputs.get(key, 0) + size
        return out
