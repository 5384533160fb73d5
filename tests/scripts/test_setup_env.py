"""scripts/setup_env.sh: the demo's set-up installs what a user of the library needs, the tests' set-up the tooling
too, and each says what it installs (DRY_RUN=1 prints the plan for a fresh environment and stops)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import REPO

TOOLS = ("bash", "cat", "sha256sum", "cut", "id", "ls", "dirname", "python3", "apt-get")


@pytest.fixture
def no_browser_path(tmp_path) -> str:
    """A PATH with the tools the script uses and no Chromium: a fresh machine without a browser."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def plan(use: str, *, venv: Path, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "VENV": str(venv), "DRY_RUN": "1"}
    return subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh"), use], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_demo_installs_the_runtime_and_tcmalloc_only_and_the_tests_add_their_tooling(tmp_path, no_browser_path):
    run = plan("run", venv=tmp_path / "fresh", path=no_browser_path)
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert "torch 2.13.0 (CPU build), lightning-fsdp-plus[app] (editable)" in out
    assert "chromium" not in out and "[dev]" not in out  # no browser, no test tooling for the demo
    test = plan("test", venv=tmp_path / "fresh", path=no_browser_path)
    out = test.stdout + test.stderr
    assert test.returncode == 0 and "lightning-fsdp-plus[dev] (editable)" in out and "chromium-headless-shell" in out
    assert "litgpt (without its dependencies)" in out and "litgpt" not in run.stdout + run.stderr
    assert not (tmp_path / "fresh").exists()  # a dry run installs nothing
    bad = plan("docs", venv=tmp_path / "fresh", path=no_browser_path)
    assert bad.returncode == 2 and "use='docs' is not one of run, test" in bad.stderr


def test_scripts_ask_for_their_own_use():
    assert "bash scripts/setup_env.sh run " in (REPO / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup_env.sh test " in (REPO / "scripts" / "test.sh").read_text()
