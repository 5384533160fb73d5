"""Rewrite the README's generated tables from the code that defines them (run before a release).

    python scripts/render_docs.py          # rewrite README.md in place
    python scripts/render_docs.py --check  # exit 1 if README.md is out of date

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from lightning_fsdp_plus.compat import compat_markdown
from lightning_fsdp_plus.options import options_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
TABLES = {"options-table": options_markdown, "fsdpstrategy-table": compat_markdown}


def replace_block(text: str, name: str, content: str) -> str:
    """``text`` with the block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced by ``content``."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no <!-- {name}:start --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + content + m.group(2), text)


def render(text: str) -> str:
    """``text`` with every marked table replaced by its generated content."""
    for name, make in TABLES.items():
        text = replace_block(text, name, make())
    return text


def main() -> int:
    """Rewrite (or with --check, compare) README.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = README.read_text()
    rendered = render(text)
    if args.check:
        print("README.md is up to date" if rendered == text else "README.md is out of date: run render_docs.py")
        return 0 if rendered == text else 1
    README.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
