"""MkDocs hooks for the documentation site (``hooks:`` in ``mkdocs.yml``).

Our docstrings cross-reference in Sphinx's roles (``:class:`ShardingPlan```, ``:mod:`~pkg.module```), which
mkdocstrings renders as the role's text followed by the code; this shows the code alone, shortened after ``~`` as
Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

SPHINX_ROLE = re.compile(r":(?:class|mod|func|meth|attr|obj|data|exc|const):<code>(~?)([\w.]+)</code>")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """The page's HTML with Sphinx roles shown as code."""
    return SPHINX_ROLE.sub(_role, html)
