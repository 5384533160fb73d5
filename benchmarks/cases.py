"""Benchmark cases: one model, one data stream, many ways to train it.

Every case trains a transformers Llama (or GPT-2) built from a config (no download) with AdamW on the same
random token batches and returns this rank's measurements (``StepClock.summary`` + memory), or
``{"refused": "<message>"}`` when the framework refuses the setting (Lightning's FSDP on CPU).

* ``fsdp_plus_<strategy>``: ``Trainer(strategy=FSDPPlusStrategy(sharding_strategy=...))``;
* ``fsdp2_loop_<strategy>``: the same sharding written by hand — ``fully_shard`` per decoder layer and
  the root (FSDP2's default for it), a plain PyTorch loop, no Lightning;
* ``lightning_model_parallel_<strategy>``: Lightning's ``ModelParallelStrategy`` with the same ``fully_shard``
  calls in ``configure_model`` — with the loop, the two references fsdp_plus is measured against;
* ``gpt_<one of those three>_full_shard``: the same on a small GPT (GPT-2, 4 layers, 256 wide, 50257-token
  vocabulary, 8 x 128 tokens per rank, 4 x 128 with ``--quick``), whose tied embedding makes the root unit most of
  the model;
* ``plain_gpt_<one of those three>_full_shard``: the same on issue 31's hand-written GPT (``plain_gpt.py``: no
  transformers, 2048-token vocabulary, 8 x 128 tokens per rank); ``plain_gpt_lightning_model_parallel_default_mesh``
  is ``ModelParallelStrategy()`` with its default sizes — ``data_parallel_size`` = nodes (1), tensor-parallel =
  devices — and the ``fully_shard`` calls on its ``data_parallel`` mesh: a mesh of one rank, so nothing is
  sharded and nothing communicated (every rank trains a whole copy). It is shown, never used as a reference: that
  mesh was the "1.3x faster" ``ModelParallelStrategy`` of issue 31;
* ``lightning_ddp``, ``lightning_fsdp``: Lightning's DDP and FSDP1 strategies;
* ``lora_{int8,nf4,bf16}_{replicated,sharded}``: LoRA r=16 on all projections over an int8, NF4 or bf16 base,
  base replicated (``lora_only=True``) or sharded, in ``bf16-true``; ``lora_int8_replicated_per_layer``
  makes every LoRA-wrapped linear layer its own FSDP unit (rather than every decoder layer).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PretrainedConfig

from benchmarks.harness import (
    CommCounter,
    LightningRecorder,
    LoopMemory,
    PythonAllReduce,
    StepClock,
    all_gathers_by_kind,
)
from benchmarks.plain_gpt import PlainGPT, PlainGPTConfig
from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.app.lm import CausalLMModule
from lightning_fsdp_plus.memory import SavedActivations
from lightning_fsdp_plus.plan import MeshLayout, ShardingStrategy, resolve_mesh_layout
from lightning_fsdp_plus.policies import select_unit_paths
from lightning_fsdp_plus.sharding import init_mesh

LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip
SIZES = {
    "full": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "vocab_size": 1024, "seq": 128},
    "quick": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "vocab_size": 512, "seq": 64},
    # GPT-2's vocabulary and tied embedding on a 4-layer 256-wide body: the root unit (embedding = lm_head, 12.9M
    # of 16M parameters) dominates, so what happens to it between forward and backward shows
    "gpt": {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 50257, "seq": 128},
    # issue 31's hand-written GPT: no transformers, an untied 2048-token head
    "plain_gpt": {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 2048, "seq": 128},
    # issue 32's Llamas at sizes nearer our users' (benchmarks.autoplan --size): 1024 wide, MLP 4096, 16 heads
    "135m": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 16, "vocab_size": 512, "seq": 64},
    "400m": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "vocab_size": 512, "seq": 64},
    # issue 33: the width at which CPU inductor's fusion shows (elementwise work and Python a larger share of a step)
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "vocab_size": 2048, "seq": 128},
}  # fmt: skip
LLAMA_SIZES = ("quick", "small", "full", "135m", "400m")
"""The ``SIZES`` that are Llamas (``benchmarks.run --size``)."""
GPT_BATCH_SIZE = 8
"""Sequences per rank and step of the small GPT (half with ``--quick``)."""
LR = 1e-4
CLIP = 1.0
LOG_DIR = str(Path(tempfile.gettempdir()) / "fsdp_plus_benchmark_logs")
"""Where Lightning's default logger writes (not the working directory)."""
"""``gradient_clip_val`` (norm) of every case, as users run: Lightning's cases clip through their strategy, the
hand-written loop with ``torch.nn.utils.clip_grad_norm_``."""


@dataclass
class Setting:
    """What every case shares: model size, batch, steps, devices."""

    size: dict[str, int]
    batch_size: int
    warmup: int
    steps: int
    world_size: int
    accelerator: str = "cpu"
    hybrid_shard_size: int = 1
    profile_steps: int = 0
    """Steps after warm-up run under ``torch.profiler`` (before the measured ones)."""
    clip: float = CLIP
    """``gradient_clip_val`` (norm) of every case; 0: no clipping."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        """Warm-up, profiled and measured steps."""
        return self.warmup + self.profile_steps + self.steps

    @property
    def is_gpt(self) -> bool:
        """True for the small GPT (GPT-2 architecture), else a Llama."""
        return self.size is SIZES["gpt"]

    @property
    def is_plain_gpt(self) -> bool:
        """True for issue 31's hand-written GPT."""
        return self.size is SIZES["plain_gpt"]

    def config(self) -> PretrainedConfig | PlainGPTConfig:
        """The Llama, GPT-2 or plain GPT config (no download; no dropout, so every case computes the same)."""
        size = self.size
        if self.is_plain_gpt:
            return PlainGPTConfig(vocab_size=size["vocab_size"], hidden_size=size["hidden_size"],
                                  num_hidden_layers=size["num_hidden_layers"])  # fmt: skip
        if self.is_gpt:
            return GPT2Config(n_embd=size["hidden_size"], n_layer=size["num_hidden_layers"], n_head=4,
                              n_positions=size["seq"], vocab_size=size["vocab_size"], resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return LlamaConfig(max_position_embeddings=size["seq"], **{"num_attention_heads": 8, "num_key_value_heads": 4}
                           | {k: v for k, v in size.items() if k != "seq"})  # fmt: skip

    def gpt(self) -> Setting:
        """The same run on the small GPT: 2 warm-up steps and at most 10 measured ones (a step takes seconds on
        CPU); from the ``quick`` size, half the batch and at most 6 steps."""
        quick = self.size is SIZES["quick"]
        return replace(self, size=SIZES["gpt"], batch_size=GPT_BATCH_SIZE // (2 if quick else 1), warmup=2,
                       steps=min(self.steps, 6 if quick else 10))  # fmt: skip

    def plain_gpt(self) -> Setting:
        """The same run on issue 31's plain GPT, 8 x 128 tokens per rank (4 x 128 from the ``quick`` size)."""
        quick = self.size is SIZES["quick"]
        return replace(self, size=SIZES["plain_gpt"], batch_size=GPT_BATCH_SIZE // (2 if quick else 1))

    def loader(self) -> DataLoader:
        """This rank's batches (every rank its own slice of the same stream)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        n = self.total_steps * self.batch_size
        return DataLoader(RandomTokens(n=n, seq=self.size["seq"], vocab=self.size["vocab_size"], seed=rank),
                          batch_size=self.batch_size)  # fmt: skip

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        if self.accelerator == "gpu":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class RandomTokens(Dataset):
    """Fixed random token sequences."""

    def __init__(self, *, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def _model(setting: Setting) -> LlamaForCausalLM | GPT2LMHeadModel | PlainGPT:
    seed_everything(0, verbose=False)
    if setting.is_plain_gpt:
        return PlainGPT(setting.config())
    return (GPT2LMHeadModel if setting.is_gpt else LlamaForCausalLM)(setting.config())


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers a hand-written ``fully_shard`` loop shards one by one (Llama's, GPT-2's, the plain GPT's)."""
    if isinstance(model, PlainGPT):
        return model.blocks
    return model.transformer.h if isinstance(model, GPT2LMHeadModel) else model.model.layers


def _trainer(
    setting: Setting, strategy: Any, recorder: LightningRecorder, precision: str = "32-true", callbacks: tuple = ()
) -> Trainer:
    return Trainer(
        strategy=strategy,
        accelerator=setting.accelerator,
        devices=setting.world_size,
        precision=precision,
        max_steps=setting.total_steps,
        gradient_clip_val=setting.clip or None,
        default_root_dir=LOG_DIR,  # Lightning's default logger (TensorBoard, else CSV) and logging, as users run
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder, recorder.monitor, *callbacks],
    )


def _fit(
    setting: Setting, strategy: Any, module: Any, *, precision: str = "32-true", callbacks: tuple = ()
) -> dict[str, Any]:
    counter, base = CommCounter(), BaseLinears()
    recorder = LightningRecorder(warmup=setting.warmup, counter=counter, profile_steps=setting.profile_steps)
    try:
        trainer = _trainer(setting, strategy, recorder, precision, (*callbacks, base))
    except (ValueError, RuntimeError) as err:  # the framework refuses this setting here
        return {"refused": f"{type(err).__name__}: {err}"}
    with counter.installed(), all_gathers_by_kind(counter, base.kind):
        trainer.fit(module, setting.loader())
    return {**recorder.clock.summary(), **recorder.memory(), **_preemption_check(strategy)}


def _preemption_check(strategy: Any) -> dict[str, float]:
    """fsdp_plus: the mean time of its per-step preemption agreement (one all-reduce of one integer)."""
    agreement = getattr(strategy, "preemption", None) if isinstance(strategy, FSDPPlusStrategy) else None
    if agreement is None or not agreement.agree_calls:
        return {}
    return {"preempt_check_s": agreement.agree_seconds / agreement.agree_calls}


class BaseLinears(Callback):
    """Knows, once the strategy has prepared the model, which modules are the frozen base's linear layers
    (what ``quantize_base`` converts; ``lm_head`` is skipped as by default) to label their all-gathers."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def on_fit_start(self, trainer: Trainer, module: torch.nn.Module) -> None:
        from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear, int8_candidates

        self.ids = {id(module.get_submodule(path)) for path in int8_candidates(module)}
        self.ids |= {id(m) for m in module.modules() if isinstance(m, (Int8Linear, FourBitLinear))}

    def kind(self, module: torch.nn.Module, name: str) -> str:
        """``base_linear`` or ``other``."""
        return "base_linear" if id(module) in self.ids else "other"


def fsdp_plus(
    setting: Setting, sharding_strategy: str, *, callbacks: tuple = (), **strategy_kwargs: Any
) -> dict[str, Any]:
    """``Trainer(strategy=FSDPPlusStrategy(...))``, fp32 unless the kwargs say otherwise. With ``compile``, each case
    compiles afresh (dynamo's in-process cache is reset; inductor's on-disk cache stays warm)."""
    precision = strategy_kwargs.pop("precision", "32-true")
    if sharding_strategy == "HYBRID_SHARD":
        strategy_kwargs["hybrid_shard_size"] = setting.hybrid_shard_size
    if strategy_kwargs.get("compile"):
        torch._dynamo.reset()
    module = CausalLMModule(_model(setting), lr=LR)
    # the hand-written loops shard the blocks and the root: the same units here, so the cases compare the same
    # sharding (the default auto layout also makes the embeddings and head units of their own)
    blocks = {type(module.model.get_submodule(p)) for p in select_unit_paths(module.model, "auto")}
    strategy_kwargs.setdefault("auto_wrap_policy", sorted(blocks, key=lambda c: c.__name__))
    strategy = FSDPPlusStrategy(sharding_strategy=sharding_strategy, **strategy_kwargs)
    return _fit(setting, strategy, module, precision=precision, callbacks=callbacks)


class CompileRootParts(Callback):
    """After sharding: the root's own parts compiled by hand too (the final norm and the loss function), to measure
    whether compiling more than the blocks pays."""

    def on_fit_start(self, trainer: Trainer, module: torch.nn.Module) -> None:
        model = module.model
        norm = model.model.norm
        norm.forward = torch.compile(norm.forward)
        model.loss_function = torch.compile(model.loss_function)


def fsdp_plus_compiled(
    setting: Setting, sharding_strategy: str, *, root: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """fsdp_plus with ``compile=True`` (each decoder layer, inductor); ``root``: the root's norm and loss as well."""
    callbacks = (CompileRootParts(),) if root else ()
    return fsdp_plus(setting, sharding_strategy, compile=True, callbacks=callbacks, **kwargs)


def fsdp2_loop(
    setting: Setting, sharding_strategy: str, *, precision: str = "32-true", compiled: bool = False
) -> dict[str, Any]:
    """The same model and sharding with torch only: ``fully_shard`` per decoder layer and the root. ``bf16-mixed``:
    bf16 parameters in compute, fp32 gradient reduction (``MixedPrecisionPolicy``) and bf16 autocast, as
    ``FSDPPlusPrecision`` runs it; ``compiled``: each block compiled by hand first, torchtitan's way."""
    strategy = ShardingStrategy.parse(sharding_strategy)
    layout = resolve_mesh_layout(
        sharding_strategy=strategy, world_size=setting.world_size, hybrid_shard_size=setting.hybrid_shard_size
    )
    device = setting.device
    mesh = init_mesh(layout=layout, device_type=device.type)  # torch's init_device_mesh, 1-D or 2-D
    model = _model(setting).to(device)
    if compiled:
        torch._dynamo.reset()
        compile_by_hand(model)
    mixed = precision == "bf16-mixed"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    shard_by_hand(model, mesh=mesh, strategy=strategy, mp_policy=policy)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed, cache_enabled=False)  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.95))
    counter = CommCounter()
    clock = StepClock(warmup=setting.warmup, counter=counter, profile_steps=setting.profile_steps)
    memory = LoopMemory(model, optimizer, device)
    with counter.installed():
        for batch in setting.loader():
            batch = batch.to(device)
            clock.mark("start")
            with SavedActivations() as saved, autocast():
                loss = model(input_ids=batch, labels=batch).loss
            clock.mark("forward")
            memory.sample(saved.bytes)
            loss.backward()
            clock.mark("backward")
            memory.sample()
            clock.mark("optimizer_start")
            if setting.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
            optimizer.step()
            optimizer.zero_grad()
            clock.end(batch.numel())
            memory.sample()
    return {**clock.summary(), **memory.memory()}


def shard_by_hand(
    model: torch.nn.Module, *, mesh: DeviceMesh, strategy: ShardingStrategy, mp_policy: Any = None
) -> None:
    """The ``fully_shard`` calls a user writes: each decoder layer as the strategy says, then the root with
    FSDP2's default (kept unsharded from forward to backward)."""
    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in blocks(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward, **policy)
    fully_shard(model, mesh=mesh, **policy)


def compile_by_hand(model: torch.nn.Module) -> None:
    """torchtitan's ``apply_compile``: each block replaced by ``torch.compile(block)`` (inductor), before
    ``fully_shard`` (which then wraps the compiled module)."""
    layers = blocks(model)
    for name, block in list(layers.named_children()):
        layers.register_module(name, torch.compile(block))


class _UserShardedLM(CausalLMModule):
    """What a ``ModelParallelStrategy`` user writes: the ``fully_shard`` calls in ``configure_model`` (on
    Lightning's 1-D data-parallel mesh, or their own 2-D mesh where the strategy replicates)."""

    def __init__(self, *args: Any, sharding: ShardingStrategy, layout: MeshLayout, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharding, self.layout = sharding, layout

    def configure_model(self) -> None:
        if self.layout.two_d:
            mesh = init_mesh(layout=self.layout, device_type=self.device_mesh.device_type)
        else:
            mesh = self.device_mesh["data_parallel"]
        shard_by_hand(self.model, mesh=mesh, strategy=self.sharding)


def lightning_ddp(setting: Setting) -> dict[str, Any]:
    """Lightning's ``DDPStrategy``; its all-reduce goes through torch's Python default hook to be counted."""
    return _fit(setting, "ddp", CausalLMModule(_model(setting), lr=LR), callbacks=(PythonAllReduce(),))


def lightning_fsdp(setting: Setting) -> dict[str, Any]:
    """Lightning's ``FSDPStrategy`` (FSDP1), decoder layers wrapped; it refuses CPU."""
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
    return _fit(setting, strategy, CausalLMModule(_model(setting), lr=LR))


def lightning_model_parallel(setting: Setting, sharding_strategy: str) -> dict[str, Any]:
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with user-written ``fully_shard`` calls for the strategy."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    sharding = ShardingStrategy.parse(sharding_strategy)
    layout = resolve_mesh_layout(
        sharding_strategy=sharding, world_size=setting.world_size, hybrid_shard_size=setting.hybrid_shard_size
    )
    strategy = ModelParallelStrategy(data_parallel_size=setting.world_size, tensor_parallel_size=1)
    return _fit(setting, strategy, _UserShardedLM(_model(setting), lr=LR, sharding=sharding, layout=layout))


class _DefaultMeshLM(CausalLMModule):
    """``fully_shard`` on ``self.device_mesh["data_parallel"]``, as Lightning's FSDP2 examples write it."""

    def configure_model(self) -> None:
        shard_by_hand(self.model, mesh=self.device_mesh["data_parallel"], strategy=ShardingStrategy.FULL_SHARD)


def lightning_model_parallel_default_mesh(setting: Setting) -> dict[str, Any]:
    """``ModelParallelStrategy()`` with its default sizes: on one node its data-parallel mesh has one rank, so the
    ``fully_shard`` calls shard nothing (``sharded_ranks`` says so). Not a reference."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = _DefaultMeshLM(_model(setting), lr=LR)
    result = _fit(setting, ModelParallelStrategy(), module)
    return {**result, "sharded_over_ranks": next(module.model.parameters()).device_mesh.size()}


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def lora(
    setting: Setting, *, base: str, lora_only: bool, per_layer_units: bool = False, compile: bool = False
) -> dict[str, Any]:
    """LoRA on an int8, NF4 or bf16 base, replicated or sharded, ``bf16-true``; units per decoder layer, or
    per LoRA-wrapped linear layer; ``compile``: each unit compiled (inductor)."""
    kwargs: dict[str, Any] = {"lora": LORA, "lora_only": lora_only, "precision": "bf16-true", "compile": compile}
    if per_layer_units:
        kwargs["auto_wrap_policy"] = _is_lora_layer
    if base in ("int8", "nf4"):
        kwargs["quantize_base"] = base
    return fsdp_plus(setting, "FULL_SHARD", **kwargs)


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def _bind(fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> Callable[[Setting], dict[str, Any]]:
    return lambda setting: fn(setting, *args, **kwargs)


def _on_gpt(case: Callable[[Setting], dict[str, Any]]) -> Callable[[Setting], dict[str, Any]]:
    return lambda setting: case(setting.gpt())


def _on_plain_gpt(case: Callable[[Setting], dict[str, Any]]) -> Callable[[Setting], dict[str, Any]]:
    return lambda setting: case(setting.plain_gpt())


REFERENCES = ("fsdp2_loop", "lightning_model_parallel")
"""The hand-written FSDP2 runs every ``fsdp_plus_<strategy>`` case is compared with (the faster of the two)."""

_FSDP2 = {"fsdp_plus": fsdp_plus, "fsdp2_loop": fsdp2_loop, "lightning_model_parallel": lightning_model_parallel}

CASES: dict[str, Callable[[Setting], dict[str, Any]]] = {
    # fsdp_plus and its references side by side, strategy by strategy: machine drift touches what is compared alike
    **{f"{kind}_{s.lower()}": _bind(fn, s) for s in STRATEGIES for kind, fn in _FSDP2.items()},
    # the small GPT, FULL_SHARD: fsdp_plus and both references
    **{f"gpt_{kind}_full_shard": _on_gpt(_bind(fn, "FULL_SHARD")) for kind, fn in _FSDP2.items()},
    # issue 31's plain GPT, FULL_SHARD: fsdp_plus, both references, and ModelParallelStrategy's default mesh
    **{f"plain_gpt_{kind}_full_shard": _on_plain_gpt(_bind(fn, "FULL_SHARD")) for kind, fn in _FSDP2.items()},
    "plain_gpt_lightning_model_parallel_default_mesh": _on_plain_gpt(lightning_model_parallel_default_mesh),
    "lightning_ddp": lightning_ddp,
    "lightning_fsdp": lightning_fsdp,
    "lora_int8_replicated": _bind(lora, base="int8", lora_only=True),
    "lora_int8_replicated_per_layer": _bind(lora, base="int8", lora_only=True, per_layer_units=True),
    "lora_int8_sharded": _bind(lora, base="int8", lora_only=False),
    "lora_nf4_replicated": _bind(lora, base="nf4", lora_only=True),
    "lora_nf4_sharded": _bind(lora, base="nf4", lora_only=False),
    "lora_bf16_replicated": _bind(lora, base="bf16", lora_only=True),
    "lora_bf16_sharded": _bind(lora, base="bf16", lora_only=False),
    # issue 33: compile. fp32 and bf16-mixed, FULL_SHARD: fsdp_plus compile=True against the eager references and a
    # hand-compiled loop (torchtitan's way); the root's parts compiled too; LoRA on int8 / NF4 bases compiled
    "compiled_fsdp_plus_full_shard": _bind(fsdp_plus_compiled, "FULL_SHARD"),
    "compiled_fsdp2_loop_full_shard": _bind(fsdp2_loop, "FULL_SHARD", compiled=True),
    "compiled_root_fsdp_plus_full_shard": _bind(fsdp_plus_compiled, "FULL_SHARD", root=True),
    "bf16_fsdp_plus_full_shard": _bind(fsdp_plus, "FULL_SHARD", precision="bf16-mixed"),
    "bf16_fsdp2_loop_full_shard": _bind(fsdp2_loop, "FULL_SHARD", precision="bf16-mixed"),
    "compiled_bf16_fsdp_plus_full_shard": _bind(fsdp_plus_compiled, "FULL_SHARD", precision="bf16-mixed"),
    "compiled_bf16_fsdp2_loop_full_shard": _bind(fsdp2_loop, "FULL_SHARD", precision="bf16-mixed", compiled=True),
    "compiled_lora_int8_replicated": _bind(lora, base="int8", lora_only=True, compile=True),
    "compiled_lora_int8_sharded": _bind(lora, base="int8", lora_only=False, compile=True),
    "compiled_lora_nf4_replicated": _bind(lora, base="nf4", lora_only=True, compile=True),
}
"""Every case by name, in the order a repetition runs them."""
