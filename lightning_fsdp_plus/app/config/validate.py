"""Checks of a composed run config that need more than types: value ranges, paths, cross-key rules.

Each failure is a ``ConfigError`` naming the full key, the bad value and the valid choices; the app prints
it as one paragraph and exits with status 2, before any process or process group starts.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fsdp_plus.loading.gguf import GGUFSourceError, gguf_path, is_gguf_reference
from lightning_fsdp_plus.options import FSDPPlusOptions, refuse_ignored
from lightning_fsdp_plus.plan import AUTO
from lightning_fsdp_plus.precision import check_precision


class ConfigError(ValueError):
    """A config value the run cannot use."""


def _devices_count(devices: Any) -> int | None:
    """Number of processes per node, or None for "auto"; raises ConfigError for anything invalid."""
    if devices == "auto" or devices == -1:
        return None
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices
    if isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and d >= 0 for d in devices):
        return len(devices)
    raise ConfigError(
        f"trainer.devices={devices!r} is not valid; choose a positive integer (processes per node),"
        " a non-empty list of device indices, or 'auto'"
    )


def _device_type(accelerator: str) -> str:
    return "cuda" if accelerator in ("gpu", "cuda") else "cpu" if accelerator == "cpu" else accelerator


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (``name`` or ``org/name``): explicit, existing, deeper than ``org/name``, or
    inside a directory that exists here."""
    path = Path(name).expanduser()
    return (name.startswith(("/", "./", "../", "~")) or path.exists() or name.count("/") > 1
            or (name.count("/") == 1 and path.parent.is_dir()))  # fmt: skip


def _closest_sibling(path: Path) -> str:
    """`` (did you mean <sibling>?)`` for a mistyped directory whose parent exists, else empty."""
    if not path.parent.is_dir():
        return ""
    siblings = [p.name for p in path.parent.iterdir() if p.is_dir()]
    close = difflib.get_close_matches(path.name, siblings, n=1)
    return f" (did you mean {path.parent / close[0]}?)" if close else ""


def check_model(model: Any) -> None:
    """The model config names something loadable: a local directory with config.json, a hub id, a GGUF file (a path or
    ``pkg:<module>/<file>``), or a config."""
    name = model.get("name_or_path")
    if name is None and model.get("config") is None and model.get("_target_") is None:
        raise ConfigError("model: set one of model.name_or_path, model.config or model._target_")
    if is_gguf_reference(name):  # converted once before training (lightning_fsdp_plus.loading.gguf)
        try:
            gguf_path(name)
        except GGUFSourceError as err:
            raise ConfigError(str(err)) from None
    elif name is not None and _looks_like_path(str(name)):
        path = Path(str(name)).expanduser()
        if not (path / "config.json").is_file():
            missing = "does not exist" if not path.exists() else "is not a directory with a config.json"
            raise ConfigError(
                f"model.name_or_path={str(name)!r} {missing} (relative to {Path.cwd()}){_closest_sibling(path)};"
                " give a local model directory (saved with save_pretrained) or a Hugging Face model id (org/name)"
            )
        if model.get("low_memory_load", True) and model.get("_target_") is None:
            from lightning_fsdp_plus.loading import PretrainedLoadError, read_checkpoint

            try:
                read_checkpoint(path)  # safetensors present, index complete, headers readable
            except PretrainedLoadError as err:
                raise ConfigError(f"model.name_or_path: {err}") from None
    elif name is not None:
        check_hub_id(str(name))


def hub_reachable(*, timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub can be asked at all: not ``HF_HUB_OFFLINE``, and its host resolves and accepts a
    connection within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def check_hub_id(name: str) -> None:
    """A hub id the run can load: in the local Hugging Face cache, or the Hub reachable. Otherwise one clear
    ConfigError now, rather than minutes of retries and a traceback from the tokenizer or the model."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError as err:
        raise ConfigError(f"model.name_or_path={name!r} is neither a local directory nor a valid Hugging Face model"
                          f" id (org/name): {err}") from None  # fmt: skip
    if isinstance(cached, str) or hub_reachable():
        return
    why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
    raise ConfigError(
        f"model.name_or_path={name!r} is not a local directory, not in the Hugging Face cache"
        f" ({constants.HF_HUB_CACHE}), and {why}: give a local model directory (saved with save_pretrained), or"
        f" download it first where there is a network (huggingface-cli download {name})"
    )


def strategy_options(strategy: Any) -> FSDPPlusOptions:
    """The strategy node as ``FSDPPlusOptions`` (the options' own validation, keys prefixed ``strategy.``)."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(strategy, resolve=True) if OmegaConf.is_config(strategy) else dict(strategy)
    values.pop("_target_", None)
    try:
        options = FSDPPlusOptions(**values)
        refuse_ignored(options)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"strategy.{err}") from None
    return options


def _plans(strategy: Any) -> bool:
    """Whether the strategy node asks the auto plan to choose (``sharding_strategy=auto``, any case)."""
    chosen = strategy.get("sharding_strategy")
    return str(getattr(chosen, "value", chosen)).lower() == AUTO


def fill_auto_plan(cfg: Any) -> None:
    """With ``strategy.sharding_strategy=auto``: plan for the data's batch and sequence length unless the strategy
    node says otherwise (``data.batch_size``; ``data.max_seq_len``, else ``data.seq_len``; packed rows when
    ``data.pack``)."""
    strategy, data = cfg.strategy, cfg.data
    if not _plans(strategy):
        return
    if strategy.get("plan_batch_size") is None and data.get("batch_size") is not None:
        strategy.plan_batch_size = data.batch_size
    if strategy.get("plan_seq_len") is None:
        strategy.plan_seq_len = data.get("max_seq_len") or data.get("seq_len")
    if strategy.get("plan_packed") is None and data.get("pack"):
        strategy.plan_packed = True


def unread_in_this_sweep_job(cfg: Any) -> dict[str, tuple[Any, str]]:
    """In a sweep, the auto plan's options (``memory_budget``, ...) given to every job reach the jobs that pin a
    strategy too (``-m strategy=full_shard,auto strategy.memory_budget=1GiB``): for those jobs they are cleared here.
    Returns ``{"strategy.KEY": (the value given, the override that clears it)}``, so the caller can say so and hand
    the clearing on to the job's own process. A single run refuses the same combination
    (:func:`~lightning_fsdp_plus.options.refuse_ignored`)."""
    from lightning_fsdp_plus.options import auto_only_given

    strategy = cfg.strategy
    if _plans(strategy):
        return {}
    cleared = {}
    for key in auto_only_given(strategy):
        value = strategy[key]
        listed = not isinstance(value, str) and isinstance(value, Sequence)
        given = list(value) if listed else value  # a copy: the node is emptied next
        cleared[f"strategy.{key}"] = (given, f"strategy.{key}={'[]' if listed else 'null'}")
        strategy[key] = [] if listed else None
    return cleared


def unknown_keys(node: Any, *, path: str = "") -> list[tuple[str, list[str]]]:
    """``(dotted key, valid keys there)`` for every key of a typed node that its schema does not declare: Hydra's
    ``+key=value`` adds keys even to typed configs, and nothing would ever read them."""
    from omegaconf import DictConfig, OmegaConf

    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []
    names = [f.name for f in dataclasses.fields(kind)]
    found = []
    for key in node:
        child = node._get_node(key)
        if key not in names:
            found.append((f"{path}{key}", names))
        elif isinstance(child, DictConfig) and not child._is_none():
            found += unknown_keys(child, path=f"{path}{key}.")
    return found


def check_unknown_keys(cfg: Any) -> None:
    """A ConfigError naming every key nothing reads, the valid keys there, and the likely intended key."""
    found = unknown_keys(cfg)
    if not found:
        return
    top = {name for _, names in unknown_keys_root(cfg) for name in names}
    lines = []
    for key, valid in found:
        parent, _, name = key.rpartition(".")
        close = difflib.get_close_matches(name, valid, n=1)
        if parent and name in top:
            hint = f" (did you mean the top-level key: {name}=...?)"
        elif close:
            hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)"
        else:
            hint = ""
        lines.append(f"{key}: nothing reads this key{hint}; valid keys there: {', '.join(valid)}")
    raise ConfigError("; ".join(lines))


def unknown_keys_root(cfg: Any) -> list[tuple[str, list[str]]]:
    """The root schema's keys (``[("", names)]``), or nothing for an untyped config."""
    from omegaconf import OmegaConf

    kind = OmegaConf.get_type(cfg)
    return [("", [f.name for f in dataclasses.fields(kind)])] if dataclasses.is_dataclass(kind) else []


def validate_run_config(cfg: Any) -> None:
    """Raise ConfigError for the first problem found in a composed ``RunSchema`` config."""
    check_unknown_keys(cfg)
    fill_auto_plan(cfg)
    trainer, strategy = cfg.trainer, cfg.strategy
    per_node = _devices_count(trainer.devices)
    if not isinstance(trainer.num_nodes, int) or trainer.num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={trainer.num_nodes!r} must be a positive integer")
    every = cfg.checkpoint.every_n_train_steps
    if every is not None and every < 1:
        raise ConfigError(f"checkpoint.every_n_train_steps={every!r} must be a positive integer (or null: after each"
                          " validation)")  # fmt: skip
    if trainer.gradient_clip_algorithm not in ("norm", "value"):
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not one of norm, value"
        )
    options = strategy_options(strategy)
    if per_node is not None and not options.auto:  # the auto plan checks its candidates' meshes itself
        try:
            options.mesh_layout(world_size=per_node * trainer.num_nodes, devices_per_node=per_node)
        except ValueError as err:
            raise ConfigError(f"strategy.{err} (trainer.devices x trainer.num_nodes)") from None
    try:
        check_precision(cfg.precision.name, device_type=_device_type(trainer.accelerator), key="precision.name")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_model(cfg.model)
    check_data_files(cfg.data)


def check_data_files(data: Any) -> None:
    """Every listed data file exists (relative paths are relative to the working directory); instruction data
    files hold ``{instruction, input?, response}`` records (the first bad one is named with its line)."""
    from lightning_fsdp_plus.app.data import DataError, check_instruction_file

    instruction = str(data.get("_target_", "")).endswith("InstructionDataModule")
    columns = dict(data.get("columns") or {})
    for key in ("train_files", "val_files"):
        missing = [f for f in (data.get(key) or []) if not Path(str(f)).expanduser().is_file()]
        if missing:
            raise ConfigError(f"data.{key}: {missing} not found (relative to {Path.cwd()})")
        for file in (data.get(key) or []) if instruction else []:
            try:
                check_instruction_file(Path(str(file)).expanduser(), columns=columns)
            except DataError as err:
                raise ConfigError(f"data.{key}: {err}") from None
