"""Sweep summary from job directories' metrics.json files (the real multirun is in test_train_app)."""

from __future__ import annotations

import csv
import json

import matplotlib.image
import pytest

from lightning_fsdp_plus.app.sweep import job_labels, write_summary


def _job(sweep, name, **metrics):
    (sweep / name).mkdir(parents=True)
    (sweep / name / "metrics.json").write_text(json.dumps(metrics))


def test_summary_has_one_row_per_finished_job_in_job_order(tmp_path):
    common = {"world_size": 2, "val_loss": 1.0, "step_time_s_median": 0.1, "peak_bytes_per_rank": 10,
              "model_state_bytes_per_rank": 5}  # fmt: skip
    _job(tmp_path, "10_strategy=no_shard", strategy_preset="no_shard", sharding_strategy="NO_SHARD",
         overrides=["strategy=no_shard", "trainer.devices=2"], **common)  # fmt: skip
    _job(tmp_path, "2_strategy=full_shard", strategy_preset="full_shard", sharding_strategy="FULL_SHARD",
         tokens_per_s=12345.6, overrides=["strategy=full_shard", "trainer.devices=2"], **common)  # fmt: skip
    (tmp_path / "3_failed").mkdir()  # a job that died before writing metrics is left out
    paths = write_summary(tmp_path)
    assert [p.name for p in paths] == ["sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"]
    rows = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert [r["job"] for r in rows] == ["2_strategy=full_shard", "10_strategy=no_shard"]
    assert rows[0]["sharding_strategy"] == "FULL_SHARD" and rows[1]["tokens_per_s"] == ""
    assert (
        "| 2_strategy=full_shard | full_shard | FULL_SHARD | 2 | 10 | 5 | 0.1 | 12,346 |"
        in (tmp_path / "sweep_summary.md").read_text()
    )
    assert matplotlib.image.imread(tmp_path / "sweep_summary.png").ndim == 3


def test_labels_are_the_overrides_that_differ():
    rows = [{"job": "0", "overrides": ["strategy=a", "x=1"]}, {"job": "1", "overrides": ["strategy=b", "x=1"]}]
    assert job_labels(rows) == ["strategy=a", "strategy=b"]


def test_empty_sweep_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*/metrics.json under"):
        write_summary(tmp_path)
