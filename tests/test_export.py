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
