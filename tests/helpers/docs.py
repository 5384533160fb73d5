"""The code blocks of the README and the documentation pages, and the markers that say how each is checked.

A fenced block carries one marker on a line just above it (snippet section markers may stand between):

- ``<!-- doc-test: NAME -->``: a test runs it, reading it with :func:`doc_block` (``tests/docs`` checks that some
  test file names it);
- ``<!-- doc-check: python -->``: it compiles, its imports import, and every ``FSDPPlusStrategy(...)`` /
  ``FSDPPlusOptions(...)`` call in it constructs (the options validate);
- ``<!-- doc-check: commands -->``: every ``fsdp-plus-estimate`` line runs, every ``fsdp-plus-train`` line composes
  and validates (a sweep's values one by one), as the app would before starting a process;
- ``<!-- not-run: REASON -->``: it needs what no test machine has (a GPU, a cluster, a hub model, half an hour);
- no marker for ``text`` blocks: output, not something to run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.launch import REPO

MARKER = re.compile(r"<!-- (doc-test|doc-check|not-run): (.+?) -->")
SNIPPET_MARKER = re.compile(r"<!-- --8<-- \[(start|end):[\w-]+\] -->")
COMMAND_LANGUAGES = ("bash", "python", "console")
"""Languages of blocks that are something to run; every other block must be ``text``."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its marker (kind and argument)."""

    page: str
    line: int
    language: str
    text: str
    kind: str | None
    argument: str | None

    @property
    def where(self) -> str:
        """``page:line`` for messages."""
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of ``docs/``."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` with the marker above it (if any)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    name = str(page.relative_to(REPO))
    while i < len(lines):
        if lines[i].startswith("```"):
            language, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            kind = argument = None
            above = i - 1
            while above >= 0 and SNIPPET_MARKER.fullmatch(lines[above].strip()):
                above -= 1
            if above >= 0 and (match := MARKER.fullmatch(lines[above].strip())):
                kind, argument = match.groups()
            found.append(Block(name, start + 1, language, "\n".join(lines[i + 1 : end]) + "\n", kind, argument))
            i = end + 1
        else:
            i += 1
    return found


def all_blocks() -> list[Block]:
    """Every fenced block of the README and the docs."""
    return [block for page in pages() for block in blocks(page)]


def marker_problems(found: list[Block]) -> list[str]:
    """What is wrong with the blocks' markers: a language that is neither something to run nor ``text``, a block to
    run without a marker, an unknown check, a ``not-run`` without its reason, a ``doc-test`` name used twice."""
    problems = []
    for block in found:
        if block.language not in (*COMMAND_LANGUAGES, "text"):
            problems.append(f"{block.where}: language {block.language!r}; use one of {COMMAND_LANGUAGES} or text")
        elif block.language != "text" and block.kind is None:
            problems.append(f"{block.where}: a {block.language} block without a doc-test/doc-check/not-run marker")
        elif block.kind == "doc-check" and block.argument not in ("python", "commands"):
            problems.append(f"{block.where}: doc-check {block.argument!r}; valid: python, commands")
        elif block.kind == "not-run" and len(block.argument or "") < 30:
            problems.append(f"{block.where}: not-run needs its reason, got {block.argument!r}")
    names = [b.argument for b in found if b.kind == "doc-test"]
    problems += [f"doc-test {name!r} is used {names.count(name)} times" for name in sorted(set(names))
                 if names.count(name) > 1]  # fmt: skip
    return problems


def doc_block(name: str) -> str:
    """The text of the block marked ``<!-- doc-test: NAME -->`` (exactly one must exist)."""
    [block] = [b for b in all_blocks() if b.kind == "doc-test" and b.argument == name]
    return block.text


def join_continuations(text: str) -> str:
    """A shell text with its backslash-continued lines joined into one line each."""
    return re.sub(r"\\\n\s*", " ", text)


def command_lines(text: str) -> list[list[str]]:
    """A shell block's commands, each as argv: continuation lines joined, comments dropped."""
    joined = join_continuations(text)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def doc_commands(name: str) -> list[list[str]]:
    """The commands of the block marked ``<!-- doc-test: NAME -->``."""
    return command_lines(doc_block(name))
