"""A causal-LM loss that never holds the batch's float32 logits: chunked linear cross-entropy.

At a 128k-152k vocabulary (Llama 3, Qwen 2.5) the logits are the largest tensor of a fine-tuning step:
``batch x seq x vocab`` in float32, 2.1 GB at 2 x 2048 x 128,256, and as much again for their gradient. Here the
output head's matmul and the cross-entropy run one chunk of tokens at a time, and each chunk's gradients (of the
hidden states, and of the head's weight and bias when they train) are computed at once, in forward (the scheme of
Liger-Kernel's fused linear cross-entropy, in plain torch). Alive at a time: one chunk's float32 logits and their
gradient (:func:`default_chunk_tokens`: at most an eighth of the batch's). Backward only scales
the stored gradients, so the head's weight is not needed again after forward.

:func:`causal_lm_loss` runs a transformers causal LM this way without touching its code: during one forward the
output head's ``forward`` computes the loss from the hidden states it is given (inside the head's own call, so
FSDP2 has gathered its weight), and the model's ``logits`` output is that loss. Models whose logits are changed
after the head (Gemma's soft-capping, a ``logit_scale``), whose head is not a ``nn.Linear``, or that are not causal
LMs (a masked LM's loss is not next-token) take the model's own loss instead. :func:`linear_cross_entropy` is the
plain function for your own ``training_step``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fsdp_plus.tensor_parallel import is_loss_parallel_head, local_loss

IGNORE_INDEX = -100
"""Labels with this value are left out of the loss (transformers' and torch's convention)."""

_LOGIT_CHANGERS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")
"""Config fields of models that change the head's output before the loss: those keep their own loss."""


MAX_CHUNKS = 8
"""At most this many chunks a batch (torchtune's ``num_output_chunks``): every chunk reads the whole head weight
again, so many small chunks trade memory for bandwidth (205 chunks of 5 tokens at hidden 512 and a 128k vocabulary
made a CPU step minutes long)."""


def default_chunk_tokens(*, tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: so that one chunk's logits hold about as many elements as the hidden states
    (``ceil(tokens / ceil(vocab / hidden))``, Liger-Kernel's rule), but no more than :data:`MAX_CHUNKS` chunks: a
    chunk's float32 logits are then at most an eighth of the batch's."""
    liger = math.ceil(tokens / max(1, math.ceil(vocab / max(hidden, 1))))
    return max(1, liger, math.ceil(tokens / MAX_CHUNKS))


def _chunk_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed float32 cross-entropy of one chunk (ignored labels contribute nothing)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i @ weight.T + bias, labels_i) / normalizer`` with gradients computed chunk by chunk in
    forward; backward multiplies them by the incoming (scalar) gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk: int, normalizer: Tensor
    ) -> Tensor:
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        want_b = bias is not None and bias.requires_grad
        grad_h = torch.empty_like(hidden) if want_h else None
        # float32 sums over chunks (one bf16 rounding at the end, as the plain matmul's backward has)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(h, weight, bias).float()
            total += F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
            if not (want_h or want_w or want_b):
                continue
            # d(sum CE)/d logits = softmax - one-hot, 0 on ignored rows; in place over the chunk's logits
            grad = logits.softmax(dim=-1)
            del logits
            keep = (y != IGNORE_INDEX).unsqueeze(1)
            grad.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -keep.to(grad.dtype))  # static shapes: no indexing
            grad.mul_(keep).div_(normalizer)
            g = grad.to(hidden.dtype)
            if want_h:
                grad_h[start : start + chunk] = g @ weight
            if want_w:
                grad_w.addmm_(grad.t(), h.float())
            if want_b:
                grad_b += grad.sum(dim=0)
        ctx.save_for_backward(
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None or bias is None else grad_b.to(bias.dtype),
        )
        return total / normalizer

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # scaled into new tensors, not in place: handed on as they are, a tied head's gradient is not summed in place
        # with the embedding's (traced at Qwen2.5's 152k tied vocabulary: one more table-sized tensor, +0.37 GB)
        grad_h, grad_w, grad_b = ctx.saved_tensors

        def scaled(grad: Tensor | None) -> Tensor | None:
            return None if grad is None else grad * grad_out.to(grad.dtype)

        return scaled(grad_h), scaled(grad_w), scaled(grad_b), None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_tokens: int | None = None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, chunked: the whole logits never exist.

    Arguments:
        hidden: ``(..., hidden)`` hidden states, already aligned with ``labels`` (shift them yourself for
            next-token prediction).
        weight: the output head's ``(vocab, hidden)`` weight.
        labels: ``(...)`` target ids; ``-100`` is left out.
        bias: the head's bias, if it has one.
        chunk_tokens: tokens per chunk (default :func:`default_chunk_tokens`).
        normalizer: what the summed loss is divided by (default: the number of counted labels, at least 1; a
            tensor, so nothing waits for its value).

    Equal to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=-100)`` in value and in
    the gradients of ``hidden``, ``weight`` and ``bias`` (float32 sums over chunks).
    """
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if flat_h.shape[0] != flat_y.shape[0]:
        raise ValueError(f"hidden has {flat_h.shape[0]} positions but labels has {flat_y.shape[0]}")
    if normalizer is None:
        normalizer = (flat_y != IGNORE_INDEX).sum().clamp(min=1).float()
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=flat_h.device)
    chunk = chunk_tokens or default_chunk_tokens(tokens=flat_h.shape[0], hidden=flat_h.shape[1], vocab=weight.shape[0])
    if not torch.is_grad_enabled():
        total = sum((_chunk_loss(F.linear(flat_h[i : i + chunk], weight, bias), flat_y[i : i + chunk])
                     for i in range(0, flat_h.shape[0], chunk)), torch.zeros((), device=flat_h.device))  # fmt: skip
        return total / normalizer
    return _ChunkedLinearCrossEntropy.apply(flat_h, weight, bias, flat_y, chunk, normalizer)


def next_token_labels(labels: Tensor) -> Tensor:
    """``labels`` shifted left by one with ``-100`` at the end: position ``t`` predicts token ``t + 1`` (what
    transformers' causal-LM loss does inside)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (its class, or the class inside a PEFT model, is one of transformers' causal-LM
    classes): its loss is next-token cross-entropy. A masked LM's head computes another loss."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    return type(base).__name__ in names


def output_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head when the chunked loss can stand in for its loss: a transformers causal LM
    (:func:`is_causal_lm`) whose ``get_output_embeddings()`` is a ``nn.Linear`` not split over the vocabulary
    (``loss_parallel``: torch's loss-parallel cross-entropy does that), with no logit soft-capping or scaling in its
    config; else None."""
    if not is_causal_lm(model):
        return None
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Linear) or is_loss_parallel_head(head):
        return None
    config = getattr(model, "config", None)
    for name in _LOGIT_CHANGERS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return None
    return head


@contextmanager
def _head_computes_loss(head: nn.Linear, labels: Tensor, chunk_tokens: int | None) -> Iterator[list[Tensor]]:
    """For one call, ``head(hidden)`` returns the chunked loss of ``hidden`` against ``labels`` (kept in the
    yielded list as well): inside the head's own call, so FSDP2's hooks have gathered its weight."""
    seen: list[Tensor] = []
    own = head.__dict__.get("forward")  # an instance forward (e.g. a compiled one) is put back afterwards

    def forward(hidden: Tensor) -> Tensor:
        loss = linear_cross_entropy(hidden, head.weight, labels[..., -hidden.shape[-2] :], bias=head.bias,
                                    chunk_tokens=chunk_tokens)  # fmt: skip
        seen.append(loss)
        return loss

    head.forward = forward  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own  # type: ignore[method-assign]


def causal_lm_loss(
    model: nn.Module, batch: Mapping[str, Tensor], *, chunked: bool = True, chunk_tokens: int | None = None
) -> Tensor:
    """Mean next-token cross-entropy of a transformers-style causal LM on ``batch`` (``input_ids``, optionally
    ``attention_mask`` and ``labels`` with ``-100`` for tokens left out), equal to the model's own ``.loss``.

    With ``chunked`` (default) and a model :func:`output_head` accepts, the loss is computed chunk by chunk inside
    the head's call (:func:`linear_cross_entropy`): no float32 logits of the whole batch. Otherwise the model
    computes its own loss. Use it in your own ``training_step``: ``loss = causal_lm_loss(self.model, batch)``.
    """
    head = output_head(model) if chunked else None
    labels = batch.get("labels", batch["input_ids"])
    if head is None:
        return local_loss(model(**{**batch, "labels": labels}).loss)  # a loss-parallel loss is a replicated DTensor
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with _head_computes_loss(head, next_token_labels(labels), chunk_tokens) as seen:
        model(**inputs)
    if len(seen) != 1:
        raise RuntimeError(f"causal_lm_loss: the output head ran {len(seen)} times in one forward (expected once);"
                           " call causal_lm_loss(..., chunked=False) for this model")  # fmt: skip
    return seen[0]
