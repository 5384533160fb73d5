"""The files the shipped experiments use (the tiny Llama, the medical and legal instruction sets), found from any
working directory.

The experiments name them ``${shipped:examples/...}``: in a source checkout (or an editable install) that is the
repository's file, in an installed wheel the copy the wheel carries (``lightning_fsdp_plus/examples/``: the 3.1 MB
tiny Llama and both instruction sets, so ``fsdp-plus-train experiment=medical_lora`` runs anywhere). A relative path
given on the command line stays relative to the working directory, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

SHIPPED_RESOLVER = "shipped"
"""The resolver's name in configs: ``${shipped:examples/assets/tiny-llama}``."""
PACKAGE_DIR = Path(__file__).resolve().parents[2]
"""``lightning_fsdp_plus/``: the wheel's copy of ``examples/`` lives in it."""


def shipped_roots() -> list[Path]:
    """Where shipped files are looked for: the repository (when the package runs from a checkout: its parent has
    our pyproject.toml and conf/), then the package itself (an installed wheel)."""
    repository = PACKAGE_DIR.parent
    from_source = (repository / "pyproject.toml").is_file() and (repository / "conf").is_dir()
    return [repository, PACKAGE_DIR] if from_source else [PACKAGE_DIR]


def shipped_path(relative: str) -> str:
    """The absolute path of a shipped file or directory (``examples/...``), from the first of :func:`shipped_roots`
    that has it; ``relative`` unchanged when none does (the config check then names it)."""
    for root in shipped_roots():
        candidate = root / relative
        if candidate.exists():
            return str(candidate)
    return relative


PACKED_RESOLVER = "if_packed"
"""The resolver's name in configs: ``${if_packed:${data.pack},2,8}`` is 2 when ``data.pack`` is true, else 8."""


def if_packed(pack: bool, packed: Any, unpacked: Any) -> Any:
    """``packed`` when ``pack`` is true, else ``unpacked``: a shipped experiment's micro-batch in rows of packed
    examples or in examples, so that ``data.pack=false`` alone gives the unpacked run with as many examples a step."""
    return packed if pack else unpacked


def register_shipped_resolver() -> None:
    """Make ``${shipped:...}`` and ``${if_packed:...}`` resolvable (idempotent)."""
    if not OmegaConf.has_resolver(SHIPPED_RESOLVER):
        OmegaConf.register_new_resolver(SHIPPED_RESOLVER, shipped_path)
    if not OmegaConf.has_resolver(PACKED_RESOLVER):
        OmegaConf.register_new_resolver(PACKED_RESOLVER, if_packed)
