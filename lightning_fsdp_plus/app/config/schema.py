"""Structured configs: the typed, documented schema of every key the ``fsdp-plus-train`` app reads.

One dataclass per concern; ``StrategySchema`` is derived from ``FSDPPlusOptions``. They are registered in
Hydra's ConfigStore (``config.store``) as the base of the YAML presets in ``conf/``, so a typo
(``strategy.nosuchkey=1``) or a wrong type (``strategy.cpu_offload=maybe``) fails at compose time with the full
key path, and enum-like fields list their choices. The defaults here (and the options') are the app's only ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

from lightning_fsdp_plus.app.data import DATA_FIELDS
from lightning_fsdp_plus.lora import DEFAULT_TARGETS
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import AUTO, ShardingStrategy, _CaseInsensitiveNames

# OmegaConf reads these annotations at runtime (X | None and builtin generics resolve on Python >= 3.10).


@dataclass
class LoraSchema:
    """PEFT LoRA settings (``peft.LoraConfig``) the strategy applies before sharding."""

    r: int = 8
    """Rank of the low-rank update."""
    alpha: int = 16
    """Scaling numerator (``lora_alpha``): the update is scaled by ``alpha / r``."""
    dropout: float = 0.05
    """Dropout on the LoRA input (``lora_dropout``)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Names of the linear layers to adapt (the last component of their module path)."""
    bias: str = "none"
    """Which biases train: ``none``, ``all`` or ``lora_only`` (PEFT's)."""


class StrategyChoice(str, Enum, metaclass=_CaseInsensitiveNames):
    """``strategy.sharding_strategy`` in configs: a :class:`ShardingStrategy` name or ``auto`` (any case), so that a
    typo fails at compose time with the choices listed."""

    FULL_SHARD = ShardingStrategy.FULL_SHARD.value
    SHARD_GRAD_OP = ShardingStrategy.SHARD_GRAD_OP.value
    NO_SHARD = ShardingStrategy.NO_SHARD.value
    HYBRID_SHARD = ShardingStrategy.HYBRID_SHARD.value
    AUTO = AUTO


def _hydra_field(item: dataclasses.Field) -> tuple[str, Any, Any]:
    """One options field as an OmegaConf-typed field: primitives (optional or not) keep their type, enums too,
    tuples become lists, literals strings, ``lora`` the typed LoRA schema, a ``timedelta`` default its seconds;
    anything richer (policies, modules, callables) is ``Any``."""
    annotation = str(item.type).replace(" ", "")
    primitive = {"bool": bool, "int": int, "float": float, "str": str}
    base, optional = annotation.removesuffix("|None"), annotation.endswith("|None")
    default = item.default
    if item.name == "lora":
        kind: Any = LoraSchema | None
    elif isinstance(default, timedelta):
        kind, default = float | None, default.total_seconds()
    elif base in primitive:
        kind = primitive[base] | None if optional else primitive[base]
    elif base == ShardingStrategy.__name__:
        kind, default = StrategyChoice, StrategyChoice[default.name]
    elif base.startswith("Literal["):
        kind = str | None if optional else str
    elif base.startswith("tuple[str"):
        return item.name, list[str], field(default_factory=lambda: list(item.default))
    else:
        kind = Any
    return item.name, kind, field(default=default)


StrategySchema = dataclasses.make_dataclass(
    "StrategySchema",
    [("_target_", str, field(default="lightning_fsdp_plus.FSDPPlusStrategy")),
     *(_hydra_field(f) for f in dataclasses.fields(FSDPPlusOptions))],
)  # fmt: skip
StrategySchema.__module__ = __name__
StrategySchema.__doc__ = """``FSDPPlusStrategy``'s arguments, derived field by field from
:class:`~lightning_fsdp_plus.options.FSDPPlusOptions` (whose docstrings describe each), plus ``_target_``."""


@dataclass
class PrecisionSchema:
    """Numeric precision: one of Lightning's presets, mapped onto FSDP2 by the strategy."""

    name: str = "32-true"
    """32-true, bf16-mixed, bf16-true, 16-mixed or 16-true."""


@dataclass
class ModelSchema:
    """The LightningModule: a transformers causal LM wrapped in ``CausalLMModule``, or any ``_target_``."""

    name_or_path: str | None = None
    """A local directory with config.json (and weights), or a Hugging Face model id (cached or downloadable)."""
    config: dict[str, Any] | None = None
    """Build from scratch from transformers config kwargs (with ``model_type``) instead of loading weights."""
    torch_dtype: str | None = None
    """dtype to load weights in (e.g. bfloat16); null keeps the checkpoint's."""
    low_memory_load: bool = True
    """Build the model on the meta device and let each rank read only its own shards from the safetensors files
    after sharding (int8 quantized while loading); false: ``from_pretrained`` in every rank, which holds the whole
    model per process while loading (needed for ``pytorch_model.bin`` checkpoints)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    chunked_loss: bool = True
    """Compute the loss chunk by chunk inside the output head's call (``lightning_fsdp_plus.loss``): the batch's
    float32 logits never exist (2.1 GB at 2 x 2048 tokens of a 128k vocabulary). false: the model's own loss."""
    _target_: str | None = None
    """A LightningModule class or factory to instantiate with ``kwargs`` instead of the above."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``_target_``."""


@dataclass
class SyntheticDataSchema:
    """In-memory arithmetic sequences (``lightning_fsdp_plus.app.data.SyntheticLMDataModule``)."""

    _target_: str = "lightning_fsdp_plus.app.data.SyntheticLMDataModule"
    """The LightningDataModule class."""
    batch_size: int = 8
    """Sequences per rank per forward (the micro-batch)."""
    seq_len: int = 32
    """Tokens per sequence."""
    vocab_size: int = 128
    """Token ids are drawn below this (synthetic data)."""
    train_size: int = 2048
    """Training sequences."""
    val_size: int = 128
    """Held-out sequences."""
    num_workers: int = 0
    """DataLoader workers per rank."""
    seed: int = 1
    """Seed of the synthetic sequences."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over every rank and accumulation step (null: batch_size x ranks x
    trainer.accumulate_grad_batches). The run keeps it on any number of ranks, accumulating what fewer ranks cannot
    hold; a resume keeps its checkpoint's unless this is set."""


@dataclass
class InstructionDataSchema:
    """Instruction datasets (``lightning_fsdp_plus.app.data.InstructionDataModule``)."""

    _target_: str = "lightning_fsdp_plus.app.data.InstructionDataModule"
    """The LightningDataModule class."""
    tokenizer: str | None = "${model.name_or_path}"
    """Tokenizer directory or hub id; the model's by default; null (a model built from a config, the default
    tiny Llama): a byte-level tokenizer built in code (258 tokens), to which the model's vocabulary is sized."""
    train_files: list[str] | None = None
    """Local JSONL/JSON/CSV/Parquet training files: {instruction, input?, response} records, or chats
    {messages: [{role, content}, ...]} (rendered with the tokenizer's chat template where it has one)."""
    val_files: list[str] | None = None
    """Local held-out files."""
    dataset_name: str | None = None
    """A Hugging Face ``datasets`` dataset in the local cache, used instead of files."""
    train_split: str = "train"
    """Training split of dataset_name."""
    val_split: str = "validation"
    """Held-out split of dataset_name."""
    batch_size: int = 8
    """Examples per rank per forward (the micro-batch)."""
    max_seq_len: int = 256
    """Truncation length of an example, and the row length when packing."""
    mask_prompt: bool = True
    """Leave prompt tokens out of the loss."""
    pack: bool = False
    """Pack whole training examples into rows of max_seq_len tokens (best-fit decreasing, made once from the seed;
    positions restart per example, no attention or loss across examples); batch sizes then count rows. Validation
    stays one example per row."""
    columns: dict[str, str] = field(default_factory=lambda: {f: f for f in DATA_FIELDS})
    """The files' name for each of our fields (instruction, input, response, messages), e.g. response: output for
    Alpaca files (instruction, input, output), messages: conversations for ShareGPT files ({from, value} turns
    are read as {role, content}); a misspelt field is an error."""
    num_workers: int = 0
    """DataLoader workers per rank."""
    global_batch_size: int | None = None
    """Examples per optimizer step over every rank and accumulation step (null: batch_size x ranks x
    trainer.accumulate_grad_batches). The run keeps it on any number of ranks, accumulating what fewer ranks cannot
    hold; a resume keeps its checkpoint's unless this is set."""


@dataclass
class GenerateSchema:
    """Greedy generation from the sharded model after training (instruction data only)."""

    num_prompts: int = 4
    """Held-out prompts to answer (0: none); answers go to generations.jsonl in the run directory."""
    max_new_tokens: int = 48
    """Tokens generated per answer at most."""
    questions: str | None = None
    """A JSONL file of held-out questions (``{question, answers?}`` rows) to ask instead of the validation set's
    first examples; a LoRA run answers each with its adapter disabled too (the base's answer), side by side."""


@dataclass
class TrainerSchema:
    """``lightning.Trainer`` arguments the app passes through (strategy, precision, callbacks and logger aside)."""

    accelerator: str = "cpu"
    """cpu, gpu/cuda or auto."""
    devices: Any = 2
    """Processes per node: a positive integer, a list of device indices, or "auto"."""
    num_nodes: int = 1
    """Nodes (SLURM / torchelastic provide the rest)."""
    max_steps: int = 60
    """Optimizer steps (-1: use max_epochs)."""
    max_epochs: int | None = None
    """Epochs when max_steps is -1."""
    val_check_interval: Any | None = None
    """Validate (and save the "last" checkpoint) every N optimizer steps counted across epochs (int), or at a
    fraction of each epoch (float); null: every max_steps / 4 steps (a small dataset's every epoch would be every
    step)."""
    limit_val_batches: Any | None = None
    """Cap on validation batches."""
    gradient_clip_val: float | None = 1.0
    """Clip threshold (null: no clipping)."""
    gradient_clip_algorithm: str = "norm"
    """norm (global across shards) or value."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    log_every_n_steps: int = 10
    """Logging interval."""
    enable_progress_bar: bool = True
    """Show the progress bar."""
    enable_model_summary: bool = False
    """Print Lightning's model summary."""
    deterministic: bool = False
    """torch deterministic algorithms."""


@dataclass
class CheckpointSchema:
    """When the run saves its "last" checkpoint (the default callbacks' ``ModelCheckpoint``)."""

    every_n_train_steps: int | None = None
    """Save every N optimizer steps; null: after each validation (every ``trainer.val_check_interval`` steps)."""


@dataclass
class RunSchema:
    """The whole run: everything ``fsdp-plus-train`` composes."""

    strategy: StrategySchema = field(default_factory=StrategySchema)
    """FSDPPlusStrategy arguments."""
    precision: PrecisionSchema = field(default_factory=PrecisionSchema)
    """Precision preset."""
    model: ModelSchema = field(default_factory=ModelSchema)
    """The model."""
    data: Any = None
    """The data module node; each data/ preset takes its schema from the ConfigStore group data_schema."""
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    """Trainer arguments."""
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    """Checkpoint interval (read by ``callbacks.model_checkpoint``)."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Lightning callbacks by name, each a ``_target_`` node (null entries are skipped)."""
    logger: dict[str, Any] = field(default_factory=dict)
    """Lightning loggers by name, each a ``_target_`` node (null entries are skipped)."""
    task_name: str = "train"
    """Name of the run; outputs go under outputs/<task_name>/."""
    seed: int = 0
    """Global seed (Lightning's seed_everything)."""
    ckpt_path: str | None = None
    """Resume training: ``last`` (the newest "last" checkpoint in this run directory's checkpoints/, e.g. the one a
    preempted run saved; rerun with the same ``hydra.run.dir``) or a checkpoint path."""
    train: bool = True
    """false: evaluate only — validate on the held-out data (the model from ``ckpt_path`` when given, e.g.
    ``last`` of this run directory or another run's checkpoint), write metrics.json (and generations); no training."""
    validate_before: bool = True
    """Validate once before training (the 'before' perplexity)."""
    warmup_steps_for_timing: int = 2
    """Steps left out of the step-time median."""
    export_adapter: bool = True
    """Save the LoRA adapter in PEFT format to <run dir>/adapter when the model has one."""
    generate: GenerateSchema = field(default_factory=GenerateSchema)
    """Generation after training."""
