"""Packed rows of whole examples, with no attention and no loss across examples.

An instruction fine-tune padded to each batch's longest example spends a share of every step on padding (27-36% on
the shipped medical and legal sets at 256 tokens, 50-70% on real instruction sets). Packing several whole examples
into one row of a fixed length removes most of it. Done naively (concatenate, cut every ``row_len`` tokens) examples
are split across rows and attend to their neighbours; here, as torchtune's ``packed=True`` and TRL's position-id
packing do:

* :func:`pack_rows` places whole examples into rows of ``row_len`` tokens, best-fit decreasing (each example, longest
  first, goes into the fullest row it fits; ties in a seeded order), so the rows are fixed by the lengths and the
  seed alone, on any number of ranks;
* :func:`packed_row` concatenates a row's examples with ``position_ids`` restarting at 0 for each, and leaves each
  example's first token out of the loss (in a row it would be predicted from the previous example's last token;
  unpacked, nothing predicts it);
* attention stays inside an example (:func:`attention_route`). transformers (>= 4.53) builds that mask itself for
  models whose modeling code uses its ``masking_utils`` and an attention implementation registered there (``sdpa``,
  ``eager``, ``flex_attention``; flash attention reads the same ``position_ids`` as variable-length sequences): it
  detects packed rows from ``position_ids`` when no ``attention_mask`` is given and no cache is in use. Llama, Qwen2
  and GPT-2 take that route (tested), as does every decoder whose code builds its masks there. For any other model
  (remote code with its own masking, an unregistered attention implementation) :func:`packed_model_inputs` passes
  :func:`block_causal_mask`, our own block-diagonal causal mask, as a 4-D ``attention_mask``, which transformers'
  mask preparation hands to attention unchanged.

Padding at a row's end (rows have a fixed length, so shapes stay static under ``torch.compile``) is one more
sequence with its own positions from 0, out of the loss; it cannot reach any example.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_fsdp_plus.loss import IGNORE_INDEX

Route = Literal["position_ids", "block_mask"]
"""How a packed row keeps attention inside its examples: transformers' packed-sequence detection from
``position_ids``, or our own 4-D block-diagonal mask."""


class PackingError(ValueError):
    """Examples or a model that packed rows cannot serve, with the numbers or the model named."""


def pack_rows(lengths: Sequence[int], *, row_len: int, seed: int = 0) -> list[list[int]]:
    """Indices of the examples in each row: every example exactly once, whole, in rows of at most ``row_len``
    tokens, best-fit decreasing.

    Examples are placed longest first (equal lengths in an order fixed by ``seed``), each into the row with the
    least room left that still holds it, else into a new row; a row keeps its examples in placement order. Raises
    :class:`PackingError` for an example longer than ``row_len`` (truncate first) or an empty one.
    """
    if row_len < 1:
        raise PackingError(f"row_len={row_len} must be a positive number of tokens")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > row_len or n < 1]
    if too_long:
        i, n = too_long[0]
        raise PackingError(f"example {i} has {n} tokens; a packed row of {row_len} holds examples of 1 to {row_len}"
                           " tokens (truncate longer ones to the row length first)")  # fmt: skip
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    order.sort(key=lambda i: -lengths[i])  # stable: the seeded order among equal lengths
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens still free, row number) of the rows not full, sorted
    for i in order:
        n = lengths[i]
        k = bisect_left(room, (n, -1))
        if k == len(room):
            rows.append([i])
            left, row = row_len - n, len(rows) - 1
        else:
            free, row = room.pop(k)
            rows[row].append(i)
            left = free - n
        if left:
            insort(room, (left, row))
    return rows


def packed_row(examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, list[int]]:
    """One row of tokenized examples (``input_ids``, ``labels``): their concatenation, ``position_ids`` restarting
    at 0 for each, and each example's first label set to -100 (nothing in the example predicts it)."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for example in examples:
        ids += example["input_ids"]
        labels += [IGNORE_INDEX, *example["labels"][1 : len(example["input_ids"])]]
        positions += range(len(example["input_ids"]))
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers model inside ``model`` (PEFT and Lightning wrappers allowed), or ``None``."""
    return next((m for m in model.modules() if _transformers_class(m) is not None), None)


def _transformers_class(module: nn.Module) -> type | None:
    """The model class of a transformers ``PreTrainedModel`` (remote code's too), past the subclass FSDP2 makes of
    it in torch's own module; ``None`` for anything else (PEFT's wrapper only forwards ``config``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of every packed run
        return None
    if not isinstance(module, PreTrainedModel):
        return None
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))


def attention_route(model: nn.Module) -> Route:
    """``"position_ids"`` when transformers itself keeps a packed row's attention inside its examples (the model's
    modeling module builds its masks with ``masking_utils`` and its attention implementation is registered there,
    or is flash attention), else ``"block_mask"``. Raises :class:`PackingError` for a model that is not a
    transformers model: packed rows then need the user's own mask (:func:`block_causal_mask`)."""
    inner = _transformers_model(model)
    if inner is None:
        raise PackingError(f"packed rows need a transformers model; {type(model).__name__} is not one: build its"
                           " attention mask with lightning_fsdp_plus.app.packing.block_causal_mask")  # fmt: skip
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    implementation = str(inner.config._attn_implementation)
    code = sys.modules.get(_transformers_class(inner).__module__)
    makers = ("create_causal_mask", "create_sliding_window_causal_mask")
    uses_masking_utils = any(hasattr(code, name) for name in makers)
    registered = implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping or "flash" in implementation
    return "position_ids" if uses_masking_utils and registered else "block_mask"


def block_causal_mask(
    position_ids: Tensor, *, implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> Tensor:
    """The 4-D attention mask ``[batch, 1, tokens, tokens]`` of packed rows: token ``q`` sees token ``k`` when
    ``k <= q`` and both belong to the same example (a new example starts where ``position_ids`` is 0).

    ``sdpa`` (and ``flex_attention``): a bool mask, True where attention is allowed; ``eager``: an additive mask of
    ``dtype`` (0 allowed, its lowest value elsewhere), as transformers' own mask functions make them.
    """
    example = (position_ids == 0).cumsum(-1)
    tokens = position_ids.shape[-1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (example[:, :, None] == example[:, None, :]) & causal
    allowed = allowed[:, None]
    if implementation == "eager":
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)
    if implementation in ("sdpa", "flex_attention"):
        return allowed
    raise PackingError(f"attention implementation {implementation!r} has no packed mask here; valid: sdpa, eager,"
                       " flex_attention (or a model whose transformers code reads position_ids)")  # fmt: skip


def packed_model_inputs(model: nn.Module, batch: Mapping[str, Any], *, route: Route | None = None) -> dict[str, Any]:
    """``batch`` ready for ``model``'s forward. A packed batch (``position_ids`` and no ``attention_mask``) runs
    without a key/value cache (transformers only detects packed rows without one) and, on the ``"block_mask"``
    route (:func:`attention_route`, or ``route`` given), with :func:`block_causal_mask` as its attention mask.
    Other batches are returned as they are."""
    batch = dict(batch)
    if "position_ids" not in batch or batch.get("attention_mask") is not None:
        return batch
    inner = _transformers_model(model)
    if inner is not None and getattr(inner.config, "use_cache", None) is not None:
        batch["use_cache"] = False
    if (route or attention_route(model)) == "block_mask":
        implementation = str(inner.config._attn_implementation) if inner is not None else "sdpa"
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        batch["attention_mask"] = block_causal_mask(batch["position_ids"], implementation=implementation, dtype=dtype)
    return batch
