"""``torch.compile`` per FSDP unit, torchtitan's way: each unit's block compiled, then ``fully_shard``.

What is compiled is each unit module's ``forward`` (as an instance attribute, as Lightning's ``from_compiled`` and
``torch.compile``'s ``OptimizedModule`` do), so that:

- FSDP2's all-gather/reduce-scatter hooks and activation checkpointing's hooks run eagerly around the compiled
  block (nothing of FSDP is traced; ``fullgraph=True`` is possible);
- the module keeps its class, its name and its parameters' names: state dicts, checkpoints, LoRA export and
  ``get_submodule`` paths are those of an eager run;
- every block runs the same code, so dynamo compiles it once and reuses the graph for all of them (it guards on
  the module's structure, not its identity). A decoder layer given a key/value cache reads its ``layer_idx`` and
  would be compiled once per layer (until dynamo's cache limit, then run eagerly): while gradients are computed a
  compiled unit runs without a cache, as checkpointed layers do (:func:`~lightning_fsdp_plus.kv_cache.
  drop_cache_under_grad`).

The root unit is compiled only when it is the only unit: compiling it around compiled, sharded children would trace
through their FSDP hooks. :func:`compile_counters` reads dynamo's counters (graphs compiled, graph breaks) for the
reports and tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus._private import dynamo_counters
from lightning_fsdp_plus.kv_cache import drop_cache_under_grad

COMPILE_ARGUMENTS = ("backend", "mode", "fullgraph", "dynamic", "options")
"""The ``torch.compile`` arguments the ``compile`` option takes (as a dict)."""


@dataclass(frozen=True)
class CompileSpec:
    """How units are compiled: ``torch.compile``'s arguments, or the compiler of a module the user compiled."""

    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """``torch.compile`` arguments (a subset of :data:`COMPILE_ARGUMENTS`; empty: torch's defaults, inductor)."""
    context: Any = None
    """The dynamo context of ``torch.compile(module, ...)`` when ``trainer.fit`` was given a compiled
    LightningModule: applied to each unit instead of ``kwargs`` (the user's exact arguments)."""

    def compiler(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """``fn -> compiled fn``."""
        if self.context is not None:
            return self.context
        return functools.partial(torch.compile, **dict(self.kwargs))

    def describe(self) -> str:
        """``torch.compile(backend='eager', fullgraph=True)``, or where the arguments came from."""
        if self.context is not None:
            return "torch.compile with the arguments of the module passed to trainer.fit"
        return f"torch.compile({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


def compile_spec_from(value: Any, *, key: str = "compile") -> CompileSpec | None:
    """The ``compile`` option as a :class:`CompileSpec` (None: off). Raises ``ValueError`` naming the key, the value
    and the valid choices."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileSpec()
    if isinstance(value, CompileSpec):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(COMPILE_ARGUMENTS))
        if unknown:
            raise ValueError(
                f"{key} has {unknown[0]!r}={value[unknown[0]]!r}, which is not a torch.compile argument it takes;"
                f" valid keys: {', '.join(COMPILE_ARGUMENTS)}"
            )
        if "fullgraph" in value and not isinstance(value["fullgraph"], bool):
            raise ValueError(f"{key}.fullgraph={value['fullgraph']!r} must be true or false")
        if "dynamic" in value and value["dynamic"] is not None and not isinstance(value["dynamic"], bool):
            raise ValueError(f"{key}.dynamic={value['dynamic']!r} must be true, false or null (torch decides)")
        if "mode" in value and value["mode"] is not None and "options" in value and value["options"] is not None:
            raise ValueError(f"{key}: torch.compile takes mode or options, not both (mode={value['mode']!r})")
        if "options" in value and value["options"] is not None and not isinstance(value["options"], Mapping):
            raise ValueError(f"{key}.options={value['options']!r} must be a dict of inductor settings")
        backend = value.get("backend", "inductor")
        if not (isinstance(backend, str) or callable(backend)):
            raise ValueError(f"{key}.backend={backend!r} must be a backend name (e.g. 'inductor', 'eager') or callable")
        return CompileSpec(kwargs={k: _plain(v) for k, v in value.items()})
    raise ValueError(
        f"{key}={value!r} must be false, true, or a dict of torch.compile arguments ({', '.join(COMPILE_ARGUMENTS)})"
    )


def _plain(value: Any) -> Any:
    """OmegaConf containers (a Hydra config's ``options``) as plain dicts, which inductor's config accepts."""
    return dict(value) if isinstance(value, Mapping) else value


def from_compiled_module(module: Any, *, option: Any = False) -> CompileSpec | None:
    """For ``trainer.fit(torch.compile(module, ...))``: Lightning has turned the compiled module back into the
    LightningModule with its methods wrapped in the compiler (``_compiler_ctx``). Undo that (Lightning's
    ``to_uncompiled``: the whole module is never compiled around FSDP) and return the spec that compiles each unit
    with the same compiler; None for a module nobody compiled. ``option`` is the strategy's ``compile`` option: both
    at once is refused (which arguments would be meant?)."""
    compiler_ctx = getattr(module, "_compiler_ctx", None)
    if compiler_ctx is None:
        return None
    if option not in (False, None) and getattr(option, "context", None) is None:
        raise ValueError(
            f"compile={option!r} and a compiled module passed to trainer.fit: give one of them (trainer.fit(module)"
            " with compile=..., or trainer.fit(torch.compile(module, ...)) with compile=False)"
        )
    from lightning.pytorch.utilities.compile import to_uncompiled
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    to_uncompiled(module)
    rank_zero_info(
        "fsdp_plus: trainer.fit got a compiled LightningModule; compiling each FSDP unit's block with its"
        " torch.compile arguments instead of the whole module (the same as the option compile=<those arguments>)"
    )
    return CompileSpec(context=compiler_ctx["dynamo_ctx"])


def compiled_paths(unit_paths: Iterable[str]) -> tuple[str, ...]:
    """The units whose module is compiled: every non-root unit, or the root when it is the only unit."""
    paths = list(unit_paths)
    inner = tuple(p for p in paths if p)
    return inner or ("",)


def compile_units(model: nn.Module, paths: Iterable[str], *, spec: CompileSpec) -> None:
    """Compile the ``forward`` of each module at ``paths`` in place (before ``fully_shard``), with the hook that
    keeps a key/value cache out of the compiled block while gradients are computed."""
    compiler = spec.compiler()
    for path in paths:
        module = model.get_submodule(path) if path else model
        if getattr(module, "_fsdp_plus_compiled", False):
            continue  # a second setup (fit after validate) compiles nothing twice
        drop_cache_under_grad(module, why="a compiled layer given a cache reads its layer_idx: one compilation each")
        module.forward = compiler(module.forward)
        module._fsdp_plus_compiled = True


def compile_counters() -> dict[str, int]:
    """Dynamo's counts in this process so far: ``graphs`` compiled (each compilation or recompilation of a frame
    that captured operations), ``graph_breaks``, ``frames`` compiled."""
    counters = dynamo_counters()
    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": int(counters["frames"].get("ok", 0)),
    }


def graph_break_reasons() -> dict[str, int]:
    """Why dynamo broke graphs in this process (the first line of each reason), with counts (empty when it did
    not)."""
    reasons: dict[str, int] = {}
    for reason, n in dynamo_counters()["graph_break"].items():
        first = reason.strip().splitlines()[0] if reason.strip() else reason
        reasons[first] = reasons.get(first, 0) + int(n)
    return reasons


def reset_compile_counters() -> None:
    """Start dynamo's counts over (benchmarks and tests measure one run)."""
    dynamo_counters().clear()


def eager_for_generation() -> Any:
    """A context in which compiled units run their eager forward: greedy decoding without a cache grows the
    sequence by one token per call, a new shape each time, and compiles more than it saves."""
    return torch.compiler.set_stance("force_eager")
