"""``deferred_pretrained``: the model ``from_pretrained`` would build, without a weight, checked against the files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lightning_fsdp_plus.loading import PretrainedLoadError, deferred_pretrained, pretrained_source
from tests.helpers.checkpoints import save_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "llama_bf16": save_checkpoint(root / "llama_bf16", "llama"),
        "llama_fp32": save_checkpoint(root / "llama_fp32", "llama", dtype=torch.float32),
        "gpt2": save_checkpoint(root / "gpt2", "gpt2", dtype=torch.float32),
    }


@pytest.mark.parametrize(("name", "dtype"), [("llama_bf16", None), ("llama_fp32", None), ("llama_fp32", "bfloat16"),
                                             ("gpt2", None), ("gpt2", "bfloat16")])  # fmt: skip
def test_the_same_model_as_from_pretrained_on_meta(checkpoints, name, dtype):
    torch.manual_seed(0)
    rng = torch.random.get_rng_state()
    deferred = deferred_pretrained(checkpoints[name], dtype=dtype)
    assert torch.equal(rng, torch.random.get_rng_state())  # nothing drawn: LoRA init after it matches the old path
    loaded = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=getattr(torch, dtype) if dtype else None)
    params = dict(deferred.named_parameters(remove_duplicate=False))
    expected = dict(loaded.named_parameters(remove_duplicate=False))
    assert params.keys() == expected.keys()
    assert all(p.is_meta and p.dtype == expected[n].dtype and p.shape == expected[n].shape for n, p in params.items())
    buffers, expected_buffers = dict(deferred.named_buffers()), dict(loaded.named_buffers())
    assert buffers.keys() == expected_buffers.keys()
    assert all(torch.equal(b, expected_buffers[n]) for n, b in buffers.items())  # rotary inv_freq computed for real
    assert deferred.training is loaded.training is False
    assert deferred.config.name_or_path == str(checkpoints[name])
    if name == "gpt2":  # tied embeddings stay one tensor
        assert deferred.lm_head.weight is deferred.transformer.wte.weight
    source = pretrained_source(deferred)
    assert source is not None and source.checkpoint.directory == checkpoints[name]
    assert source.dtypes["model.embed_tokens.weight" if "llama" in name else "transformer.wte.weight"] == (
        getattr(torch, dtype) if dtype else next(loaded.parameters()).dtype
    )


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_a_config_that_does_not_match_the_weights(checkpoints, tmp_path):
    ckpt = shutil.copytree(checkpoints["llama_bf16"], tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps({**_config(ckpt), "intermediate_size": 96}))
    with pytest.raises(PretrainedLoadError) as err:
        deferred_pretrained(ckpt)
    message = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in message and ".safetensors" in message
    assert "[128, 64]" in message and "[96, 64]" in message and "config.json" in message


def _rewrite(ckpt, change):
    """Apply ``change`` to the whole state dict and save it as one file (the index removed)."""
    state = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(file))
        file.unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    save_file(change(state), ckpt / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_weight_is_named(checkpoints, tmp_path):
    ckpt = shutil.copytree(checkpoints["llama_bf16"], tmp_path / "ckpt")
    _rewrite(ckpt, lambda s: {k: v for k, v in s.items() if k != "model.layers.1.self_attn.o_proj.weight"})
    with pytest.raises(PretrainedLoadError, match=r"no weight for model\.layers\.1\.self_attn\.o_proj\.weight.*random"):
        deferred_pretrained(ckpt)


def test_an_already_quantized_checkpoint_is_refused(checkpoints, tmp_path):
    ckpt = shutil.copytree(checkpoints["llama_bf16"], tmp_path / "ckpt")
    key = "model.layers.0.mlp.down_proj.weight"
    _rewrite(ckpt, lambda s: {**s, key: s[key].to(torch.int8)})
    with pytest.raises(PretrainedLoadError, match=rf"{key} \(in model\.safetensors\) is stored as torch\.int8"):
        deferred_pretrained(ckpt)


def test_an_invalid_dtype(checkpoints):
    with pytest.raises(PretrainedLoadError, match=r"model\.torch_dtype='int8'.*bfloat16"):
        deferred_pretrained(checkpoints["llama_bf16"], dtype="int8")


def test_config_overrides_apply(checkpoints):
    model = deferred_pretrained(checkpoints["llama_bf16"], config_overrides={"attention_dropout": 0.25})
    assert model.config.attention_dropout == 0.25
