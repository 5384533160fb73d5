"""The real-model benchmark's pages are rendered from its results (never typed): the measured page's table and the
README's main-job paragraph, from a results.json of the benchmark's shape; the held-out scoring rule."""

from __future__ import annotations

from benchmarks.heldout import accuracies, is_right
from benchmarks.real_model import readme_block, report


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
