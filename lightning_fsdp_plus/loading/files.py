"""Which safetensors files hold a pretrained checkpoint, and what they say about each tensor (headers only).

A checkpoint directory is what ``save_pretrained`` writes: ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. A name that is not a local directory is looked up in the Hugging Face cache
through ``huggingface_hub`` (downloaded unless ``HF_HUB_OFFLINE=1``), as transformers does. Tensor shapes and
dtypes come from torch's ``HuggingFaceStorageReader`` (safetensors' own header reader), limited to the files
the index names. Every problem is a :class:`PretrainedLoadError` naming the file and the fix, raised on every
rank from the same files, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
"""The index ``save_pretrained`` writes next to sharded safetensors files."""
SINGLE_FILE = "model.safetensors"
"""The one file of an unsharded checkpoint."""
LEGACY_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")
"""Weight files streaming loading cannot read (pickles and other frameworks)."""


class PretrainedLoadError(ValueError):
    """A pretrained checkpoint that cannot be loaded as the model needs it (the message names file and key)."""


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor: its file, shape and stored dtype."""

    file: str
    """The safetensors file holding it."""
    shape: tuple[int, ...]
    """Its full shape."""
    dtype: torch.dtype
    """Its stored dtype."""

    @property
    def nbytes(self) -> int:
        """Bytes it takes in the file."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class CheckpointFiles:
    """A resolved checkpoint: its directory, its safetensors files and every tensor's header entry."""

    directory: Path
    """Local directory (a Hugging Face cache snapshot for hub ids)."""
    files: tuple[str, ...]
    """The safetensors files the checkpoint consists of (absolute paths)."""
    tensors: dict[str, TensorInfo] = field(repr=False)
    """Header entry of every tensor, by checkpoint key."""

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in all files."""
        return sum(info.nbytes for info in self.tensors.values())

    def where(self, key: str) -> str:
        """``key`` with the file that holds it, for messages."""
        return f"{key} (in {Path(self.tensors[key].file).name})"


def resolve_directory(name_or_path: str | Path) -> Path:
    """A local checkpoint directory: ``name_or_path`` itself, or its snapshot in the Hugging Face cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise PretrainedLoadError(f"model.name_or_path={str(name_or_path)!r} is a file; give the checkpoint directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        snapshot = snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except (HFValidationError, OSError, ValueError) as err:  # offline misses, unknown ids, invalid names
        raise PretrainedLoadError(
            f"model.name_or_path={str(name_or_path)!r} is not a local directory and could not be found in or"
            f" downloaded to the Hugging Face cache: {err}"
        ) from err
    return Path(snapshot)


def safetensors_files(directory: Path) -> tuple[str, ...]:
    """The checkpoint's safetensors files: those the index names (each must exist), else ``model.safetensors``."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise PretrainedLoadError(f"{index} is not a safetensors index (no readable weight_map): {err}") from err
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (directory / name).is_file():
                key = next(k for k, v in weight_map.items() if v == name)
                raise PretrainedLoadError(
                    f"{index} names {name} (holding {key} and others), but {directory / name} does not exist: the"
                    " download or copy is incomplete; fetch the missing shard again"
                )
        return tuple(str(directory / name) for name in names)
    single = directory / SINGLE_FILE
    if single.is_file():
        return (str(single),)
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if others:
        return tuple(str(directory / name) for name in others)
    legacy = [name for name in LEGACY_WEIGHTS if (directory / name).exists()]
    found = f" (it has {', '.join(legacy)})" if legacy else ""
    raise PretrainedLoadError(
        f"{directory} has no *.safetensors weights{found}: streaming loading reads only the slices each rank needs,"
        " which needs safetensors. Convert once with `AutoModelForCausalLM.from_pretrained(DIR)"
        ".save_pretrained(NEW_DIR)` (writes safetensors), or load the old way with model.low_memory_load=false"
        " (every rank then holds the whole model while loading)"
    )


class _ListedFiles:
    """A DCP file system that lists only the checkpoint's own files (a directory may hold others)."""

    def __init__(self, fs: Any, files: tuple[str, ...]) -> None:
        self._fs, self._files = fs, files

    def ls(self, path: Any) -> list[str]:
        return list(self._files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def storage_reader(checkpoint: CheckpointFiles) -> Any:
    """torch's ``HuggingFaceStorageReader`` over exactly the checkpoint's files."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(checkpoint.directory))
    reader.fs = _ListedFiles(reader.fs, checkpoint.files)
    return reader


def read_checkpoint(name_or_path: str | Path) -> CheckpointFiles:
    """Resolve ``name_or_path`` and read every file's header (shapes, dtypes); no tensor data is read."""
    directory = resolve_directory(name_or_path)
    files = safetensors_files(directory)
    tensors: dict[str, TensorInfo] = {}
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    view = handle.get_slice(key)
                    dtype = _safetensors_dtype(view.get_dtype(), file=file, key=key)
                    tensors[key] = TensorInfo(file=file, shape=tuple(view.get_shape()), dtype=dtype)
        except PretrainedLoadError:
            raise
        except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
            raise PretrainedLoadError(
                f"{file} cannot be read: {err}. The file is truncated or corrupt (an interrupted download or copy);"
                " fetch it again"
            ) from err
    return CheckpointFiles(directory=directory, files=files, tensors=tensors)


def _safetensors_dtype(name: str, *, file: str, key: str) -> torch.dtype:
    from safetensors.torch import _getdtype

    try:
        return _getdtype(name)
    except Exception as err:
        raise PretrainedLoadError(f"{key} in {file} has dtype {name}, which torch cannot hold") from err
