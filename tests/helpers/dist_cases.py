"""Multi-process training cases, run as a script (never imported by pytest's collection).

    python tests/helpers/dist_cases.py --out DIR --cases full_shard_sgd,clip_norm [--launcher popen|spawn]

Run with the repository root on PYTHONPATH (``tests.helpers.launch`` does). Lightning's subprocess
launcher re-runs this file for rank 1; under ``torchrun`` each rank runs it.
Every case writes ``DIR/<case>.rank<r>.json`` (losses, memory, scaler) and rank 0 writes ``DIR/<case>.pt``
(the full, unsharded final state dict) for the tests to compare with a single-process reference.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as FSDP1ShardingStrategy
from torch.utils.data import DataLoader

from lightning_fsdp_plus import FSDPPlusPrecision, FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus.app.lm import CausalLMModule
from lightning_fsdp_plus.compile import compile_counters, graph_break_reasons, reset_compile_counters
from lightning_fsdp_plus.lora import export_adapter, find_peft_model
from lightning_fsdp_plus.memory import MemoryMonitor
from lightning_fsdp_plus.memory.accounting import local_bytes
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear
from tests.helpers.models import (
    LORA,
    LORA_LLAMA,
    SEQ,
    Block,
    FixedBatches,
    StridedSampler,
    TinyLM,
    TokenDataset,
    arch_lora,
    lora_base,
    lora_model,
    sgd_causal_lm,
    tied_model,
    tiny_llama,
)
from tests.helpers.threads import gloo_threads

STEPS = 6
DEVICES = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
"""Ranks on this node: 2, or 1 when two torchrun agents play two nodes (``tests/test_multinode.py``)."""
ARCH_LORA_STEPS = 8
"""Steps of the Falcon and BERT LoRA + int8 cases (their point is equality with one process, step by step)."""

CASES: dict[str, dict] = {
    "full_shard_sgd": {"strategy": {"sharding_strategy": "FULL_SHARD"}},
    "full_shard_root_resharded_sgd": {
        "strategy": {"sharding_strategy": "FULL_SHARD", "reshard_root_after_forward": True}
    },
    "shard_grad_op_sgd": {"strategy": {"sharding_strategy": "shard_grad_op"}},
    "no_shard_sgd": {"strategy": {"sharding_strategy": "NO_SHARD"}},
    "hybrid_shard_sgd": {"strategy": {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 1}},
    # HYBRID_SHARD's default shard group: the ranks of one node (tests/test_multinode.py runs it on two "nodes")
    "hybrid_shard_per_node_sgd": {"strategy": {"sharding_strategy": "HYBRID_SHARD"}},
    "full_shard_adamw": {"strategy": {}, "module": {"optimizer": "adamw", "lr": 3e-3}},
    "ac_prefetch_sgd": {
        "strategy": {
            "activation_checkpointing": ["Block"],
            "forward_prefetch": True,
            "auto_wrap_policy": {"min_num_params": 5000},
        }
    },
    "clip_norm": {"strategy": {}, "trainer": {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}},
    # grad_norm is measured on the steps the trainer logs (every 2nd here); clipping by norm measures it every step
    "clip_value": {
        "strategy": {},
        "trainer": {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value", "log_every_n_steps": 2},
    },
    "bf16_mixed": {"strategy": {}, "trainer": {"precision": "bf16-mixed"}},
    "bf16_true": {"strategy": {}, "trainer": {"precision": "bf16-true"}},
    # Lightning FSDPStrategy's arguments, as a project moving from strategy="fsdp" passes them: must train like
    # bf16_mixed; rank 1 starts from other weights, which sync_module_states replaces by rank 0's
    "lightning_fsdp_args": {
        "strategy": {
            "sharding_strategy": FSDP1ShardingStrategy.FULL_SHARD,
            "auto_wrap_policy": {Block},
            "activation_checkpointing_policy": {Block},
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "cpu_offload": CPUOffload(offload_params=False),
            "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
            "limit_all_gathers": True,
            "sync_module_states": True,
            "use_orig_params": True,
        },
        "trainer": {"precision": "bf16-mixed"},
        "perturb_rank1": True,
    },
    "fp16_mixed_inf": {"strategy": {}, "plugins": "16-mixed", "inject_inf_at": 2},
    "llama_auto": {"strategy": {}, "llama": True, "trainer": {"use_distributed_sampler": True}},
    # tied weights under auto_wrap_policy="auto": BERT's decoder shares BertEmbeddings' weight (a _no_split_module),
    # a tied Llama's head its embedding; SGD on a fixed batch, compared with one process
    "bert_mlm_tied": {"strategy": {}, "tied": "bert"},
    "llama_tied": {"strategy": {}, "tied": "llama"},
    # LoRA on a Llama, 20 SGD steps on a fixed batch. Replicated: the module applies PEFT itself;
    # sharded: the strategy applies LoRA from its config. bf16: the replicated bf16 base to compare bytes with.
    "lora_int8_replicated": {"strategy": {"lora_only": True, "quantize_base": "int8"}, "lora": "module"},
    "lora_int8_sharded": {"strategy": {"lora_only": False, "quantize_base": "int8", "lora": LORA}, "lora": "strategy"},
    "lora_bf16_replicated": {"strategy": {"lora_only": True}, "lora": "module", "trainer": {"precision": "bf16-true"}},
    # QLoRA: the same two modes over a 4-bit NF4 base (compared with bnb.nn.Linear4bit + PEFT in one process)
    "lora_nf4_replicated": {"strategy": {"lora_only": True, "quantize_base": "nf4"}, "lora": "module"},
    "lora_nf4_sharded": {"strategy": {"lora_only": False, "quantize_base": "nf4", "lora": LORA}, "lora": "strategy"},
    # the auto plan, with a budget only the leanest candidate fits (an int8 one: numerics as the int8 reference)
    "auto_lora_int8": {
        "strategy": {
            "sharding_strategy": "auto",
            "lora": LORA,
            "allow_quantize": ["int8"],
            "plan_batch_size": 4,
            "plan_seq_len": SEQ,
        },
        "lora": "strategy",
        "auto": True,
    },
    # LoRA + int8 on other layer types: Falcon's FalconLinear (an nn.Linear subclass), BERT's masked LM (its decoder,
    # the output embeddings, tied to the word embeddings: kept in float); both modes
    **{
        f"lora_int8_{mode}_{arch}": {
            "strategy": {
                "lora_only": mode == "replicated",
                "quantize_base": "int8",
                **({"lora": arch_lora(arch)} if mode == "sharded" else {}),
            },
            "lora": "module" if mode == "replicated" else "strategy",
            "arch": arch,
            "steps": ARCH_LORA_STEPS,
        }
        for arch in ("falcon", "bert")
        for mode in ("replicated", "sharded")
    },
    # the user shards in configure_model: "-true" precisions still store the parameters in their dtype
    "user_sharded_bf16_true": {"strategy": {}, "user_sharded": True, "trainer": {"precision": "bf16-true"}},
    "lora_int8_sharded_bf16_mixed": {
        "strategy": {"quantize_base": "int8", "lora": LORA},
        "lora": "strategy",
        "trainer": {"precision": "bf16-mixed"},
    },
}
AOT_EAGER = {"backend": "aot_eager"}
"""The tests' compile backend: dynamo's capture and AOTAutograd's joint graph, run with eager kernels (fast to build;
inductor's own code generation is covered by the Llama cases)."""


def _compiled(name: str, compile: dict | bool = AOT_EAGER, **extra) -> dict:
    spec = CASES[name]
    return {**spec, **extra, "strategy": {**spec["strategy"], "compile": compile}, "eager": name}


COMPILED_CASES: dict[str, dict] = {
    # issue 33: each compared with its eager case (``eager``) from the same data and seeds, in one launch
    **{
        f"{name}_compiled": _compiled(name)
        for name in (
            "full_shard_sgd",
            "shard_grad_op_sgd",
            "no_shard_sgd",
            "hybrid_shard_sgd",
            "ac_prefetch_sgd",
            "clip_norm",
            "bf16_mixed",
            "bf16_true",
            "lora_int8_replicated",
            "lora_int8_sharded",
            "lora_nf4_sharded",
        )
    },
    "llama_auto_compiled": _compiled("llama_auto", compile=True),  # inductor
    # trainer.fit(torch.compile(module)): the same as compile=True
    "llama_auto_fit_compiled": {**CASES["llama_auto"], "eager": "llama_auto", "fit_compiled": {}},
    # checkpoints both ways: an eager and a compiled run's checkpoints resumed by the other kind (run_interop)
    "llama_checkpoint_interop": {"interop": True},
}
"""Compiled twins of eager cases (``tests/test_compile_distributed.py``); not in the default ``--cases``."""
LORA_STEPS, LORA_LR = 20, 0.5
TIED_LR = 0.1


class Recorder(Callback):
    """Global loss per step, scaler scale, whether the local shard moved; memory from the MemoryMonitor."""

    def __init__(self, name: str, out: Path, monitor: MemoryMonitor, *, export_peft: bool = True) -> None:
        self.name, self.out, self.monitor, self.export_peft = name, out, monitor, export_peft
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.stepped: list[bool] = []
        self.grad_norms: list[float] = []
        self.frozen_with_grad = 0
        self.seen_scale: dict | None = None

    def on_train_start(self, trainer, module) -> None:
        # what an Int8Linear's scale looks like inside forward, after FSDP2's all-gather and mixed precision
        layer = next((m for m in module.modules() if isinstance(m, Int8Linear)), None)
        if layer is not None:

            def capture(mod, args, output):
                if self.seen_scale is None:
                    self.seen_scale = {"dtype": str(mod.weight_scale.dtype), "values": mod.scale.tolist(),
                                       "input_dtype": str(args[0].dtype)}  # fmt: skip

            layer.register_forward_hook(capture)
        self._before: float = 0.0

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        frozen = sum(1 for p in module.parameters() if not p.requires_grad and p.grad is not None)
        self.frozen_with_grad = max(self.frozen_with_grad, frozen)
        self._before = _local_checksum(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float()
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())
        self.stepped.append(_local_checksum(module) != self._before)
        norm = trainer.precision_plugin.last_grad_norm  # None on a step that did not measure it
        self.grad_norms.append(None if norm is None else norm.item())
        scaler = trainer.precision_plugin.scaler
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))

    def on_train_end(self, trainer, module) -> None:
        # runs inside every rank whatever the launcher (popen, spawn, torchrun)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(trainer.strategy.model, options=options)
        record = {
            "losses": self.losses,
            "peak_bytes": _model_state_peak(self.monitor),
            "scales": self.scales,
            "stepped": self.stepped,
            "grad_norms": self.grad_norms,
            "plan": trainer.strategy.sharding_plan.to_dict(),
            "world_size": trainer.world_size,
            "param_types": sorted({type(p).__name__ for p in module.parameters()}),
            "logged": sorted(trainer.logged_metrics),
            "frozen_with_grad": self.frozen_with_grad,
            "frozen_bytes": sum(local_bytes(p) for p in module.parameters() if not p.requires_grad),
            "trainable_bytes": sum(local_bytes(p) for p in module.parameters() if p.requires_grad),
            "frozen_dtypes": sorted({str(p.dtype) for p in module.parameters() if not p.requires_grad}),
            "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
            "base_linear_bytes": base_linear_bytes(module),
            "seen_scale": self.seen_scale,
            "compile": compile_counters(),
            "graph_breaks": graph_break_reasons(),
            "monitor": {
                "peak": self.monitor.peak.to_dict(),
                "model_state_peak": self.monitor.model_state_peak,
                "activation_peak": self.monitor.activation_peak,
                "empty_cache_steps": self.monitor.empty_cache_steps,
                "steps_sampled": len(self.monitor.step_peaks),
            },
        }
        if self.export_peft and find_peft_model(module) is not None:  # adapter in PEFT format + sharded logits
            export_adapter(module, self.out / f"{self.name}.adapter")
            module.eval()
            with torch.no_grad():
                logits = trainer.strategy.model(input_ids=TokenDataset(n=2, seed=7).data).logits
            if trainer.global_rank == 0:
                torch.save(logits.float(), self.out / f"{self.name}.logits.pt")
        (self.out / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
        if trainer.global_rank == 0:
            torch.save({k: v.float() for k, v in full.items()}, self.out / f"{self.name}.pt")


class InjectInf(Callback):
    """Put an inf into rank 1's local gradient shard at one step (after backward, before unscaling)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, module) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:
            grad = next(p for p in module.parameters() if p.grad is not None).grad
            grad.to_local().view(-1)[0] = float("inf")


class UserShardedLM(TinyLM):
    """``TinyLM`` that shards itself in ``configure_model`` as the plan shards it (each block, then the root)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)


def base_linear_bytes(module) -> int:
    """Local bytes of the frozen base's linear layers (what int8 / 4-bit quantize; ``lm_head`` is skipped)."""
    kinds = (torch.nn.Linear, Int8Linear, FourBitLinear)
    return sum(local_bytes(p) for path, m in module.named_modules() if isinstance(m, kinds) and "lm_head" not in path
               and "lora_" not in path for p in m.parameters(recurse=False) if not p.requires_grad)  # fmt: skip


def _model_state_peak(monitor: MemoryMonitor) -> dict[str, int]:
    """The monitor's largest model-state sample: params, unsharded_params, grads, optimizer and their total."""
    sample = monitor.peaks.model_state.to_dict()
    categories = {k: sample[k] for k in ("params", "unsharded_params", "grads", "optimizer")}
    return categories | {"total": sample["model_state"]}


def _local_checksum(module) -> float:
    local = (getattr(p, "to_local", p.detach)() for p in module.parameters() if p.requires_grad)
    return float(sum(t.detach().double().abs().sum() for t in local))


def run_interop(name: str, out: Path) -> None:
    """An eager and a compiled Llama train 6 steps and save a sharded checkpoint each; then an eager run resumes the
    compiled run's checkpoint and a compiled run the eager one's, 2 more steps each. Rank 0 writes
    ``<name>.<eager|compiled>_from_<other>.pt`` (full state dicts) and ``<name>.saved_<kind>.pt``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def fit(kind: str, *, steps: int, resume: Path | None = None) -> Trainer:
        torch._dynamo.reset()
        seed_everything(0, workers=True)
        compile = AOT_EAGER if kind == "compiled" else False
        trainer = Trainer(strategy=FSDPPlusStrategy(compile=compile), accelerator="cpu", devices=2, max_steps=steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, use_distributed_sampler=False)  # fmt: skip
        loader = DataLoader(TokenDataset(), batch_size=4)
        trainer.fit(CausalLMModule(tiny_llama(), lr=1e-2), train_dataloaders=loader, ckpt_path=resume)
        return trainer

    def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(trainer.strategy.model, options=options)

    saved = {}
    for kind in ("eager", "compiled"):
        trainer = fit(kind, steps=6)
        saved[kind] = out / f"{name}.{kind}.ckpt"
        trainer.save_checkpoint(saved[kind])
        state = full_state(trainer)
        if trainer.global_rank == 0:
            torch.save(state, out / f"{name}.saved_{kind}.pt")
    for kind, other in (("eager", "compiled"), ("compiled", "eager")):
        trainer = fit(kind, steps=8, resume=saved[other])
        state = full_state(trainer)
        if trainer.global_rank == 0:
            torch.save({"state": state, "global_step": trainer.global_step}, out / f"{name}.{kind}_from_{other}.pt")


def run_case(name: str, out: Path, start_method: str = "popen") -> None:
    spec = CASES[name] if name in CASES else COMPILED_CASES[name]
    if spec.get("interop"):
        return run_interop(name, out)
    torch._dynamo.reset()  # each case compiles afresh: its counters count its own compilations
    reset_compile_counters()
    seed_everything(0, workers=True)
    # memory logged every 2 steps (max over ranks), the cache "emptied" every 2 (a no-op on CPU, but recorded)
    monitor = MemoryMonitor(log_every_n_steps=2, empty_cache_every_n_steps=2)
    recorder = Recorder(name, out, monitor, export_peft="arch" not in spec)  # the arch cases compare weights only
    callbacks = [recorder, monitor]
    if "inject_inf_at" in spec:
        callbacks.append(InjectInf(spec["inject_inf_at"]))
    trainer_kwargs = {"use_distributed_sampler": False, **spec.get("trainer", {})}
    if "plugins" in spec:
        trainer_kwargs["plugins"] = [FSDPPlusPrecision(spec["plugins"])]
    strategy_kwargs = dict(spec["strategy"])
    if spec.get("auto"):
        strategy_kwargs["memory_budget"] = leanest_only_budget(FSDPPlusOptions(**strategy_kwargs, memory_budget=1))
    trainer = Trainer(
        strategy=FSDPPlusStrategy(**strategy_kwargs, start_method=start_method),
        accelerator="cpu",
        devices=DEVICES,  # 2 ranks: on one node, or (torchrun --nnodes 2) one per node
        num_nodes=2 // DEVICES,
        max_steps=spec.get("steps", LORA_STEPS) if "lora" in spec else STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    if "lora" in spec:
        arch = spec.get("arch", "llama")
        base = lora_model(arch) if spec["lora"] == "module" else lora_base(arch)
        data = FixedBatches(steps=spec.get("steps", LORA_STEPS))
        loader = DataLoader(data, batch_size=4, sampler=StridedSampler(len(data)))
        trainer.fit(sgd_causal_lm(base, lr=LORA_LR), loader)
    elif spec.get("user_sharded"):
        trainer.fit(UserShardedLM())
    elif "tied" in spec:
        data = FixedBatches(steps=STEPS)
        loader = DataLoader(data, batch_size=4, sampler=StridedSampler(len(data)))
        trainer.fit(sgd_causal_lm(tied_model(spec["tied"]), lr=TIED_LR), loader)
    elif spec.get("llama"):
        loader = DataLoader(TokenDataset(), batch_size=4)
        module = CausalLMModule(tiny_llama(), lr=1e-2)
        if "fit_compiled" in spec:
            module = torch.compile(module, **spec["fit_compiled"])
        trainer.fit(module, train_dataloaders=loader)
    else:
        module = TinyLM(**spec.get("module", {}))
        if spec.get("perturb_rank1") and os.environ.get("LOCAL_RANK") == "1":
            with torch.no_grad():
                for param in module.parameters():
                    param.add_(0.1)
        trainer.fit(module)
        if start_method != "popen":  # the main process received the trained weights from the workers
            torch.save(module.state_dict(), out / f"{name}.main.pt")


def leanest_only_budget(options: FSDPPlusOptions) -> int:
    """A budget (bytes) between the smallest and the next predicted peak of ``options``' candidates at 2 ranks."""
    from lightning_fsdp_plus.autoplan import predict_memory
    from lightning_fsdp_plus.memory.allocator import platform_for
    from lightning_fsdp_plus.memory.fake import ForwardBatch

    plan = predict_memory(tiny_llama(0, **LORA_LLAMA).config, options=options.replace(sharding_strategy="FULL_SHARD"),
                          world_size=2, precision="32-true", batch=ForwardBatch(4, SEQ), budget=1, margin=0.1,
                          quantize=(None, *options.allow_quantize), lora_run=True,
                          platform=platform_for("cpu"))  # fmt: skip
    lowest, second = sorted({p.peak_bytes for p in plan.predictions})[:2]
    return int((lowest + second) / 2 / (1 - options.memory_margin))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--start-method", default="popen")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    finished: dict[str, int] = {}
    # registered before any fit, so it runs after the strategy's own exit handler (atexit is last in, first out)
    atexit.register(record_exit_threads, args.out, finished)
    for name in args.cases.split(","):
        run_case(name, args.out, args.start_method)
    finished["rank"] = rank()


def record_exit_threads(out: Path, finished: dict[str, int]) -> None:
    """At exit, after the strategy's handler: the gloo threads still alive, left for interpreter teardown."""
    if "rank" in finished:  # this process trained every case
        (out / f"exit_threads.rank{finished['rank']}.json").write_text(json.dumps(gloo_threads()))


if __name__ == "__main__":
    main()
    barrier()  # ranks leave together; the process group is freed by FSDPPlusStrategy's exit handler
