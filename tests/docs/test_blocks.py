"""Every code block of the README and the docs is run, checked, or says why it cannot be (tests/helpers/docs.py).

The blocks marked ``doc-test`` are run by the tests that name them (the README's walkthrough by the app's tests, its
sweep by the multirun test, the demo by the examples' tests); this module runs the cheap ones itself and checks the
rest: Python blocks compile, import and construct their strategies; command blocks compose and validate as the app
does before it starts a process, and the estimator's lines run (their printed output compared where the page shows
it).
"""

from __future__ import annotations

import ast
import re
import shlex

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from tests.helpers.docs import (
    Block,
    all_blocks,
    command_lines,
    doc_commands,
    join_continuations,
    marker_problems,
)
from tests.helpers.launch import REPO

BLOCKS = all_blocks()
CHECKED = [b for b in BLOCKS if b.kind == "doc-check"]


def test_every_block_is_run_checked_or_says_why_not():
    assert not marker_problems(BLOCKS), "\n".join(marker_problems(BLOCKS))
    names = [b.argument for b in BLOCKS if b.kind == "doc-test"]
    sources = "".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    unread = [n for n in names if not re.search(rf"doc_(block|commands)\(\"{re.escape(n)}\"\)", sources)]
    assert not unread, f"doc-test blocks no test reads: {unread}"


def test_a_block_without_its_marker_or_reason_is_reported(tmp_path, monkeypatch):
    """The marker check can fail: a bash block without a marker, a not-run without a reason, an unlabelled fence."""
    import tests.helpers.docs as docs

    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\nfsdp-plus-train\n```\n\n<!-- not-run: too short -->\n```bash\nx\n```\n"
        "\n```\nplain\n```\n<!-- doc-check: commands -->\n<!-- --8<-- [start:x] -->\n```bash\ny\n```\n"
    )
    monkeypatch.setattr(docs, "REPO", tmp_path)
    problems = marker_problems(docs.blocks(page))
    assert problems == ["page.md:3: a bash block without a doc-test/doc-check/not-run marker",
                        "page.md:8: not-run needs its reason, got 'too short'",
                        "page.md:12: language ''; use one of ('bash', 'python', 'console') or text"]  # fmt: skip


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    demo, test = doc_commands("setup")
    assert demo == ["bash", "scripts/demo.sh"] and test == ["bash", "scripts/test.sh"]
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == "bash scripts/test.sh"
    # every link into docs/ names a page that exists
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / target).is_file(), target


def test_the_readmes_estimate_block_runs():
    from lightning_fsdp_plus.memory.cli import run

    [command] = doc_commands("estimate")
    out = run(command[2:])  # scripts/run fsdp-plus-estimate ...
    assert "LoRA r=16, int8 base" in out and re.search(r"^FULL_SHARD\s+8\s+8\s", out, re.M), out


@pytest.mark.parametrize("block", [b for b in CHECKED if b.argument == "python"], ids=lambda b: b.where)
def test_python_blocks_import_and_construct_their_strategies(block: Block):
    tree = ast.parse(block.text, filename=block.where)
    namespace: dict = {}
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(body=imports, type_ignores=[]), block.where, "exec"), namespace)
    namespace.setdefault("FSDPPlusStrategy", __import__("lightning_fsdp_plus").FSDPPlusStrategy)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("FSDPPlusStrategy", "FSDPPlusOptions")]  # fmt: skip
    for call in calls:  # literal arguments only: a docs example says what it passes
        eval(compile(ast.Expression(body=call), block.where, "eval"), namespace)


def _sweep_combinations(overrides: list[str]) -> list[list[str]]:
    """A multirun's jobs, as Hydra's basic sweeper splits ``a=x,y b=1`` into ``[a=x b=1], [a=y b=1]``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    [combinations] = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return combinations


def _app_overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides of an ``fsdp-plus-train`` (or ``python -m ...app.train``) line, its flags dropped."""
    args = argv[argv.index("lightning_fsdp_plus.app.train") + 1 :] if argv[0] == "python" else argv[1:]
    overrides, skip = [], False
    for arg in args:
        if skip or arg in ("-m", "--multirun"):
            skip = False
            continue
        if arg == "--cfg":
            skip = True
            continue
        overrides.append(arg)
    return overrides


def _user_paths_missing(message: str) -> bool:
    """A validation error about a file or model directory the example leaves to the reader (theirs, not ours)."""
    return "not found (relative to" in message or "does not exist (relative to" in message


def _compose_and_validate(overrides: list[str]) -> str | None:
    """Compose as the app does and validate; the error text, or None when the config is valid."""
    from lightning_fsdp_plus.app.config import register_configs
    from lightning_fsdp_plus.app.config.validate import validate_run_config

    register_configs()
    app = [o for o in overrides if not o.startswith(("hydra.", "hydra/"))]  # the launcher's, not the run's
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("lightning_fsdp_plus.conf", version_base="1.3"):
            for combination in _sweep_combinations(app):
                validate_run_config(compose("config", overrides=combination))
    except Exception as err:
        chain = [err]
        while chain[-1].__cause__ is not None:  # Hydra's composition error holds OmegaConf's in its cause
            chain.append(chain[-1].__cause__)
        return "\n".join(f"{type(e).__name__}: {e}" for e in chain)
    finally:
        GlobalHydra.instance().clear()
    return None


def _console_commands(block: Block) -> list[tuple[list[str], list[str]]]:
    """A console transcript's ``$`` commands, each with the output lines the page shows after it."""
    commands = []
    for line in join_continuations(block.text).splitlines():
        if line.startswith("$ "):
            commands.append((shlex.split(line[2:], comments=True), []))
        elif commands and line.strip():
            commands[-1][1].append(line)
    return commands


def _shown_lines_match(shown: list[str], printed: str) -> list[str]:
    """The shown lines that the printed text lacks (a trailing ``...`` ends a shown line early)."""
    normal = [" ".join(line.split()) for line in printed.splitlines()]
    missing = []
    for line in shown:
        want = " ".join(line.split()).removesuffix("...").strip()
        if not any(have.startswith(want) or want in have for have in normal):
            missing.append(line)
    return missing


@pytest.mark.parametrize("block", [b for b in CHECKED if b.argument == "commands"], ids=lambda b: b.where)
def test_command_blocks_compose_validate_and_run(block: Block, monkeypatch):
    from lightning_fsdp_plus.app.generate import build_parser as generate_parser
    from lightning_fsdp_plus.export import build_parser as export_parser
    from lightning_fsdp_plus.memory.cli import run as estimate

    monkeypatch.chdir(REPO)
    if block.language == "console":
        commands = _console_commands(block)
    else:
        commands = [(argv, []) for argv in command_lines(block.text)]
    assert commands, block.where
    for argv, shown in commands:
        if argv[0] == "scripts/run":
            argv = argv[1:]
        tool = argv[0] if argv[0] != "python" else "fsdp-plus-train"
        if tool == "fsdp-plus-estimate":
            printed = estimate(argv[1:])
            assert not _shown_lines_match(shown, printed), (block.where, argv, printed)
        elif tool == "fsdp-plus-train":
            error = _compose_and_validate(_app_overrides(argv))
            if shown:  # a transcript of an error: the page shows what the app says
                assert error is not None and not _shown_lines_match(shown, error), (block.where, argv, error)
            else:
                assert error is None or _user_paths_missing(error), (block.where, argv, error)
        elif tool in ("fsdp-plus-export", "fsdp-plus-generate"):
            parser = export_parser() if tool == "fsdp-plus-export" else generate_parser()
            parser.parse_args(argv[1:])  # arguments the tool takes (the run directory is the reader's)
        else:
            pytest.fail(f"{block.where}: no check for {argv[0]!r}; mark the block not-run with the reason")


def test_snippet_includes_name_sections_that_exist():
    """``--8<-- "README.md:NAME"`` in a page includes a README section; a missing one would render empty."""
    readme = (REPO / "README.md").read_text()
    for page in (REPO / "docs").rglob("*.md"):
        for name in re.findall(r'--8<-- "README\.md:([\w-]+)"', page.read_text()):
            assert f"<!-- --8<-- [start:{name}] -->" in readme and f"<!-- --8<-- [end:{name}] -->" in readme, name
