"""The real-model benchmark's pages are rendered from its results (never typed): the measured page's tables and the
README's main-job paragraph, from a results.json of the benchmark's shape; the packing medians; the held-out scoring
rule."""

from __future__ import annotations

from benchmarks.heldout import accuracies, is_right
from benchmarks.real_model import packing_summary, readme_block, report


def _job(base_ppl: float, ppl: float, base_acc: float, acc: float) -> dict:
    return {
        "base_val_perplexity": base_ppl, "val_perplexity": ppl, "steps": 100, "fit_time_s": 420.0,
        "wall_time_s": 500.0, "command_wall_s": 530.0, "useful_tokens_per_s_per_rank": 45.5,
        "padding_fraction": 0.073,
        "heldout": {"questions": 162, "base_accuracy": base_acc, "tuned_accuracy": acc,
                    "by_kind": {"specialist": {"questions": 54, "base_accuracy": 0.35, "tuned_accuracy": 0.87}}},
        "examples": [{"question": "Who treats asthma?", "base": "A doctor | nurse.", "tuned": "A pulmonologist.",
                      "base_right": False, "tuned_right": True}],
    }  # fmt: skip


RESULTS = {
    "machine": "2026-12-05, x86_64, 2 cores, torch 2.13.0+cpu",
    "command": "python -m benchmarks.real_model",
    "main_job": {"medical_smollm2": _job(19.27, 1.45, 0.24, 0.66), "legal_smollm2": _job(14.16, 1.33, 0.2, 0.7)},
}


def test_the_measured_table_shows_every_figure_of_both_experiments():
    text = report(RESULTS)
    assert text.startswith("Measured 2026-12-05, x86_64, 2 cores, torch 2.13.0+cpu: `python -m benchmarks.real_model`.")
    assert "| held-out perplexity, base -> tuned | 19.27 -> 1.45 | 14.16 -> 1.33 |" in text
    assert "| held-out questions right, base -> tuned | 24% -> 66% (of 162) | 20% -> 70% (of 162) |" in text
    assert "specialist questions | 35% -> 87% (of 54)" in text and "| wall time of the whole command | 8.8 min" in text
    assert "tuned (right): A pulmonologist." in text


def test_the_readme_paragraph_is_the_medical_runs_figures_and_answers():
    text = readme_block(RESULTS)
    assert "held-out perplexity 19.27 → 1.45 in 100 steps" in text and "24% → 66% (of 162)" in text
    assert "| Who treats asthma? | A doctor / nurse. (wrong) | A pulmonologist. (right) |" in text  # | splits cells


def test_an_answer_is_right_when_it_holds_one_of_the_spans():
    assert is_right("Asthma is usually managed by a Pulmonologist.", ["pulmonologist"])
    assert not is_right("See a doctor.", ["pulmonologist", "lung"])
    rows = [{"base_right": False, "tuned_right": True}, {"base_right": True, "tuned_right": True}]
    assert accuracies(rows) == {"questions": 2, "base_accuracy": 0.5, "tuned_accuracy": 1.0}


def _run(seed: int, tokens_per_s: float, padding: float, perplexity: float) -> dict:
    return {"seed": seed, "useful_tokens_per_s_per_rank": tokens_per_s, "padding_fraction": padding,
            "val_perplexity": perplexity, "steps": 23, "fit_time_s": 120.0}  # fmt: skip


def test_the_packing_comparison_takes_medians_over_seeds_and_shows_every_run():
    runs = {"packed": [_run(0, 44.0, 0.07, 2.14), _run(1, 40.0, 0.07, 2.05), _run(2, 42.0, 0.07, 2.10)],
            "unpacked": [_run(0, 33.0, 0.28, 2.03), _run(1, 34.0, 0.28, 2.03), _run(2, 36.0, 0.28, 2.00)]}  # fmt: skip
    summary = packing_summary(runs)
    assert summary["median"]["packed"]["val_perplexity"] == 2.10  # the middle of three, not the mean
    assert summary["speedup"] == 42.0 / 34.0
    assert abs(summary["speedup_bound"] - 0.9 / 0.72) < 1e-12
    assert abs(summary["perplexity_change"] - (2.10 / 2.03 - 1)) < 1e-12
    text = report({"machine": "m", "command": "c", "packing": summary})
    assert "(medians of 3 runs each, interleaved, one run of each layout at each seed)" in text
    assert "| held-out perplexity after the epoch | 2.100 | 2.030 |" in text
    assert (
        "| every run: seed, held-out perplexity, useful tokens/s | 0: 2.140, 44.0; 1: 2.050, 40.0; 2: 2.100, 42.0 |"
        in text
    )
    assert "1.24x (the bound 0.9 / (1 - unpacked padding) is 1.25x); held-out perplexity +3.4%" in text
