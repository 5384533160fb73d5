"""The auto-plan benchmark's arithmetic: rank correlation, budget placement, and the pass rule of a budget."""

from __future__ import annotations

import pytest

from benchmarks.autoplan import check_budget, check_over_peak, gap_budgets, spearman, widest_gap_budgets
from lightning_fsdp_plus.autoplan import Hardware, predict_memory
from lightning_fsdp_plus.memory.allocator import PLATFORMS
from lightning_fsdp_plus.memory.fake import ForwardBatch
from lightning_fsdp_plus.options import FSDPPlusOptions
from tests.helpers.launch import REPO


def test_spearman_ranks_with_ties_averaged():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # scipy.stats.spearmanr


def test_budgets_sit_with_their_usable_part_midway_across_the_widest_gaps():
    peaks = [100, 110, 200, 210, 400, 400]
    assert gap_budgets(peaks, margin=0.5) == [(1.1, 210), (200 / 110, 310), (1.05, 410), (400 / 210, 610)]
    assert widest_gap_budgets(peaks, margin=0.5, count=2) == [310, 610]


def tiny_plan():
    """The tiny Llama's full fine-tune plan with room for every candidate, and each candidate's planned peak (on
    CPU under tcmalloc, as the benchmark plans: on cuda the runtime's 0.8 GiB would dwarf a tiny model's bytes)."""
    config = REPO / "examples" / "assets" / "tiny-llama"
    plan = predict_memory(config, options=FSDPPlusOptions(), world_size=2, precision="32-true",
                          batch=ForwardBatch(1, 16), budget=2**40, margin=0.1, lora_run=False,
                          platform=PLATFORMS["cpu-tcmalloc"])  # fmt: skip
    plan = plan.with_hardware(Hardware(matmul_flops=1e10, link_bandwidth=1e9))
    return plan, [p.peak_bytes for p in plan.predictions]


def test_a_budget_passes_only_within_the_budget_and_within_ten_percent_of_the_fastest_that_fits():
    plan, planned = tiny_plan()
    chosen = plan.chosen
    assert chosen is not None
    # measurements equal to the predictions, the chosen candidate measured fastest: a roomy budget passes
    measured = [{"peak_bytes": p, "process_peak_bytes": p, "step_time_s": 2.0} for p in planned]
    measured[chosen]["step_time_s"] = 1.0
    roomy = check_budget(plan, measured, 2 * max(planned), peak="process_peak_bytes")
    assert roomy["ok"] and roomy["chosen"] == chosen and roomy["measured_fitting"] == len(planned)
    # another candidate that fits was measured much faster: the choice fails the 10% rule
    other = next(i for i in range(len(planned)) if i != chosen)
    measured[other]["step_time_s"] = 0.5
    slower = check_budget(plan, measured, 2 * max(planned), peak="process_peak_bytes")
    assert not slower["ok"] and slower["step_ratio"] == pytest.approx(2.0)
    # the chosen candidate's real peak beyond the budget fails whatever the time
    measured[other]["step_time_s"] = 2.0
    measured[chosen]["process_peak_bytes"] = 10 * max(planned)
    assert not check_budget(plan, measured, 2 * max(planned), peak="process_peak_bytes")["ok"]
    # nothing fits by prediction or by measurement: agreeing that nothing fits passes
    assert check_budget(plan, measured, 1, peak="peak_bytes") | {"error": ""} == {
        "budget_bytes": 1, "measured_fitting": 0, "chosen": None, "error": "", "ok": True}  # fmt: skip


def test_a_budget_over_a_candidates_measured_peak_holds_when_the_plan_s_choice_stays_inside_it():
    plan, planned = tiny_plan()
    measured = [{"peak_bytes": p, "process_peak_bytes": p, "step_time_s": 1.0} for p in planned]
    largest = max(range(len(planned)), key=planned.__getitem__)
    check = check_over_peak(plan, measured, largest)  # 1.1x the largest: the fastest candidate is chosen, and fits
    assert check["ok"] and check["budget_bytes"] == int(1.1 * planned[largest]) and check["chosen"] == plan.chosen
    measured[plan.chosen]["process_peak_bytes"] = 2 * check["budget_bytes"]  # measured beyond: not honoured
    assert not check_over_peak(plan, measured, largest)["ok"]
    assert check_over_peak(plan, [m | {"process_peak_bytes": 1} for m in measured], 0) | {"chosen_peak": 0} == {
        "budget_bytes": 1, "chosen": None, "chosen_peak": 0, "ok": True}  # nothing fits: refused, honoured  # fmt: skip
