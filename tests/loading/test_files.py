"""Resolving a checkpoint and reading its headers: files from the index, and each broken input's message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lightning_fsdp_plus.loading.files import (
    INDEX_FILE,
    PretrainedLoadError,
    read_checkpoint,
    resolve_directory,
    storage_reader,
)
from tests.helpers.checkpoints import save_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "ckpt")


def test_the_index_names_the_files_and_every_header_is_read(llama_dir):
    checkpoint = read_checkpoint(llama_dir)
    index = json.loads((llama_dir / INDEX_FILE).read_text())["weight_map"]
    assert len(checkpoint.files) == len(set(index.values())) > 1
    assert set(checkpoint.tensors) == set(index)
    info = checkpoint.tensors["model.layers.0.mlp.up_proj.weight"]
    assert info.shape == (128, 64) and info.dtype == torch.bfloat16 and info.nbytes == 128 * 64 * 2
    assert checkpoint.nbytes == sum(i.nbytes for i in checkpoint.tensors.values())


def test_files_outside_the_index_are_not_read(llama_dir, tmp_path):
    ckpt = _copy(llama_dir, tmp_path)
    shutil.copy(ckpt / "model-00001-of-00004.safetensors", ckpt / "adapter_model.safetensors")  # same keys again
    checkpoint = read_checkpoint(ckpt)
    assert not any(f.endswith("adapter_model.safetensors") for f in checkpoint.files)
    metadata = storage_reader(checkpoint).read_metadata()  # torch's reader sees the listed files only
    assert set(metadata.state_dict_metadata) == set(checkpoint.tensors)
    assert all(len(md.chunks) == 1 for md in metadata.state_dict_metadata.values())


def test_only_pytorch_model_bin_names_the_fixes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(PretrainedLoadError) as err:
        read_checkpoint(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "pytorch_model.bin" in message
    assert "save_pretrained" in message and "low_memory_load=false" in message


def test_an_index_naming_a_missing_shard(llama_dir, tmp_path):
    ckpt = _copy(llama_dir, tmp_path)
    (ckpt / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(PretrainedLoadError) as err:
        read_checkpoint(ckpt)
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    key = next(k for k, v in weight_map.items() if v == "model-00003-of-00004.safetensors")
    message = str(err.value)
    assert INDEX_FILE in message and "model-00003-of-00004.safetensors" in message and key in message


def test_a_truncated_file(llama_dir, tmp_path):
    ckpt = _copy(llama_dir, tmp_path)
    shard = ckpt / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(PretrainedLoadError, match=r"model-00002-of-00004\.safetensors cannot be read.*truncated"):
        read_checkpoint(ckpt)


def test_a_single_file_checkpoint(tmp_path):
    from tests.helpers.checkpoints import tiny_causal_lm

    tiny_causal_lm("llama").save_pretrained(tmp_path)  # small enough for one model.safetensors
    checkpoint = read_checkpoint(tmp_path)
    assert [f.rsplit("/", 1)[-1] for f in checkpoint.files] == ["model.safetensors"]


def test_a_hub_id_resolves_through_the_cache_offline(llama_dir, tmp_path, monkeypatch):
    # the layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<commit>/...}
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_directory("acme/tiny-llama") == repo / "snapshots" / commit
    with pytest.raises(PretrainedLoadError, match=r"'acme/other'.*not a local directory"):
        resolve_directory("acme/other")
