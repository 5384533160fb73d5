"""What the pages promise about the code: troubleshooting covers every exception class the package defines."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import lightning_fsdp_plus
from tests.helpers.launch import REPO


def exception_classes() -> set[str]:
    """Every exception class defined (not imported) in a module of the package."""
    found = set()
    for info in pkgutil.walk_packages(lightning_fsdp_plus.__path__, prefix="lightning_fsdp_plus."):
        if info.name.startswith(("lightning_fsdp_plus.conf", "lightning_fsdp_plus.examples")):  # data, not code
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                found.add(name)
    return found


def test_troubleshooting_has_a_section_for_every_exception_class_we_define():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^## `(\w+)`", page, re.M))
    classes = exception_classes()
    assert {"CheckpointError", "ConfigError", "NoFitError", "PretrainedLoadError"} <= classes  # the walk finds them
    assert classes <= headings, f"no troubleshooting section for {sorted(classes - headings)}"
