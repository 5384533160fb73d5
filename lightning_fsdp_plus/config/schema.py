"""Structured configs: the typed, documented schema of every key the ``fsdp-plus-train`` app reads.

One dataclass per concern. They are registered in Hydra's ConfigStore (``config.store``) as the base of
the YAML presets in ``conf/``, so a typo (``strategy.nosuchkey=1``) or a wrong type
(``strategy.cpu_offload=maybe``) fails at compose time with the full key path, and enum-like fields list
their choices. The defaults here are the single source of every default of the app.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_fsdp_plus.plan import ShardingStrategy

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
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers to adapt (the last component of their module path)."""
    bias: str = "none"
    """Which biases train: ``none``, ``all`` or ``lora_only`` (PEFT's)."""


@dataclass
class StrategySchema:
    """Every ``FSDPPlusStrategy`` argument (see its docstring for the full meaning)."""

    _target_: str = "lightning_fsdp_plus.FSDPPlusStrategy"
    """The strategy class Hydra instantiates."""
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    hybrid_shard_size: int | None = None
    """Ranks per shard group for HYBRID_SHARD (default: devices per node); must divide the world size."""
    auto_wrap_policy: Any = "auto"
    """"auto", a list of module class names, {min_num_params: N}, or null (root only)."""
    mixed_precision: dict[str, Any] | None = None
    """Explicit FSDP2 MixedPrecisionPolicy {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}."""
    activation_checkpointing: list[str] | None = None
    """Module class names whose forward is recomputed in backward."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy (GPU runs)."""
    forward_prefetch: bool = False
    """Explicitly prefetch the next unit's all-gather."""
    lora_only: bool = False
    """Shard only trainable (LoRA) parameters; replicate the frozen base."""
    lora: LoraSchema | None = None
    """LoRA to apply (null: none, or the LightningModule applies PEFT itself)."""
    quantize_base: str | None = None
    """null or "int8" (frozen linear layers become LLM.int8 layers)."""
    quantize_skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Layer names or fnmatch path patterns left unquantized."""
    int8_threshold: float = 6.0
    """LLM.int8 outlier threshold."""
    state_dict_type: str = "sharded"
    """Checkpoint format: sharded (torch.distributed.checkpoint directory) or full (one file from rank 0)."""
    save_trainable_only: bool | None = None
    """Leave frozen parameters out of checkpoints (null: when frozen parameters exist)."""
    use_orig_params: bool = True
    """Must be true (FSDP2 always keeps original parameters)."""
    log_grad_norm: bool = True
    """Log the pre-clip global gradient norm as grad_norm."""
    start_method: str = "popen"
    """popen (re-run the script per rank), spawn, fork or forkserver."""
    process_group_backend: str | None = None
    """nccl on CUDA, gloo on CPU when null."""


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
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    _target_: str | None = None
    """A LightningModule class or factory to instantiate with ``kwargs`` instead of the above."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``_target_``."""


@dataclass
class SyntheticDataSchema:
    """In-memory arithmetic sequences (``lightning_fsdp_plus.data.SyntheticLMDataModule``)."""

    _target_: str = "lightning_fsdp_plus.data.SyntheticLMDataModule"
    """The LightningDataModule class."""
    batch_size: int = 8
    """Sequences per rank per step."""
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


@dataclass
class InstructionDataSchema:
    """Instruction datasets (``lightning_fsdp_plus.data.InstructionDataModule``)."""

    _target_: str = "lightning_fsdp_plus.data.InstructionDataModule"
    """The LightningDataModule class."""
    tokenizer: str = "${model.name_or_path}"
    """Tokenizer directory or hub id; the model's by default."""
    train_files: list[str] | None = None
    """Local JSONL/JSON/CSV/Parquet training files ({instruction, input?, response} records)."""
    val_files: list[str] | None = None
    """Local held-out files."""
    dataset_name: str | None = None
    """A Hugging Face ``datasets`` dataset in the local cache, used instead of files."""
    train_split: str = "train"
    """Training split of dataset_name."""
    val_split: str = "validation"
    """Held-out split of dataset_name."""
    batch_size: int = 8
    """Sequences per rank per step."""
    max_seq_len: int = 256
    """Truncation length, or the block length when packing."""
    mask_prompt: bool = True
    """Leave prompt tokens out of the loss."""
    pack: bool = False
    """Pack training examples into max_seq_len blocks."""
    num_workers: int = 0
    """DataLoader workers per rank."""


@dataclass
class GenerateSchema:
    """Greedy generation from the sharded model after training (instruction data only)."""

    num_prompts: int = 4
    """Held-out prompts to answer (0: none); answers go to generations.jsonl in the run directory."""
    max_new_tokens: int = 48
    """Tokens generated per answer at most."""


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
    """Validate every N steps (int) or fraction of an epoch (float); null: end of epoch / run."""
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
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Lightning callbacks by name, each a ``_target_`` node (null entries are skipped)."""
    logger: dict[str, Any] = field(default_factory=dict)
    """Lightning loggers by name, each a ``_target_`` node (null entries are skipped)."""
    task_name: str = "train"
    """Name of the run; outputs go under outputs/<task_name>/."""
    seed: int = 0
    """Global seed (Lightning's seed_everything)."""
    validate_before: bool = True
    """Validate once before training (the 'before' perplexity)."""
    warmup_steps_for_timing: int = 2
    """Steps left out of the step-time median."""
    export_adapter: bool = True
    """Save the LoRA adapter in PEFT format to <run dir>/adapter when the model has one."""
    generate: GenerateSchema = field(default_factory=GenerateSchema)
    """Generation after training."""
