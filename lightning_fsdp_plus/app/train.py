"""``fsdp-plus-train``: fine-tune a causal LM with FSDPPlusStrategy, configured entirely through Hydra.

    fsdp-plus-train                                          # tiny Llama, FULL_SHARD, 2 CPU processes
    fsdp-plus-train strategy=lora_int8_replicated trainer.max_steps=100
    fsdp-plus-train model=pretrained model.name_or_path=/models/llama trainer=gpu precision=bf16_mixed
    fsdp-plus-train -m strategy=full_shard,shard_grad_op,no_shard,hybrid_shard   # or: sweep=sharding
    python -m lightning_fsdp_plus.app.train --cfg job                                # print the composed config

Features and the flags that switch them (every key is typed in ``lightning_fsdp_plus.app.config.schema``):

- sharding: ``strategy=`` full_shard | shard_grad_op | no_shard | hybrid_shard | lora_only |
  lora_int8_replicated | lora_int8_sharded, fine-tuned with ``strategy.<arg>=...``;
- LoRA: the lora_* presets fill ``strategy.lora`` from ``conf/lora/default.yaml``
  (swap: ``lora@strategy.lora=attention``; add to any strategy: ``+lora@strategy.lora=default``);
- precision: ``precision=`` 32_true | bf16_mixed | bf16_true | 16_mixed | 16_true;
- model: ``model=tiny_llama`` (built from a config) or ``model=pretrained model.name_or_path=...`` (built on
  meta, each rank reads only its shards after sharding; ``model.low_memory_load=false``: ``from_pretrained``);
- hardware: ``trainer=cpu|gpu|multi_node``, ``trainer.devices=N``;
- sweeps: ``-m`` or ``sweep=sharding``: each job launches exactly its own ranks (a fresh
  ``python -m lightning_fsdp_plus.app.train`` per job, so Lightning's launcher never re-runs the sweep), and
  the sweep ends with ``sweep_summary.{csv,md,png}`` in the sweep directory.

Each run writes ``metrics.json`` (and checkpoints, logs) into its Hydra run directory; LoRA runs also save
``adapter/`` (PEFT format), and instruction-data runs ``generations.jsonl`` (greedy answers to held-out
prompts from the sharded model).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from lightning_fsdp_plus._dist import barrier
from lightning_fsdp_plus.app.config import register_configs
from lightning_fsdp_plus.app.config.validate import ConfigError, unread_in_this_sweep_job, validate_run_config
from lightning_fsdp_plus.app.generate import greedy_generate, next_token_top
from lightning_fsdp_plus.app.layout import AttemptLog, plan_layout, recorded_layout, resume_path
from lightning_fsdp_plus.app.metrics import RunMetrics
from lightning_fsdp_plus.app.progress import progress_bar
from lightning_fsdp_plus.app.relay import JobStopped, run_relaying_signals
from lightning_fsdp_plus.app.requeue import (
    check_requeued_attempt,
    pending_hpc_checkpoint,
    read_base_metrics,
    requeued_last_checkpoint,
    retire_hpc_checkpoints,
    write_base_metrics,
)
from lightning_fsdp_plus.compile import compile_counters, eager_for_generation, graph_break_reasons
from lightning_fsdp_plus.failures import report_failure
from lightning_fsdp_plus.loading.gguf import converted_checkpoint, is_gguf_reference
from lightning_fsdp_plus.lora import export_adapter, find_peft_model
from lightning_fsdp_plus.memory.monitor import MemoryMonitor, iter_monitors
from lightning_fsdp_plus.precision import FSDPPlusPrecision

METRICS_FILE = "metrics.json"
GENERATIONS_FILE = "generations.jsonl"


def build_module(model_cfg: DictConfig, *, tokenizer: Any = None) -> Any:
    """The LightningModule: ``_target_`` with ``kwargs``, else ``CausalLMModule`` around a transformers LM
    (pretrained ones built on meta and loaded by the strategy, unless ``model.low_memory_load=false``). A model
    built from a config with ``vocab_size: null`` gets the data's ``tokenizer``'s size."""
    from lightning_fsdp_plus.app.lm import CausalLMModule, build_causal_lm

    if model_cfg.get("_target_"):
        return instantiate({"_target_": model_cfg._target_, **model_cfg.kwargs}, _convert_="all")
    config = OmegaConf.to_container(model_cfg.config, resolve=True) if model_cfg.config is not None else None
    if config is not None and "vocab_size" in config and config["vocab_size"] is None:
        if tokenizer is None:
            raise ConfigError("model.config.vocab_size is null (the data's tokenizer's size) but the data module has"
                              " no tokenizer: set model.config.vocab_size=N")  # fmt: skip
        config["vocab_size"] = len(tokenizer)
    hyper = {"lr": model_cfg.lr, "weight_decay": model_cfg.weight_decay,
             "chunked_loss": model_cfg.get("chunked_loss", True)}  # fmt: skip
    if model_cfg.name_or_path is not None and model_cfg.low_memory_load:  # weights read per rank after sharding
        return CausalLMModule.from_pretrained(model_cfg.name_or_path, torch_dtype=model_cfg.torch_dtype,
                                              config_overrides=config, **hyper)  # fmt: skip
    model = build_causal_lm(name_or_path=model_cfg.name_or_path, config=config, torch_dtype=model_cfg.torch_dtype)
    return CausalLMModule(model, **hyper)


def build_strategy(strategy_cfg: DictConfig) -> Any:
    """``FSDPPlusStrategy`` from the strategy node (LoRA settings passed as a plain mapping)."""
    return instantiate(strategy_cfg, _convert_="all")


VALIDATIONS_PER_RUN = 4
"""Validations (and with them "last" checkpoints) a ``max_steps`` run makes when ``val_check_interval`` is unset."""


def trainer_arguments(trainer_cfg: DictConfig) -> dict[str, Any]:
    """``Trainer`` keyword arguments from the trainer node. Validation (and so the checkpoint saved after it) runs
    every ``val_check_interval`` steps counted across epochs — by default ``max_steps / 4`` — rather than after
    every epoch, which on a small dataset is every step."""
    kwargs = OmegaConf.to_container(trainer_cfg, resolve=True)
    interval, max_steps = kwargs.get("val_check_interval"), kwargs.get("max_steps", -1)
    if interval is None and max_steps and max_steps > 0:
        interval = max(1, max_steps // VALIDATIONS_PER_RUN)
    if isinstance(interval, int) and not isinstance(interval, bool):
        kwargs["val_check_interval"], kwargs["check_val_every_n_epoch"] = interval, None
    return kwargs


def _instantiate_all(nodes: DictConfig) -> list[Any]:
    return [instantiate(node, _convert_="all") for node in nodes.values() if node is not None]


def _auto_choice(strategy: Any) -> str | None:
    """The auto plan's chosen candidate (``None`` when the configuration was given)."""
    plan = getattr(strategy, "auto_plan", None)
    return None if plan is None or plan.chosen is None else plan.choice.candidate.label


def use_converted_model(cfg: DictConfig) -> None:
    """A GGUF ``model.name_or_path`` (a ``.gguf`` path or ``pkg:<module>/<file>``) replaced by its converted checkpoint
    directory (converted on first use, once: :mod:`lightning_fsdp_plus.loading.gguf`), so the tokenizer, the
    streaming loader and the adapter's ``base_model_name_or_path`` all read that directory. Runs before the Trainer
    exists, so before any process group; ranks started later find the conversion done."""
    if is_gguf_reference(cfg.model.get("name_or_path")):
        cfg.model.name_or_path = str(converted_checkpoint(cfg.model.name_or_path))


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit and validate one run on this process's rank; rank 0 writes and returns ``metrics.json``'s content."""
    use_converted_model(cfg)
    seed_everything(cfg.seed, workers=True)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        check_requeued_attempt(output_dir, ckpt_path=cfg.ckpt_path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    datamodule = instantiate(cfg.data)
    module = build_module(cfg.model, tokenizer=getattr(datamodule, "tokenizer", None))
    run_metrics = RunMetrics(warmup_steps=cfg.warmup_steps_for_timing)
    trainer_kwargs = trainer_arguments(cfg.trainer)
    callbacks = _instantiate_all(cfg.callbacks)
    if trainer_kwargs.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(progress_bar())  # Lightning's default reads "Epoch 0/-2" under max_steps
    monitor = next(iter_monitors(callbacks), None) or MemoryMonitor(log_every_n_steps=0)  # feeds metrics.json
    trainer = Trainer(
        **trainer_kwargs,
        strategy=build_strategy(cfg.strategy),
        plugins=[FSDPPlusPrecision(cfg.precision.name)],  # a plugin, so CPU 16-mixed stays fp16
        callbacks=[*callbacks, *([] if monitor in callbacks else [monitor]), run_metrics],
        logger=_instantiate_all(cfg.logger) or False,
        default_root_dir=str(output_dir),
    )
    for logger in trainer.loggers:  # the run's whole config, as lightning-hydra-template logs it (rank 0 only)
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    if not cfg.train:
        return evaluate(cfg, trainer=trainer, module=module, datamodule=datamodule, output_dir=output_dir)
    # a requeued SLURM job resumes from Lightning's HPC checkpoint, else from the "last" its earlier attempt saved
    ckpt_path, last = cfg.ckpt_path, requeued_last_checkpoint(output_dir, ckpt_path=cfg.ckpt_path)
    if last is not None:
        ckpt_path = str(last)
    resuming = last or (pending_hpc_checkpoint(output_dir) if ckpt_path is None else None)
    attempts = None
    if hasattr(datamodule, "global_batch_size"):  # the app's data modules: one global batch on any layout
        checkpoint = resume_path(ckpt_path, output_dir)
        layout = plan_layout(trainer=trainer, datamodule=datamodule, recorded=recorded_layout(checkpoint))
        attempts = AttemptLog(output_dir, layout, resuming=checkpoint is not None)
        trainer.callbacks.append(attempts)
    base = validate_base(trainer, module, datamodule, output_dir, resuming=resuming) if cfg.validate_before else {}
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_seconds = time.perf_counter() - started
    train_loss = trainer.callback_metrics.get("train_loss")
    if trainer.is_global_zero and pending_hpc_checkpoint(output_dir) is not None:
        retire_hpc_checkpoints(output_dir)  # else validate() below would load one over the trained weights
    trainer.strategy.barrier()
    final = validation(trainer, module=module, datamodule=datamodule)
    adapter_dir = output_dir / "adapter"
    if cfg.export_adapter and find_peft_model(module) is not None:
        export_adapter(trainer.strategy.model, adapter_dir)  # every rank gathers, rank 0 writes
    if cfg.generate.num_prompts > 0 and hasattr(datamodule, "generation_prompts"):
        write_generations(trainer, datamodule, output_dir / GENERATIONS_FILE, cfg.generate)
    metrics = {
        "sharding_strategy": trainer.strategy.sharding_strategy.value,
        "strategy_preset": HydraConfig.get().runtime.choices.get("strategy"),
        "precision": cfg.precision.name,
        "lora_only": trainer.strategy.lora_only,  # the strategy's: the auto plan may have chosen them
        "quantize_base": trainer.strategy.quantize_base,
        "activation_checkpointing": trainer.strategy.activation_checkpointing is not None,
        "auto_plan": _auto_choice(trainer.strategy),
        "world_size": trainer.world_size,
        "global_batch_size": getattr(datamodule, "global_batch_size", None),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "attempts": attempts.attempts if attempts is not None else None,
        "torch_threads_per_rank": torch.get_num_threads(),  # CPU: the rank's share of the host's cores
        "compile": _compile_report(trainer.strategy),
        "fit_time_s": fit_seconds,
        "steps": trainer.global_step,
        **throughput_per_rank(run_metrics.summary(trainer), world_size=trainer.world_size),
        **monitor.summary(trainer),
        "train_loss": float(trainer.strategy.reduce(train_loss.detach(), reduce_op="mean"))
        if train_loss is not None
        else None,
        "val_loss": final.get("val_loss"),
        "val_perplexity": final.get("val_perplexity"),
        "base_val_loss": base.get("val_loss"),
        "base_val_perplexity": base.get("val_perplexity"),
        "overrides": list(HydraConfig.get().overrides.task),
        "adapter_dir": str(adapter_dir) if adapter_dir.exists() else None,
    }
    metrics["wall_time_s"] = time.perf_counter() - APP_STARTED[0] if APP_STARTED else None
    if trainer.is_global_zero:
        (output_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1))
        rank_zero_info(f"{perplexity_line(metrics)}; {throughput_line(metrics)}; metrics: {output_dir / METRICS_FILE}")
    return metrics


def throughput_per_rank(summary: dict[str, float], *, world_size: int) -> dict[str, float]:
    """The run's throughput figures (``tokens_per_s`` and ``useful_tokens_per_s`` summed over ranks) with the useful
    tokens per second of one rank (``useful_tokens_per_s_per_rank``) and the padding share of the trained batches'
    tokens under its plain name too (``padding_fraction``)."""
    per_rank = summary["useful_tokens_per_s"] / world_size if world_size else float("nan")
    return {**summary, "useful_tokens_per_s_per_rank": per_rank, "padding_fraction": summary["padding_share"]}


def validation(trainer: Trainer, *, module: Any, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
    """The metrics of one ``trainer.validate``, or ``{}`` when Lightning ran none (``trainer.limit_val_batches=0``)."""
    results = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    return results[0] if results else {}


def perplexity_line(metrics: dict[str, Any]) -> str:
    """The console's validation report: the held-out perplexity (after the base's, when measured), or why none."""
    final, base = metrics.get("val_perplexity"), metrics.get("base_val_perplexity")
    if final is None:
        return "val perplexity not measured (no validation batch: trainer.limit_val_batches=0?)"
    return f"val perplexity {f'{base:.2f} -> ' if base is not None else ''}{final:.2f}"


def throughput_line(metrics: dict[str, Any]) -> str:
    """The console's throughput report: useful (in-loss) tokens per second, of all tokens, and the padding share."""
    useful, total, padding = (metrics.get(k) for k in ("useful_tokens_per_s", "tokens_per_s", "padding_share"))
    if useful is None or total is None or padding is None or any(math.isnan(v) for v in (useful, total, padding)):
        return "throughput not measured (no step after the timing warm-up)"
    return f"{useful:,.0f} useful tokens/s of {total:,.0f} ({padding:.1%} padding)"


def evaluate(cfg: DictConfig, *, trainer: Trainer, module: Any, datamodule: Any, output_dir: Path) -> dict[str, Any]:
    """``train=false``: validate the model (from ``ckpt_path`` when given) and write metrics.json (and generations)."""
    final = validation(trainer, module=module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if cfg.generate.num_prompts > 0 and hasattr(datamodule, "generation_prompts"):
        write_generations(trainer, datamodule, output_dir / GENERATIONS_FILE, cfg.generate)
    metrics = {
        "mode": "evaluate",
        "ckpt_path": cfg.ckpt_path,
        "sharding_strategy": trainer.strategy.sharding_strategy.value,
        "world_size": trainer.world_size,
        "val_loss": final.get("val_loss"),
        "val_perplexity": final.get("val_perplexity"),
        "overrides": list(HydraConfig.get().overrides.task),
    }
    if trainer.is_global_zero:
        (output_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1))
        rank_zero_info(f"{perplexity_line(metrics)}; metrics: {output_dir / METRICS_FILE}")
    return metrics


def validate_base(trainer: Trainer, module: Any, datamodule: Any, output_dir: Path, *, resuming: Path | None) -> dict:
    """The validation before training: measured (and kept in the run directory), or — in a requeued SLURM job, where
    Lightning would validate its HPC checkpoint instead of the base — the first attempt's figures."""
    if resuming is not None:
        kept = read_base_metrics(output_dir)
        how = "as the first attempt measured it" if kept else "not measured (the first attempt stopped before it)"
        rank_zero_info(f"fsdp_plus: requeued SLURM job: resuming from {resuming}; the base's validation: {how}")
        return kept or {}
    base = validation(trainer, module=module, datamodule=datamodule)
    if trainer.is_global_zero and base:
        write_base_metrics(output_dir, {k: v for k, v in base.items() if k in ("val_loss", "val_perplexity")})
    return base


def _compile_report(strategy: Any) -> dict[str, Any] | None:
    """With ``strategy.compile``: units compiled, and dynamo's graphs and graph breaks in this (rank 0) process."""
    plan = strategy.sharding_plan
    if plan.compile is None:
        return None
    return {"spec": plan.compile.describe(), "units": len(plan.compiled), **compile_counters(),
            "graph_break_reasons": graph_break_reasons()}  # fmt: skip


def generation_prompts(datamodule: Any, settings: DictConfig) -> list[dict[str, Any]]:
    """The prompts to answer: the first ``settings.num_prompts`` of ``settings.questions`` (held-out questions, asked
    as the data module asks its own) when given, else of the data module's held-out examples."""
    if not settings.get("questions"):
        return datamodule.generation_prompts(settings.num_prompts)
    from lightning_fsdp_plus.app.generate import generation_prompt

    lines = Path(settings.questions).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][: settings.num_prompts]
    prompts = []
    for row in rows:
        question, prompt = generation_prompt({"instruction": row["question"]}, datamodule.tokenizer)
        prompts.append({"question": question, "prompt": prompt, "answers": row.get("answers")})
    return prompts


def write_generations(trainer: Trainer, datamodule: Any, path: Path, settings: DictConfig) -> None:
    """Answer held-out prompts greedily with the sharded model (all ranks decode together); rank 0 writes and prints
    them. A LoRA model answers with its adapter disabled too (the base, side by side)."""
    prompts = generation_prompts(datamodule, settings)
    model = trainer.strategy.model
    model.eval()
    found = find_peft_model(model)
    peft_model = found[1] if found is not None else None

    def answers() -> list[str]:
        with eager_for_generation():  # a new length per token: compiling each would cost more than it saves
            return greedy_generate(
                lambda ids: model(input_ids=ids).logits,
                datamodule.tokenizer,
                [p["prompt"] for p in prompts],
                max_new_tokens=settings.max_new_tokens,
                device=trainer.strategy.root_device,
            )

    tuned = answers()
    probes = [next_token_top(lambda ids: model(input_ids=ids).logits, datamodule.tokenizer, p["prompt"],
                             device=trainer.strategy.root_device) for p in prompts]  # fmt: skip
    base = None
    if peft_model is not None:
        with peft_model.disable_adapter():  # the frozen base alone, as it answered before training
            base = answers()
    if trainer.is_global_zero:
        rows = [{**p, "generated": a, "next_token_top": probes[i],
                 **({"base_generated": base[i]} if base is not None else {})}
                for i, (p, a) in enumerate(zip(prompts, tuned, strict=True))]  # fmt: skip
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        for row in rows:
            if base is None:
                rank_zero_info(f"Q: {row['question']}\n   A: {row['generated']}")
            else:
                rank_zero_info(f"Q: {row['question']}\n   base:  {row['base_generated']}\n"
                               f"   tuned: {row['generated']}")  # fmt: skip


def run_job_in_subprocess(*, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run this multirun job as a fresh single run, so that it launches exactly its own ranks (``extra``: overrides
    after the job's own).

    Lightning's launcher re-executes ``sys.argv`` for the other ranks, which under ``-m`` is the whole sweep
    (Hydra #2070), and a process that already hosted a job keeps its process group and rank variables. A stop
    signal reaches the child first (:mod:`lightning_fsdp_plus.app.relay`): it saves before this process's own
    handler (submitit's requeue) runs.
    """
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    command = [sys.executable, "-m", "lightning_fsdp_plus.app.train", f"--config-name={hydra_cfg.job.config_name}"]
    command += [f"--config-dir={s.path}" for s in hydra_cfg.runtime.config_sources if s.provider == "command-line"]
    command += [
        *hydra_cfg.overrides.task,
        *extra,
        f'hydra.run.dir="{output_dir}"',
        "hydra.mode=RUN",
        "hydra.output_subdir=null",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    ended = run_relaying_signals(command, cwd=hydra_cfg.runtime.cwd, env=env)
    if ended.returncode != 0:
        job = f"sweep job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname})"
        if ended.signum:  # it saved and stopped (or, stopped already, was ended by the requeue that followed)
            raise JobStopped(f"{job} stopped on {signal.Signals(ended.signum).name} (exit status {ended.returncode});"
                             f" its checkpoints are in {output_dir}")  # fmt: skip
        raise RuntimeError(f"{job} exited with {ended.returncode}")
    return json.loads((Path(output_dir) / METRICS_FILE).read_text())


_STARTED: list[bool] = []  # the task ran: Hydra's exit status 1 before it means the config did not compose
FAILED_FILE = "failed.txt"
"""Written into the run directory when the run fails: why."""


def log_to_run_files() -> None:
    """Lightning's loggers do not propagate to the root logger, whose file handler Hydra points at the run's
    ``<task>.log``: give them that handler too, so the run's log lines land in its directory."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in ("lightning.pytorch", "lightning.fabric"):
        target = logging.getLogger(name)
        for handler in files:
            if handler not in target.handlers:
                target.addHandler(handler)


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InstantiationException, ValueError, FileNotFoundError)
"""What a user's input causes (a bad value, a model or file that is not there, a budget nothing fits, ...): reported
as one ``Error:`` block on the console with exit status 2; the traceback goes to ``failed.txt`` and the log."""


def _log_to_files(text: str) -> None:
    """``text`` as an error record in the run's log files only (the console gets the short form, or Hydra's)."""
    record = logging.getLogger(__name__).makeRecord(__name__, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def record_failure(err: BaseException, *, with_traceback: bool = True) -> bool:
    """Say why the run failed, in this rank's log file and the run directory's ``failed.txt``: the run's first
    failure with its traceback (none for a configuration error: its message is the whole story). When another rank
    failed first (this rank's error, e.g. gloo's "Connection closed by peer", follows from it), that rank's error is
    the one reported, and this rank's own is added after it; a failure that follows never replaces the first one's
    ``failed.txt``. Returns whether this rank's failure is the run's first (the one to show on the console)."""
    mine, first = report_failure(err)  # through the store, never a collective (failures.py)
    if first.rank == mine.rank:
        trace = f"\n\n{mine.traceback}" if with_traceback else ""
        text = f"the run failed on rank {mine.rank}: {mine.error}{trace}"
    else:
        text = (f"the run failed: {first.headline()}\n\n{first.traceback}\nrank {mine.rank} stopped because of it"
                f" with {mine.error}")  # fmt: skip
    _log_to_files(text)
    with contextlib.suppress(OSError, ValueError):  # ValueError: no Hydra run directory (outside the app)
        path = Path(HydraConfig.get().runtime.output_dir) / FAILED_FILE
        if first.rank == mine.rank or not path.exists():
            path.write_text(text + "\n")
        else:
            with path.open("a") as file:
                file.write(f"rank {mine.rank} stopped because of it with {mine.error}\n")
    return first.rank == mine.rank


def user_error_message(err: BaseException, *, traced: bool) -> str:
    """The console's block for a user's mistake: the error, and where its traceback is."""
    where = ""
    with contextlib.suppress(ValueError):  # no Hydra run directory (outside the app)
        where = f"the traceback is in {Path(HydraConfig.get().runtime.output_dir) / FAILED_FILE}; " if traced else ""
    return f"Error: {err}\n({where}set HYDRA_FULL_ERROR=1 to raise it here)"


APP_STARTED: list[float] = []
"""When this process's task began (``time.perf_counter()``): the run's wall time in metrics.json counts from it."""


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """The task: validate, then train here (single run) or in a fresh process (multirun job); a failure is
    recorded in the run directory."""
    _STARTED.append(True)
    APP_STARTED.append(time.perf_counter())
    log_to_run_files()
    try:
        sweep = HydraConfig.get().mode == RunMode.MULTIRUN
        cleared = unread_in_this_sweep_job(cfg) if sweep else {}
        if cleared:  # shared by the sweep's jobs, read only by its auto ones: said, not silently dropped
            given = ", ".join(f"{key}={value}" for key, (value, _) in cleared.items())
            logging.getLogger(__name__).warning(
                f"sweep job {HydraConfig.get().job.num} pins sharding_strategy={cfg.strategy.sharding_strategy}:"
                f" {given} is read only by sharding_strategy=auto, so this job runs without it"
            )
        validate_run_config(cfg)
        if sweep:
            return run_job_in_subprocess(extra=[override for _, override in cleared.values()])
        return train(cfg)
    except JobStopped as err:  # stopped and saved on a signal: not a failure (no failed.txt)
        logging.getLogger(__name__).warning(str(err))
        raise
    except USER_ERRORS as err:
        traced = not isinstance(err, (ConfigError, InstantiationException))
        first = record_failure(err, with_traceback=traced)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if first:  # every rank may meet the same mistake: it is said once
            print(user_error_message(err, traced=traced), file=sys.stderr)
        sys.exit(2)
    except Exception as err:
        record_failure(err)  # the console gets its traceback once, from Hydra
        raise


@hydra.main(version_base="1.3", config_path="pkg://lightning_fsdp_plus.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> dict[str, Any] | None:
    return run(cfg)


def main() -> None:
    """Console entry point ``fsdp-plus-train``. Every value error exits with status 2: the app's own checks, and
    Hydra's compose-time errors (a bad key, type or choice), which Hydra reports with status 1."""
    register_configs()
    try:
        _hydra_main()
    except SystemExit as exit_:
        if exit_.code == 1 and not _STARTED:
            sys.exit(2)
        raise
    barrier()  # ranks leave together; FSDPPlusStrategy frees the process group at exit


if __name__ == "__main__":
    main()
