"""The packing benchmark's arithmetic: micro-batch sizes that compare like with like, and the summary's gain and
bound."""

from __future__ import annotations

import pytest

from benchmarks.packing import report, same_examples, same_positions, summarize


def test_the_packed_micro_batch_matches_the_unpacked_positions_or_examples():
    assert same_positions([100] * 50, batch=8, row_len=200) == 4  # 8 x 100 positions = 4 rows of 200
    assert same_positions([50] * 49 + [200], batch=8, row_len=200) in (2, 3)  # mostly 8 x 50, sometimes 8 x 200
    # rows of 200 hold two examples of 100: 16 examples a step on 2 ranks = 4 rows a rank
    assert same_examples([100] * 50, examples_per_step=16, row_len=200) == 4


def test_the_gain_is_held_to_the_bound_its_padding_share_sets():
    def run(useful: float, padding: float, ppl: float) -> dict:
        return {"useful_tokens_per_s": useful / 2, "useful_tokens_per_cpu_s": useful, "tokens_per_s": 2 * useful,
                "padding_share": padding, "val_perplexity": ppl, "step_time_s_median": 0.1, "step_cpu_s_median": 0.1,
                "global_batch_size": 8}  # fmt: skip

    plan = {"c": {"unpacked": ["data.batch_size=8"], "packed": ["data.batch_size=4"], "epoch": ["data.batch_size=3"]}}
    runs = {"c": {"unpacked": [run(100, 0.5, 4.0), run(120, 0.5, 4.0), run(80, 0.5, 4.0)],
                  "packed": [run(190, 0.02, 9.0), run(210, 0.02, 9.0), run(170, 0.02, 9.0)],
                  "epoch": [run(150, 0.02, 4.1)]}}  # fmt: skip
    summary = summarize(plan, runs)["c"]
    assert summary["gain"] == pytest.approx(1.9) and summary["bound"] == pytest.approx(1.8)
    assert summary["gain_over_bound"] == pytest.approx(1.9 / 1.8)
    assert summary["perplexity_change"] == pytest.approx(0.025)  # the one-epoch run's, not the throughput run's
    assert summary["batch"] == {"unpacked": 8, "packed": 4, "epoch": 3}
    row = (
        "| c | 8 / 4 / 3 | 50.0% -> 2.0% | 100 -> 190 | 1.90x | 1.80x | 1.06 | 1.90x | 4.000 -> 4.100 (+2.5%) | 3/3/1 |"
    )
    assert row in report({"c": summary})
