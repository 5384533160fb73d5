"""``benchmarks.compare``: two runs agree on a ratio when their medians differ by less than their spreads."""

from __future__ import annotations

from benchmarks.compare import agree, compare


def _doc(**ratios):
    return {"overhead_vs_best_reference": {k: {"median": m, "min": lo, "max": hi} for k, (m, lo, hi) in ratios.items()}}


def test_agreement_is_the_difference_of_medians_within_the_half_ranges():
    assert agree({"median": 1.00, "min": 0.95, "max": 1.05}, {"median": 1.08, "min": 1.02, "max": 1.12})
    assert not agree({"median": 1.00, "min": 0.99, "max": 1.01}, {"median": 1.10, "min": 1.09, "max": 1.11})


def test_a_ratio_missing_from_one_run_is_a_disagreement():
    ok, table = compare(_doc(FULL_SHARD=(1.0, 0.9, 1.1)), _doc(FULL_SHARD=(1.02, 0.95, 1.1), NO_SHARD=(1, 1, 1)))
    assert not ok and "| NO_SHARD | - | present | no |" in table
    ok, _ = compare(_doc(FULL_SHARD=(1.0, 0.9, 1.1)), _doc(FULL_SHARD=(1.02, 0.95, 1.1)))
    assert ok
