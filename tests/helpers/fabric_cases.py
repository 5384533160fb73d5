"""``Fabric(strategy="fsdp_plus")`` against one process (issue 49), one ``torchrun`` launch of 2 ranks.

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/helpers/fabric_cases.py --out DIR \
        --checkpoints DIR

Cases (rank 0 writes ``DIR/results.json``):

- ``parity/<model>/<strategy>/<precision>``: a tiny GPT (``tests.helpers.models``) and a transformers Llama, under
  FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (2 replicas of 1 rank) x 32-true and bf16-mixed, AdamW,
  ``fabric.clip_gradients(max_norm=0.5)``, ``STEPS`` steps; each rank takes its half of the global batch. The GPT is
  set up with ``fabric.setup(model, optimizer)`` (the optimizer made before sharding), the Llama with
  ``setup_module`` then ``setup_optimizers``. Reference: one process, the same initial weights, the per-rank losses
  averaged, ``clip_grad_norm_``, AdamW, in fp32 (bf16-mixed runs use SGD with momentum and are compared with the
  fp32 reference within bf16's tolerance, as the Trainer's are).
- ``accumulate``: the Llama, 2 micro-batches a step, the first under ``fabric.no_backward_sync``.
- ``lora/<base>``: PEFT LoRA on the Llama, the frozen base int8 (sharded), int8 replicated (``lora_only``), NF4
  (sharded): losses, and this rank's bytes of the quantized base.
- ``checkpoint/<format>``: 3 steps, ``fabric.save``, 3 more; a fresh model and optimizer ``fabric.load`` it and run
  the same 3: the losses and parameters of both continuations (the saved step's full state goes to
  ``DIR/<format>.step3.pt`` for the one-process load).
- ``meta_init``: the Llama built under ``fabric.init_module(empty_init=True)`` (meta), then set up: every parameter
  real and finite, training runs.
- ``streamed``: ``deferred_pretrained(DIR/llama)``: each rank reads its shards; the full state equals
  ``from_pretrained``'s.
- ``early_optimizer``: ``fabric.setup(model, optimizer)`` with the strategy's LoRA (which renames every parameter):
  the error it raises.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_fsdp_plus import FSDPPlusFabricStrategy
from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear
from tests.helpers.ac_cases import LORA
from tests.helpers.models import VOCAB as GPT_VOCAB
from tests.helpers.models import lm_loss, make_model

STEPS, MICRO, SEQ, VOCAB, CLIP, LR = 5, 2, 16, 96, 0.5, 1e-2
STRATEGIES = {
    "full_shard": {"sharding_strategy": "FULL_SHARD"},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    "hybrid_shard": {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 1},
}
PRECISIONS = ("32-true", "bf16-mixed")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def llama(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def gpt(seed: int = 0) -> torch.nn.Module:
    return make_model(seed)


def loss_of(model: torch.nn.Module, ids: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gpt":
        return lm_loss(model(ids), ids)
    return model(input_ids=ids, labels=ids).loss


def global_batches(steps: int = STEPS, size: int = 2 * MICRO, vocab: int = VOCAB) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (size, SEQ), generator=generator) for _ in range(steps)]


def make_optimizer(params, precision: str = "32-true") -> torch.optim.Optimizer:
    """AdamW at fp32 (the tight comparison); SGD with momentum under bf16-mixed, compared with the fp32 run as the
    Trainer's bf16 tests do (AdamW's normalized steps turn bf16's rounding into lr-sized parameter moves)."""
    if precision == "bf16-mixed":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR)


def patterned_batches(steps: int, size: int = 2 * MICRO) -> list[torch.Tensor]:
    """Rows of arithmetic token sequences (a stride per row): something a LoRA adapter learns in a few steps, where
    random tokens sit at the uniform loss ``ln(VOCAB)`` from the start."""
    rows = torch.stack([(torch.arange(SEQ) * (r + 1) + r) % VOCAB for r in range(size)])
    return [rows.clone() for _ in range(steps)]


def fabric_for(precision: str = "32-true", **options) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPPlusFabricStrategy(**options), precision=precision)
    fabric.launch()
    return fabric


def full_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model._forward_module, options=_FULL).items()}


def train(fabric, model, optimizer, kind: str, batches: list[torch.Tensor], *, accumulate: int = 1) -> list[float]:
    """Each step: this rank's half of the global batch (in ``accumulate`` micro-batches), clipping, AdamW; the
    global loss of every step."""
    losses = []
    for batch in batches:
        mine = batch.chunk(2)[rank()]
        total = torch.zeros(())
        for i, micro in enumerate(mine.chunk(accumulate)):
            syncing = i == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not syncing) if accumulate > 1 else nullcontext():
                loss = loss_of(model, micro, kind) / accumulate
                fabric.backward(loss)
            total += loss.detach().float()
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())
    return losses


def reference(kind: str, initial: dict, batches: list[torch.Tensor], precision: str) -> tuple[list[float], dict]:
    """One process: the run's initial weights, the per-rank losses averaged, clipping, AdamW."""
    model = gpt() if kind == "gpt" else llama()
    model.load_state_dict(initial)
    optimizer = make_optimizer(model.parameters(), precision)
    losses = []
    for batch in batches:  # in fp32 (the bf16-mixed run is compared with it, within bf16's tolerance)
        loss = torch.stack([loss_of(model, half, kind) for half in batch.chunk(2)]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def parity(kind: str, strategy: str, precision: str, *, accumulate: int = 1) -> dict:
    seed_everything(0)
    fabric = fabric_for(precision, **STRATEGIES[strategy])
    model = gpt() if kind == "gpt" else llama()
    if kind == "gpt":  # the optimizer made before sharding: fabric.setup rebinds it
        optimizer = make_optimizer(model.parameters(), precision)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters(), precision))
    initial = full_state(model)
    batches = global_batches(vocab=GPT_VOCAB if kind == "gpt" else VOCAB)
    losses = train(fabric, model, optimizer, kind, batches, accumulate=accumulate)
    final = full_state(model)
    out = {"mesh": fabric.strategy.sharding_plan.to_dict()["mesh"]}
    if rank() == 0:
        ref_losses, ref_final = reference(kind, initial, batches, precision)
        out |= {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                "param_diff": diff(final, ref_final), "losses": losses}  # fmt: skip
    return out


def lora(base: str) -> dict:
    from peft import LoraConfig, get_peft_model  # noqa: F401  (the strategy applies it from its options)

    options = {"int8": {"quantize_base": "int8"}, "int8_replicated": {"quantize_base": "int8", "lora_only": True},
               "nf4": {"quantize_base": "nf4"}}[base]  # fmt: skip
    seed_everything(0)
    fabric = fabric_for("32-true", lora=LORA, **options)
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR))
    losses = train(fabric, model, optimizer, "llama", patterned_batches(steps=8))
    quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, FourBitLinear))]
    base_bytes = sum(_local(p).numel() * p.element_size() for m in quantized for p in m.parameters(recurse=False)
                     if not p.dtype.is_floating_point)  # fmt: skip
    return {"losses": losses, "quantized_layers": len(quantized), "base_bytes": base_bytes,
            "plan_bytes": fabric.strategy.sharding_plan.bytes_per_rank,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}  # fmt: skip


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def checkpoint(fmt: str, out: Path) -> dict:
    seed_everything(0)
    options = {"state_dict_type": "full"} if fmt == "full" else {}
    batches = global_batches(steps=6)
    fabric = fabric_for("32-true", **options)
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    train(fabric, model, optimizer, "llama", batches[:3])
    path = out / f"ckpt_{fmt}"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    saved = full_state(model)
    if rank() == 0:
        torch.save(saved, out / f"{fmt}.step3.pt")
    continued = train(fabric, model, optimizer, "llama", batches[3:])
    final = full_state(model)
    fresh = fabric.setup_module(llama(seed=7))  # other weights: all must come from the checkpoint
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=LR))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    rest = fabric.load(path, state)
    resumed = train(fabric, fresh, fresh_optimizer, "llama", batches[3:])
    resumed_final = full_state(fresh)  # whole on rank 0 only
    return {"step": state["step"], "rest": sorted(rest), "is_dir": path.is_dir(),
            "loss_diff": max(abs(a - b) for a, b in zip(continued, resumed, strict=True)),
            "param_diff": diff(resumed_final, final) if rank() == 0 else None}  # fmt: skip


def meta_init() -> dict:
    seed_everything(0)
    fabric = fabric_for("32-true")
    with fabric.init_module(empty_init=True):
        model = llama()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = train(fabric, model, optimizer, "llama", global_batches(steps=3))
    params = list(model.parameters())
    return {"on_meta_before": on_meta, "real_after": not any(p.is_meta for p in params),
            "finite": all(bool(_local(p).isfinite().all()) for p in params), "losses": losses}  # fmt: skip


def streamed(checkpoints: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_plus.loading import deferred_pretrained

    seed_everything(0)
    fabric = fabric_for("32-true")
    model = fabric.setup_module(deferred_pretrained(checkpoints / "llama"))
    loaded = full_state(model)  # whole on rank 0 only
    if rank() != 0:
        return {}
    expected = AutoModelForCausalLM.from_pretrained(checkpoints / "llama").state_dict()
    return {"param_diff": max((loaded[k] - expected[k]).abs().max().item() for k in expected),
            "keys_equal": sorted(loaded) == sorted(expected)}  # fmt: skip


def setup_with_lora_refuses_an_early_optimizer() -> dict:
    """``fabric.setup(model, optimizer)`` when the strategy's LoRA renames the parameters: a clear error."""
    fabric = fabric_for("32-true", lora=LORA)
    model = llama()
    try:
        fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    cases = {
        **{f"parity/{kind}/{strategy}/{precision}": (parity, (kind, strategy, precision))
           for kind in ("gpt", "llama") for strategy in STRATEGIES for precision in PRECISIONS},
        "accumulate": (lambda: parity("llama", "full_shard", "32-true", accumulate=2), ()),
        **{f"lora/{base}": (lora, (base,)) for base in ("int8", "int8_replicated", "nf4")},
        **{f"checkpoint/{fmt}": (checkpoint, (fmt, args.out)) for fmt in ("sharded", "full")},
        "meta_init": (meta_init, ()),
        "streamed": (streamed, (args.checkpoints,)),
        "early_optimizer": (setup_with_lora_refuses_an_early_optimizer, ()),
    }  # fmt: skip
    results = {}
    for name, (fn, fn_args) in cases.items():
        if args.only and name not in args.only:
            continue
        results[name] = fn(*fn_args)
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    barrier()
