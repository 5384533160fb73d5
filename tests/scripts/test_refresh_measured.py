"""scripts/refresh_measured.py: measured blocks are rewritten from the measuring code's own output, headed by
where and how they were measured, and nothing else in their page changes."""

from __future__ import annotations

import json
import re
import sys

import pytest

from lightning_fsdp_plus.app.sweep import write_summary
from tests.helpers.launch import REPO

sys.path.insert(0, str(REPO / "scripts"))
import refresh_measured

PAGE = """# Measured
Intro.
<!-- measured:sweep:start -->
| old | table |
<!-- measured:sweep:end -->
Middle.
<!-- measured:examples:start -->
<!-- measured:examples:end -->
End.
"""


def _docs(root):
    """A docs folder whose examples page holds the sweep and examples blocks."""
    page = root / "measured" / "examples.md"
    page.parent.mkdir(parents=True)
    page.write_text(PAGE)
    return page


def _job(root, number, name, data="pack: false\n  max_seq_len: 128\n  batch_size: 8", **metrics):
    job = root / f"{number}_{name}"
    (job / ".hydra").mkdir(parents=True)
    (job / "metrics.json").write_text(json.dumps({"world_size": 2, "overrides": [name], **metrics}))
    (job / ".hydra" / "config.yaml").write_text(f"trainer:\n  max_steps: 300\ndata:\n  {data}\n")
    return job


def test_the_sweep_block_is_the_sweeps_own_summary_with_machine_and_command(tmp_path):
    sweep = tmp_path / "sweep"
    for i, strategy in enumerate(("FULL_SHARD", "NO_SHARD")):
        _job(sweep, i, f"strategy={strategy.lower()}", sharding_strategy=strategy,
             model_state_bytes_per_rank=1000 * (i + 1), val_loss=1.25)  # fmt: skip
    write_summary(sweep)
    page = _docs(tmp_path)
    block = refresh_measured.refresh("sweep", source=sweep, docs=tmp_path)
    text = page.read_text()
    assert "| old | table |" not in text and block in text
    assert text.replace(block, "") == PAGE.replace("| old | table |\n", "")  # only the block changed
    assert block.startswith(f"Measured {refresh_measured.machine()}: `fsdp-plus-train sweep=sharding`.")
    assert "| 1_strategy=no_shard |" in block and "2,000" in block  # the summary's own rows and formatting


def test_the_examples_block_reads_both_experiments_metrics_and_data_sizes(tmp_path):
    sweep = tmp_path / "examples"
    packed = "pack: true\n  max_seq_len: 256\n  batch_size: 3"
    _job(sweep, 0, "experiment=medical_lora", base_val_perplexity=64.07, val_perplexity=2.82, fit_time_s=78.2,
         useful_tokens_per_s=4881.2, padding_share=0.0281, data=packed)  # fmt: skip
    _job(sweep, 1, "experiment=legal_lora", base_val_perplexity=39.31, val_perplexity=2.13, fit_time_s=74.6)
    _docs(tmp_path)
    block = refresh_measured.refresh("examples", source=sweep, docs=tmp_path)
    medical = REPO / "examples" / "medical_lora" / "data"
    train = sum(1 for line in (medical / "train.jsonl").open() if line.strip())
    assert f"`examples/medical_lora/data/`: {train} train" in block
    assert (
        "| held-out perplexity, base -> trained | 64.07 -> 2.82 (-96%) after 300 steps | 39.31 -> 2.13 (-95%)" in block
    )
    assert "| training time (2 CPU processes) | 78 s | 75 s |" in block
    assert "| useful (in-loss) tokens per second | 4,881 (2.8% padding) | - |" in block  # older metrics: no figure
    rows = "| training rows | packed into 256 tokens, 3 a rank | one example per row of up to 128 tokens, 8 a rank |"
    assert rows in block
    (sweep / "1_experiment=legal_lora" / "metrics.json").unlink()  # an unfinished job is not half a table
    with pytest.raises(SystemExit, match="expected 2 finished jobs"):
        refresh_measured.refresh("examples", source=sweep, docs=tmp_path)


def test_a_page_without_the_block_is_an_error_not_a_silent_skip(tmp_path):
    page = tmp_path / "docs" / "measured" / "performance.md"
    page.parent.mkdir(parents=True)
    page.write_text("# No markers\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.md").write_text("Benchmarks — ...\n")
    with pytest.raises(SystemExit, match=r"docs/measured/performance\.md has no <!-- measured:benchmark:start -->"):
        refresh_measured.refresh("benchmark", source=tmp_path / "run", docs=tmp_path / "docs")


def test_every_measured_block_is_in_its_page():
    for name, (page, _, _) in refresh_measured.TARGETS.items():
        text = (REPO / "docs" / page).read_text()
        assert f"<!-- measured:{name}:start -->" in text and f"<!-- measured:{name}:end -->" in text, (name, page)
        everywhere = sum(p.read_text().count(f"<!-- measured:{name}:start -->") for p in (REPO / "docs").rglob("*.md"))
        assert everywhere == 1, (name, everywhere)  # one copy: the one refresh_measured rewrites
        first_line = text.split(f"<!-- measured:{name}:start -->\n")[1].splitlines()[0]
        assert re.search(r"20\d\d-\d\d-\d\d", first_line), (name, first_line)  # headed by its date
