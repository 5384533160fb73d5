"""The package's shape: no import cycle, and the library does not load the app's dependencies."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.launch import REPO, subprocess_env

PACKAGE = REPO / "lightning_fsdp_plus"
APP_ONLY = ("hydra", "omegaconf", "datasets", "matplotlib")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every package module -> the package modules it imports (top-level and inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from pkg import mod` names a submodule when one exists, else an attribute of pkg
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "lightning_fsdp_plus.pipeline" in graph["lightning_fsdp_plus.memory.estimate"]
    assert find_cycle(graph) is None, find_cycle(graph)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def test_the_library_imports_no_app_dependency_and_every_module_imports():
    script = """
import importlib, json, pkgutil, sys
import lightning.pytorch
before = set(sys.modules)
import lightning_fsdp_plus
added = sorted({m.split('.')[0] for m in set(sys.modules) - before})
names = [m.name for m in pkgutil.walk_packages(lightning_fsdp_plus.__path__, 'lightning_fsdp_plus.')]
for name in names:
    importlib.import_module(name)
print(json.dumps({"added": added, "imported": names}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                          cwd=REPO, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not set(result["added"]) & set(APP_ONLY), result["added"]
    assert "lightning_fsdp_plus.app.train" in result["imported"] and len(result["imported"]) > 25


def test_the_wheel_lists_every_package():
    # setuptools' explicit package list silently drops a package nobody added (app/ was missing from the wheel)
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    source = REPO / "lightning_fsdp_plus"
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in source.rglob("__init__.py")}
    assert packages - listed == set(), sorted(packages - listed)
    assert "lightning_fsdp_plus.app" in packages and "lightning_fsdp_plus.conf" in listed


def test_the_runner_puts_the_commands_on_path_without_activation():
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # no .venv on PATH: the runner must add it
    ok = subprocess.run([str(REPO / "scripts" / "run"), "fsdp-plus-estimate", "--params", "1e9", "--world-size", "2",
                         "--strategy", "full_shard"], capture_output=True, text=True, env=env, cwd="/")  # fmt: skip
    assert ok.returncode == 0 and "FULL_SHARD" in ok.stdout, ok.stderr
    usage = subprocess.run([str(REPO / "scripts" / "run")], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage: scripts/run COMMAND" in usage.stderr
