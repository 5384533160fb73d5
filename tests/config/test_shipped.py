"""The shipped experiments find their files from any working directory, from a checkout and from an installed wheel
(issue 35: ``fsdp-plus-train experiment=medical_lora`` failed outside the repository root)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from lightning_fsdp_plus.app.config import register_configs, shipped
from lightning_fsdp_plus.app.config.shipped import shipped_path
from lightning_fsdp_plus.app.config.validate import validate_run_config
from tests.helpers.launch import REPO


@pytest.mark.parametrize("experiment", ["medical_lora", "legal_lora"])
def test_an_experiment_composes_and_validates_from_another_directory(experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_fsdp_plus.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}"])
    GlobalHydra.instance().clear()
    validate_run_config(cfg)  # the model directory and the data files exist
    assert cfg.model.name_or_path == str(REPO / "examples" / "assets" / "tiny-llama")
    assert [Path(f).parent for f in cfg.data.train_files] == [REPO / "examples" / experiment / "data"]


def test_a_path_shipped_nowhere_stays_as_given():
    assert shipped_path("examples/no-such-model") == "examples/no-such-model"


def test_the_wheel_carries_every_file_an_experiment_names(tmp_path, monkeypatch):
    """Built from the checkout and unpacked into a bare directory: every ``${shipped:...}`` path in conf/ is in the
    wheel, and resolves there when the package runs from it (no checkout around it)."""
    pattern = re.compile(r"\$\{shipped:(examples/[^}]+)\}")
    named = sorted({m for f in (REPO / "conf").rglob("*.yaml") for m in pattern.findall(f.read_text())})
    assert "examples/assets/tiny-llama" in named and len(named) >= 5
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                            "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    package = tmp_path / "site" / "lightning_fsdp_plus"
    monkeypatch.setattr(shipped, "PACKAGE_DIR", package)
    assert shipped.shipped_roots() == [package]
    for relative in named:
        assert shipped.shipped_path(relative) == str(package / relative), relative
    model = package / "examples" / "assets" / "tiny-llama"
    assert (model / "model.safetensors").stat().st_size == (
        REPO / "examples/assets/tiny-llama/model.safetensors"
    ).stat().st_size
