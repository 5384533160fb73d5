"""Rewrite the documentation's generated parts from the code that defines them (run before a release).

    python scripts/render_docs.py          # rewrite the pages in place
    python scripts/render_docs.py --check  # exit 1 if a page is out of date (the tests run this)

Each generated part sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers in a page of ``docs/``:
the options table (``FSDPPlusOptions``' one declaration), the ``FSDPStrategy`` argument mapping, the command-line
tools' ``--help`` texts and the Hydra config groups and keys (``conf/`` and the schema's dataclasses).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CONF = REPO / "conf"
HELP_COLUMNS = "100"
"""Terminal width the ``--help`` texts are rendered at (argparse reads ``COLUMNS``)."""


def replace_block(text: str, name: str, content: str, *, where: str) -> str:
    """``text`` with the block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced by ``content``."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{where} has no <!-- {name}:start --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + content + m.group(2), text)


def cli_markdown() -> str:
    """Every console command's ``--help``, as argparse prints it at ``HELP_COLUMNS`` columns."""
    from lightning_fsdp_plus.app.generate import build_parser as generate_parser
    from lightning_fsdp_plus.export import build_parser as export_parser
    from lightning_fsdp_plus.memory.cli import build_parser as estimate_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        sections = []
        for name, build in (("fsdp-plus-estimate", estimate_parser), ("fsdp-plus-export", export_parser),
                            ("fsdp-plus-generate", generate_parser)):  # fmt: skip
            sections.append(f"## `{name}`\n\n```text\n$ {name} --help\n{build().format_help().rstrip()}\n```\n")
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n" + "\n".join(sections)  # a blank line after the start marker: the first heading stands alone


def _preset_description(path: Path) -> str:
    """A preset's leading comment lines, joined (what it is for), or an empty string."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("@package"):
            lines.append(text)
    return " ".join(lines).replace("|", "\\|")


def groups_markdown() -> str:
    """Every config group in ``conf/``, each option with its own leading comment, the default marked."""
    from omegaconf import OmegaConf

    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    rows = ["| group | option | what it is |", "|---|---|---|"]
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for preset in sorted(group.glob("*.yaml")):
            default = " (default)" if defaults.get(group.name) == preset.stem else ""
            rows.append(f"| `{group.name}` | `{preset.stem}`{default} | {_preset_description(preset)} |")
    return "\n".join(rows) + "\n"


def _type_text(annotation: object) -> str:
    """A field's type as a reader writes it: ``int | None``, ``list[str]``, a schema's name."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("lightning_fsdp_plus.app.config.schema.", "").replace("|", "\\|")


def _default_text(item: dataclasses.Field) -> str:
    """A field's default as YAML would hold it (``???`` when required)."""
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        return "`???`"
    if dataclasses.is_dataclass(value):
        return "(group)"
    value = getattr(value, "value", value)  # enums read as their value in YAML
    return f"`{value!r}`".replace("|", "\\|") if value is not None else "`null`"


def keys_markdown() -> str:
    """Every key the app reads, from ``RunSchema`` down, with its type, default and docstring."""
    from lightning_fsdp_plus.app.config.schema import (
        InstructionDataSchema,
        RunSchema,
        StrategySchema,
        SyntheticDataSchema,
    )
    from lightning_fsdp_plus.options import field_docs

    sections = []

    def table(cls: type, prefix: str) -> None:
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        rows, nested = [f"### `{prefix or '<top level>'}` ({cls.__name__})", "", "| key | type | default | meaning |",
                        "|---|---|---|---|"], []  # fmt: skip
        for item in dataclasses.fields(cls):
            kind = hints.get(item.name, item.type)
            key = f"{prefix}.{item.name}" if prefix else item.name
            meaning = docs.get(item.name, "")
            if kind is StrategySchema:  # its fields are the options: their own page lists them
                meaning = "every `FSDPPlusOptions` field, typed for Hydra: see the options reference"
            elif dataclasses.is_dataclass(kind):
                nested.append((kind, key))
            rows.append(f"| `{key}` | {_type_text(kind)} | {_default_text(item)} | {meaning.replace('|', '/')} |")
        sections.append("\n".join(rows) + "\n")
        for kind, key in nested:
            table(kind, key)

    table(RunSchema, "")
    table(SyntheticDataSchema, "data (data=synthetic)")
    table(InstructionDataSchema, "data (data=instruction, medical, legal)")
    return "\n".join(sections)


def _options_markdown() -> str:
    from lightning_fsdp_plus.options import options_markdown

    return options_markdown()


def _compat_markdown() -> str:
    from lightning_fsdp_plus.compat import compat_markdown

    return compat_markdown()


PAGES: dict[str, dict[str, Callable[[], str]]] = {
    "reference/options.md": {"options-table": _options_markdown},
    "migrating.md": {"fsdpstrategy-table": _compat_markdown},
    "reference/cli.md": {"cli-help": cli_markdown},
    "reference/hydra.md": {"hydra-groups": groups_markdown, "hydra-keys": keys_markdown},
}
"""Each page of ``docs/`` with generated parts: block name -> what writes it."""


def render(text: str, blocks: dict[str, Callable[[], str]], *, where: str) -> str:
    """``text`` with every named block replaced by its generated content."""
    for name, make in blocks.items():
        text = replace_block(text, name, make(), where=where)
    return text


def stale_pages(*, docs: Path = DOCS, write: bool = False) -> list[str]:
    """The pages whose generated parts differ from the code (rewritten when ``write``)."""
    stale = []
    for page, blocks in PAGES.items():
        path = docs / page
        text = path.read_text()
        rendered = render(text, blocks, where=f"docs/{page}")
        if rendered != text:
            stale.append(f"docs/{page}")
            if write:
                path.write_text(rendered)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, compare) the generated parts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = stale_pages(write=not args.check)
    if args.check:
        print(f"out of date: {', '.join(stale)}; run scripts/render_docs.py" if stale else "docs are up to date")
        return 1 if stale else 0
    print(f"rewrote {', '.join(stale)}" if stale else "nothing to rewrite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
