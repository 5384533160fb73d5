"""``bash scripts/test.sh --quick``: pytest's ``--quick`` keeps every module's single-process tests and the chosen
launches, and leaves the other launches out (what it selects, collected in a fresh pytest)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import QUICK_LAUNCHES
from tests.helpers.launch import REPO, subprocess_env


def _collected(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_quick_lane_keeps_each_modules_unit_tests_and_one_launch_per_feature():
    everything, quick = _collected(), _collected("--quick")
    assert set(QUICK_LAUNCHES) <= quick < everything
    left_out = everything - quick
    assert any(n.startswith("tests/slurm/") for n in left_out) and not any(n.startswith("tests/slurm/") for n in quick)
    assert not any("_distributed.py" in n for n in quick - set(QUICK_LAUNCHES))
    test_files = {n.split("::")[0] for n in everything}
    for module in ("tests/test_options.py", "tests/test_policies.py", "tests/memory/test_timeline.py",
                   "tests/test_loss.py", "tests/autoplan/test_budget.py", "tests/config/test_compose.py"):  # fmt: skip
        assert module in test_files and all(n in quick for n in everything if n.startswith(module + "::")), module
