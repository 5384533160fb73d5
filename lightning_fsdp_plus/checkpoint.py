"""Checkpoints: sharded (torch.distributed.checkpoint) and full, trainable-only, atomic, verified.

Layout of a sharded checkpoint directory ``PATH``:

- ``*.distcp`` and ``.metadata``: model and optimizer state written by ``torch.distributed.checkpoint``
  (each rank writes its own shards; loading reshards to any world size or sharding strategy);
- ``meta.pt``: Lightning's loops, callbacks, LR schedulers, precision/scaler state and our settings;
- ``rng_rank<R>.pt``: every rank's RNG states (torch, CUDA, numpy, python);
- ``manifest.json``: size and SHA-256 of every file, checked before anything is read.

A full checkpoint is one file, a standard Lightning checkpoint: the model and optimizer state consolidated on
rank 0, the optimizer state keyed by parameter ids as ``torch.optim.Optimizer.state_dict`` keys it (so DDP or a
single device resume it), with a ``PATH.sha256`` sidecar. Loading accepts plain Lightning checkpoints too: files
without a sidecar, Lightning's sharded directories without a manifest; what is there is verified.

Saving writes into a temporary sibling (``.fsdp_plus_tmp-<id>.PATH``) and renames it into place only after every
rank has finished, so the previous checkpoint at ``PATH`` stays valid until the new one is complete. Saving over
an existing path follows Lightning's ``ModelParallelStrategy``: a sharded checkpoint replaces a file or goes into
an existing folder (files in it that are not checkpoint files are kept, moved into the new folder); a full one
replaces a file or a sharded checkpoint, and refuses a folder that is not a checkpoint. Nothing else is deleted.
With ``trainable_only`` the frozen parameters (the base, int8 included) are not written; on resume they come
from the model the LightningModule builds again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus._dist import all_gather_object, barrier, broadcast_object, rank
from lightning_fsdp_plus._private import (
    _METADATA_FILENAME,
    _collect_rng_states,
    _distributed_checkpoint_save,
    _is_sharded_checkpoint,
    _set_rng_states,
)

MANIFEST = "manifest.json"
META = _METADATA_FILENAME  # Lightning's sharded layout: DCP files + "meta.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, truncated or corrupted file), with the file named."""


def state_dict_options(*, full: bool, trainable_only: bool, strict: bool = True) -> Any:
    """torch's StateDictOptions for our two formats (full ones gathered one tensor at a time onto CPU); ``strict``:
    every parameter of the model must be in the checkpoint (``LightningModule.strict_loading``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # loading a trainable-only checkpoint leaves the frozen parameters as the model built them
    return StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=trainable_only,
                            strict=strict and not trainable_only)  # fmt: skip


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(paths: Sequence[Path], root: Path) -> dict[str, dict[str, Any]]:
    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in paths}


def is_checkpoint_file(name: str) -> bool:
    """Whether a file name inside a checkpoint directory is one of its files (ours or Lightning's)."""
    return (name in (MANIFEST, META, ".metadata") or name.endswith(".distcp")
            or (name.startswith("rng_rank") and name.endswith(".pt")))  # fmt: skip


def foreign_entries(path: Path) -> list[Path]:
    """What a directory at a checkpoint's path holds besides checkpoint files (kept when it is overwritten)."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if not (p.is_file() and is_checkpoint_file(p.name)))


def temporary_sibling(path: Path) -> Path:
    """A fresh temporary path next to ``path`` (same file system, so the final rename is atomic)."""
    # a hidden prefix, so that globs such as ModelCheckpoint's "last*" never pick a half-written one
    return path.with_name(f".fsdp_plus_tmp-{uuid.uuid4().hex[:8]}.{path.name}")


def commit(tmp: Path, path: Path) -> None:
    """Move a finished ``tmp`` into place; an older checkpoint at ``path`` is removed only afterwards.

    When both are directories, entries of the old one that are not checkpoint files move into the new one
    (until then they wait in the hidden ``.fsdp_plus_old-*`` sibling: a crash loses nothing).
    """
    old = None
    if path.exists():
        old = path.with_name(f".fsdp_plus_old-{uuid.uuid4().hex[:8]}.{path.name}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is None:
        return
    if old.is_dir():
        if path.is_dir():
            for entry in foreign_entries(old):
                os.replace(entry, path / entry.name)
        shutil.rmtree(old)
    else:
        old.unlink()


def collect_rng_states() -> dict[str, Any]:
    """This rank's RNG states, as Lightning collects them, with numpy's key as a tensor (weights_only-safe)."""
    states = _collect_rng_states(include_cuda=torch.cuda.is_available())
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put this rank's RNGs back where they were."""
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        states = {**states, "numpy": (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)}
    _set_rng_states(states)


def save_sharded(
    path: str | Path,
    *,
    model_state: dict[str, Any],
    optimizer_states: Sequence[dict[str, Any]],
    metadata: dict[str, Any],
) -> Path:
    """Write a sharded checkpoint directory atomically; call on every rank."""
    path = Path(path)
    tmp = Path(broadcast_object(str(temporary_sibling(path))))
    tmp.mkdir(parents=True, exist_ok=True)
    stale_sidecar = sidecar_path(path)  # a full checkpoint's, when a file at path is replaced
    state = {"state_dict": model_state, **{f"optimizer_{i}": s for i, s in enumerate(optimizer_states)}}
    _distributed_checkpoint_save(state, tmp)  # Lightning's ModelParallelStrategy layout, in a temporary sibling
    me = rank()
    torch.save(collect_rng_states(), tmp / f"rng_rank{me}.pt")
    if me == 0:
        torch.save({**metadata, "fsdp_plus_format": FORMAT_VERSION}, tmp / META)
    barrier()
    # every rank hashes the files it wrote, rank 0 writes the manifest and commits
    mine = [p for p in tmp.iterdir() if p.name.startswith((f"__{me}_", f"rng_rank{me}."))]
    if me == 0:
        mine += [tmp / ".metadata", tmp / META]
    described = all_gather_object(_describe(mine, tmp))
    if me == 0:
        files = {name: info for part in described for name, info in part.items()}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1))
        if path.is_file() and stale_sidecar.is_file():
            stale_sidecar.unlink()
        commit(tmp, path)
    barrier()
    return path


def sidecar_path(path: Path) -> Path:
    """The SHA-256 sidecar of a full checkpoint file."""
    return path.with_name(path.name + ".sha256")


def verify(path: str | Path) -> None:
    """Raise CheckpointError naming the first missing, truncated or corrupted file of a checkpoint.

    Checks what the checkpoint carries: a file's ``.sha256`` sidecar, a directory's manifest. Lightning's own
    checkpoints have neither and pass as they are; a path that is neither a file nor a sharded checkpoint
    directory is an error.
    """
    path = Path(path)
    if path.is_file():
        return _verify_file(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(
            f"checkpoint {path} does not point to a valid checkpoint: expected a checkpoint file or a directory with"
            f" {META} ({'an empty or other directory' if path.is_dir() else 'nothing is there'})"
        )
    manifest = path / MANIFEST
    if not manifest.is_file():
        if any(path.glob("rng_rank*.pt")):  # our layout: the manifest is written with it, so it was removed
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (an fsdp_plus checkpoint, altered?)")
        return None  # Lightning's sharded layout (ModelParallelStrategy / FSDPStrategy) has no manifest
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path}: {manifest} is corrupted ({err})") from err
    for name, info in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {file} is missing")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: file {file} is truncated or overwritten "
                f"({file.stat().st_size} bytes, expected {info['bytes']})"
            )
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {file} is corrupted (SHA-256 mismatch)")
    return None


def _verify_file(path: Path) -> None:
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return  # a plain Lightning checkpoint (DDP, single device); ours are renamed into place complete
    if _sha256(path) != sidecar.read_text().split()[0]:
        raise CheckpointError(f"checkpoint {path}: file {path} is truncated or corrupted (SHA-256 mismatch)")


def load_sharded(
    path: str | Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer shards (resharding as needed) and this rank's RNG; returns the metadata.

    Whether frozen parameters are in the checkpoint is read from its own metadata. ``strict=False``
    (``LightningModule.strict_loading``): the model's keys the checkpoint lacks keep their values.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    verify(path)
    metadata = _load_meta(path)
    trainable_only = metadata.get("fsdp_plus", {}).get("trainable_only", False)
    options = state_dict_options(full=False, trainable_only=trainable_only, strict=strict)
    model_state, optim_states = get_state_dict(model, list(optimizers), options=options)
    optim_list = optim_states if isinstance(optim_states, list) else [optim_states] if optimizers else []
    state = {"state_dict": model_state, **{f"optimizer_{i}": s for i, s in enumerate(optim_list)}}
    try:
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    except (Exception, CheckpointException) as err:  # DCP's own error is a BaseException, with every rank's trace
        reason = str(err).strip().splitlines()[-1]  # DCP names keys, not files: give both
        hint = " (LightningModule.strict_loading = False keeps the values of keys a checkpoint lacks)"
        raise CheckpointError(f"checkpoint {path}: could not be read into this model: {reason}"
                              f"{hint if 'Missing key' in reason else ''}") from err  # fmt: skip
    for optimizer, optim_state in zip(optimizers, optim_list, strict=True):
        set_state_dict(model, [optimizer], model_state_dict=state["state_dict"], optim_state_dict=optim_state,
                       options=options)  # fmt: skip
    if not optimizers:
        set_state_dict(model, [], model_state_dict=state["state_dict"], optim_state_dict={}, options=options)
    rng = path / f"rng_rank{rank()}.pt"
    if rng.is_file():  # absent when resuming on more ranks than were saved
        restore_rng_states(torch.load(rng, weights_only=True))
    return metadata


def _load_meta(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / META, weights_only=True)
    except Exception as err:  # e.g. hyper-parameters holding custom classes
        raise CheckpointError(
            f"checkpoint {path}: {META} holds objects that weights_only loading refuses ({err}); if you trust the "
            "file, allow them with torch.serialization.add_safe_globals"
        ) from err


def check_full_target(path: Path) -> None:
    """Raise IsADirectoryError when a full checkpoint cannot replace what is at ``path`` without losing files."""
    if not path.is_dir():
        return
    if not is_sharded_checkpoint(path):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path}; a full checkpoint (state_dict_type='full') is"
            " one file: choose a file path, or state_dict_type='sharded' to write into this folder"
        )
    foreign = foreign_entries(path)
    if foreign:
        raise IsADirectoryError(
            f"The checkpoint path {path} is a sharded checkpoint that also holds other files"
            f" ({', '.join(p.name for p in foreign[:5])}); a full checkpoint replacing it would delete them:"
            " move them or choose another path"
        )


def save_full(path: str | Path, *, checkpoint: dict[str, Any]) -> Path:
    """Write one consolidated file on rank 0 (atomically, with a SHA-256 sidecar); call on every rank.

    A sharded checkpoint at ``path`` is replaced; any other directory is refused (:func:`check_full_target`).
    """
    path = Path(path)
    check_full_target(path)
    if rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_sibling(path)
        torch.save({**checkpoint, "fsdp_plus_format": FORMAT_VERSION}, tmp)
        sidecar = sidecar_path(path)
        sidecar_tmp = temporary_sibling(sidecar)
        sidecar_tmp.write_text(f"{_sha256(tmp)}  {path.name}\n")
        # old sidecar first: a crash in between leaves a complete file with no sidecar (accepted), never a
        # complete file with the previous file's digest (refused)
        sidecar.unlink(missing_ok=True)
        commit(tmp, path)
        commit(sidecar_tmp, sidecar)
    barrier()
    return path


def load_full(path: str | Path) -> dict[str, Any]:
    """Verify and read a full checkpoint file (``weights_only`` unpickling)."""
    path = Path(path)
    verify(path)
    try:
        # memory-mapped: tensors are read when they are copied into the shards, not all at once
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: file {path} could not be read: {err}") from err


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A sharded checkpoint directory (ours, or Lightning's ``ModelParallelStrategy``/``FSDPStrategy`` one)."""
    return _is_sharded_checkpoint(Path(path))


def optimizer_state_by_ids(state: dict[str, Any]) -> dict[str, Any]:
    """A state from ``get_optimizer_state_dict`` (keyed by parameter names) in torch's standard layout.

    Ids number the parameters in ``param_groups`` order, as ``torch.optim.Optimizer.state_dict`` numbers them, so
    ``optimizer.load_state_dict`` (DDP, single device) reads the result. Empty states (ranks > 0) pass as they are.
    """
    if not state or "param_groups" not in state:
        return state
    ids: dict[Any, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]})
    return {**state, "state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_names(state: dict[str, Any], *, names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_ids`: ids become ``names`` (the optimizer's parameters in
    ``param_groups`` order). A state already keyed by names passes as it is."""
    groups = state.get("param_groups", [])
    ids = [i for group in groups for i in group["params"]]
    if not ids or not all(isinstance(i, int) for i in ids):
        return state
    if len(ids) != len(names):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(ids)} parameters, this one {len(names)}: it was saved for another"
            " model or another set of trainable parameters"
        )
    by_id = {i: names[position] for position, i in enumerate(ids)}
    return {
        **state,
        "state": {by_id[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [by_id[i] for i in group["params"]]} for group in groups],
    }


def load_param_groups_only(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
    """Restore a saved optimizer state that holds no per-parameter state (plain SGD without momentum, or any optimizer
    saved before its first step): its param groups' hyperparameters (``lr`` as a scheduler left it, ``momentum``,
    ...) go into ``optimizer``; there is nothing else to restore. Returns False, changing nothing, when the state
    has per-parameter entries (then ``set_optimizer_state_dict`` loads it).

    torch's ``set_optimizer_state_dict`` cannot load such a state from a full checkpoint: it infers the device from
    the optimizer's own state tensors and has none (``AssertionError: Expected device to be set``)."""
    if state.get("state"):
        return False
    groups = state.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter group(s), this one {len(optimizer.param_groups)}:"
            " it was saved for another optimizer configuration"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        if len(saved.get("params", group["params"])) != len(group["params"]):
            raise CheckpointError(
                f"the checkpoint's optimizer group has {len(saved['params'])} parameters, this one"
                f" {len(group['params'])}: it was saved for another model or another set of trainable parameters"
            )
        group.update({key: value for key, value in saved.items() if key != "params"})
    return True


def saved_optimizer_count(path: str | Path) -> int:
    """How many optimizers a sharded checkpoint holds (``optimizer_<i>`` entries of its DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({key.split(".", 1)[0] for key in keys if key.startswith("optimizer_")})


def check_optimizer_count(*, configured: int, saved: int) -> None:
    """Lightning's rule: a checkpoint restores exactly the optimizers the module configures (a weights-only one,
    none, is Lightning's KeyError)."""
    if saved == 0 and configured:
        raise KeyError(
            "Trying to restore optimizer state but checkpoint contains only the model. This is probably due to"
            " `ModelCheckpoint.save_weights_only` being set to `True`."
        )
    if configured != saved:
        raise RuntimeError(
            f"You have configured {configured} optimizers but the checkpoint contains {saved} optimizers to load."
            " Please resume training with the same number of optimizers or edit the checkpoint manually to remove"
            " states."
        )


# ------------------------------------------------------------------ what the strategies (Trainer and Fabric) share
def saves_trainable_only(model: nn.Module, *, option: bool | None) -> bool:
    """Whether checkpoints leave frozen parameters out: the ``save_trainable_only`` option, or (None) whenever any
    parameter of ``model`` is frozen."""
    if option is not None:
        return option
    return any(not p.requires_grad for p in model.parameters())


def checkpoint_settings(*, options: Any, trainable_only: bool, world_size: int) -> dict[str, Any]:
    """What a checkpoint records about how it was saved (its ``"fsdp_plus"`` entry; loading reads
    ``trainable_only``)."""
    return {"state_dict_type": options.state_dict_type, "trainable_only": trainable_only,
            "sharding_strategy": options.sharding_strategy.value, "world_size": world_size}  # fmt: skip


def model_state(model: nn.Module, *, full: bool, trainable_only: bool) -> dict[str, Any]:
    """The model's state dict in our format: this rank's shards, or (``full``) the whole state on CPU, rank 0."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with torch.inference_mode(False):
        return get_model_state_dict(model, options=state_dict_options(full=full, trainable_only=trainable_only))


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool, trainable_only: bool
) -> dict[str, Any]:
    """This rank's optimizer state; ``full``: the whole state on rank 0 (empty elsewhere) keyed by parameter ids
    like ``torch.optim.Optimizer.state_dict``, so DDP or one device can resume it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = state_dict_options(full=full, trainable_only=trainable_only)
    with torch.inference_mode(False):
        state = get_optimizer_state_dict(model, getattr(optimizer, "_optimizer", optimizer), options=options)
    return optimizer_state_by_ids(state) if full else state


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer, *, trainable_only: bool) -> list[str]:
    """The parameter names of ``optimizer``'s groups, in order (what a state keyed by ids is re-keyed by)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer,
                                     options=state_dict_options(full=False, trainable_only=trainable_only))  # fmt: skip
    return [name for group in named["param_groups"] for name in group["params"]]


def load_into(
    path: Path,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    trainable_only: bool,
) -> dict[str, Any]:
    """Load a sharded or full checkpoint into ``model`` and ``optimizers`` (resharding as needed); returns what
    else it holds (the metadata, or the full file less its model and optimizer states). ``trainable_only``: whether
    the running model saves trainable parameters only (how a full optimizer state's ids map to names)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if is_sharded_checkpoint(path):
        if optimizers:
            check_optimizer_count(configured=len(optimizers), saved=saved_optimizer_count(path))
        return load_sharded(path, model=model, optimizers=optimizers, strict=strict)
    checkpoint = load_full(path)
    saved_trainable_only = checkpoint.get("fsdp_plus", {}).get("trainable_only", False)
    options = StateDictOptions(full_state_dict=True, strict=strict and not saved_trainable_only)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    optimizer_states = checkpoint.pop("optimizer_states", [])
    if optimizers:
        check_optimizer_count(configured=len(optimizers), saved=len(optimizer_states))
    for optimizer, state in zip(optimizers, optimizer_states, strict=True):
        # DDP and single-device checkpoints key the state by parameter id
        names = optimizer_param_names(model, optimizer, trainable_only=trainable_only)
        state = optimizer_state_by_names(state, names=names)
        if not load_param_groups_only(optimizer, state):  # plain SGD: no state tensors, which torch requires
            set_optimizer_state_dict(model, optimizer, state, options=options)
    return checkpoint
