"""The chunked causal-LM loss: the same loss and gradients as the plain one, without the batch's float32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fsdp_plus.loss import (
    causal_lm_loss,
    default_chunk_tokens,
    linear_cross_entropy,
    next_token_labels,
    output_head,
)
from lightning_fsdp_plus.memory.monitor import SavedActivations
from lightning_fsdp_plus.sharding import apply_activation_checkpointing


def _plain(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-3)])
@pytest.mark.parametrize("chunk", [1, 7, None, 1000])
def test_linear_cross_entropy_equals_the_plain_loss_and_its_gradients(dtype, tol, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    bias = torch.randn(50, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    labels[0, :4] = -100  # a masked prompt
    labels[2, -3:] = -100  # padding
    ref = _plain(hidden, weight, bias, labels)
    ref.backward()
    expected = [t.grad.float().clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    loss = linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=chunk)
    (3 * loss).backward()  # the incoming gradient scales every stored one
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    for t, want in zip((hidden, weight, bias), expected, strict=True):
        assert torch.allclose(t.grad.float() / 3, want, atol=tol, rtol=tol)


def test_under_no_grad_the_loss_is_the_same_and_nothing_is_kept():
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(2, 9, 8), torch.randn(30, 8), torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert loss.grad_fn is None and loss.item() == pytest.approx(_plain(hidden, weight, None, labels).item(), abs=1e-6)


def test_chunks_hold_about_as_much_as_the_hidden_states_in_at_most_eight_chunks():
    # Llama-3-8B, 2 x 2048 tokens: Liger's rule would make ceil(128256 / 4096) = 32 chunks of 128 tokens; each chunk
    # reads the 1 GB head weight again, so at most 8 chunks (torchtune's count) of 512
    assert default_chunk_tokens(tokens=4096, hidden=4096, vocab=128256) == 512
    assert default_chunk_tokens(tokens=4096, hidden=4096, vocab=16384) == 1024  # 4 chunks: hidden-sized logits
    assert default_chunk_tokens(tokens=3, hidden=64, vocab=128256) == 1


def _llama(*, tied: bool, vocab: int = 300):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip


def _instruction_batch(vocab: int = 300) -> dict[str, torch.Tensor]:
    """Padded instruction-style rows: a masked prompt, a response, right padding with its mask."""
    torch.manual_seed(1)
    ids = torch.randint(2, vocab, (3, 20))
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[:, :6] = -100
    mask[1, -5:], labels[1, -5:], ids[1, -5:] = 0, -100, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("build", [lambda: _llama(tied=False), lambda: _llama(tied=True), _qwen2, _gpt2],
                         ids=["llama", "llama_tied", "qwen2_tied", "gpt2"])  # fmt: skip
def test_causal_lm_loss_equals_the_models_own_loss_and_gradients(build):
    batch = _instruction_batch()
    ref_model, model = build(), build()
    ref = ref_model(**batch).loss
    ref.backward()
    loss = causal_lm_loss(model, batch)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    ref_grads = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, ref_grads[name].grad, atol=1e-6), name
    head = model.get_output_embeddings()
    assert "forward" not in head.__dict__  # the head's own forward is back


def test_the_chunked_loss_saves_no_float32_logits():
    model, batch = _llama(tied=False, vocab=4096), _instruction_batch(4096)
    model.lm_head.weight.requires_grad_(False)  # frozen, as under LoRA (a trained head keeps its weight's gradient)
    counts = {}
    for chunked in (False, True):
        with SavedActivations() as saved:
            causal_lm_loss(model, batch, chunked=chunked)
        counts[chunked] = saved.bytes
    logits = 3 * 20 * 4096 * 4
    # the plain loss keeps the float32 log-probabilities; the chunked one a hidden-sized gradient instead (7.7 KB)
    assert counts[False] - counts[True] >= logits - 3 * 20 * 32 * 4


def test_a_compiled_or_patched_head_forward_is_put_back():
    model = _llama(tied=False)
    head = model.get_output_embeddings()
    own = head.forward
    head.forward = lambda x: F.linear(x, head.weight)  # what compile_units does: an instance forward
    patched = head.forward
    causal_lm_loss(model, _instruction_batch())
    assert head.forward is patched and own is not patched


def test_models_that_change_their_logits_keep_their_own_loss():
    model = _llama(tied=False)
    assert output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # Gemma 2: tanh soft-capping after the head
    assert output_head(model) is None
    batch = _instruction_batch()
    assert causal_lm_loss(model, batch).item() == pytest.approx(model(**batch).loss.item(), abs=1e-6)
    assert output_head(nn.Sequential(nn.Linear(2, 2))) is None


def test_next_token_labels_shift_left_and_pad_with_ignore():
    assert next_token_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_modes_give_the_unchecked_gradients(mode):
    batch = {**_instruction_batch(), "use_cache": False}
    grads = {}
    for checkpointed in (False, True):
        model = _llama(tied=False)
        if checkpointed:
            apply_activation_checkpointing(model, ["model.layers.0", "model.layers.1"], mode=mode)
        causal_lm_loss(model, batch).backward()
        grads[checkpointed] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads[False].items():
        assert torch.equal(grads[True][name], grad), name


@pytest.mark.parametrize(("precision", "tol"), [("32-true", 1e-5), ("bf16-mixed", 1e-3)])
def test_ten_training_steps_give_the_losses_and_weights_of_the_models_own_loss(precision, tol):
    """The acceptance's yardstick: 10 AdamW steps on padded, prompt-masked rows, chunked against the model's own
    loss, in float32 and in bf16-mixed (float32 weights, bfloat16 compute: bf16-true weights differ by their rounding
    step, 2^-9 at 0.25, whatever the loss). lr 1e-4: Adam moves an element by about lr whatever its gradient's size,
    so where bfloat16 rounding flips a near-zero gradient's sign (either loss rounds) weights part by up to 2 x lr a
    step (measured at lr 1e-3: 1.95e-3 after 10 steps)."""
    import contextlib

    batch = _instruction_batch()
    runs = {}
    for chunked in (False, True):
        model = _llama(tied=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for _ in range(10):
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else (
                contextlib.nullcontext())  # fmt: skip
            with autocast:
                loss = causal_lm_loss(model, batch) if chunked else model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs[chunked] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    (plain_losses, plain), (chunked_losses, chunked) = runs[False], runs[True]
    assert chunked_losses == pytest.approx(plain_losses, abs=tol)
    assert plain_losses[-1] < plain_losses[0]  # it trained
    worst = max((chunked[n] - plain[n]).abs().max().item() for n in plain)
    assert worst <= tol, worst
