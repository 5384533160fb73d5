"""``fsdp-plus-export``'s reading of the run that wrote a checkpoint (the export itself runs in
tests/test_checkpoint_distributed.py and tests/examples)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from lightning_fsdp_plus.app.config.shipped import SHIPPED_RESOLVER, register_shipped_resolver
from lightning_fsdp_plus.export import run_base
from tests.helpers.launch import REPO


def test_the_base_of_a_shipped_experiments_run_is_found_in_a_fresh_process(tmp_path: Path):
    """A run of ``experiment=medical_lora`` saves ``model.name_or_path: ${shipped:examples/assets/tiny-llama}``
    unresolved; ``fsdp-plus-export --merge`` (a process that never composed a config) resolves it too."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("model:\n  name_or_path: ${shipped:examples/assets/tiny-llama}\n")
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {tmp_path}\n")
    OmegaConf.clear_resolver(SHIPPED_RESOLVER)  # as in a fresh process
    try:
        assert run_base(run / "checkpoints" / "last.ckpt") == REPO / "examples" / "assets" / "tiny-llama"
    finally:
        register_shipped_resolver()


def test_merge_of_a_full_fine_tune_writes_its_weights_in_the_base_architecture(tmp_path: Path):
    """No adapter to merge: the checkpoint's own weights (LightningModule prefix dropped, tied head kept tied) with
    the base's config, loadable by transformers; weights of another model are refused."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_plus.export import CheckpointError, export_merged
    from tests.helpers.models import tiny_llama

    base, tuned = tiny_llama(0, tied=True), tiny_llama(1, tied=True)
    base.save_pretrained(tmp_path / "base")
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in tuned.state_dict().items() if k != "lm_head.weight"}}
    export_merged(checkpoint, tmp_path / "out", base=tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in tuned.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    other = {"state_dict": {"model.model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}}
    with pytest.raises(CheckpointError, match=r"do not fit .* unexpected"):
        export_merged(other, tmp_path / "bad", base=tmp_path / "base")
