"""benchmarks/report.py: each fsdp_plus case against the faster reference of each repetition, and the Markdown."""

from __future__ import annotations

import pytest

from benchmarks.harness import PHASES, PYTHON
from benchmarks.report import TARGET_RATIO, aggregate, to_markdown

META = {"date": "2026-12-01", "machine": "x86_64, 2 cores, 1 thread(s)/rank", "world_size": 2, "backend": "gloo",
        "repetitions": 2, "command": "python -m benchmarks.run", "wall_s": 930.0}  # fmt: skip


def _rank(step: float, *, backward: float = 0.0, profile: dict | None = None) -> dict:
    phases = {p: step / 4 for p in PHASES} | {"backward": step / 4 + backward}
    return {"step_time_s": step, "tokens_per_step": 512, "phases_s": phases, "comm_per_step": {"all_gather": 8},
            "model_state_bytes": 1, "tensor_peak_bytes": 2, "activation_bytes": 1,
            **({"profile_s": profile} if profile else {})}  # fmt: skip


def _runs(steps: dict[str, list[float]], profiles: dict[str, dict] | None = None) -> dict:
    profiles = profiles or {}
    return {
        name: [{"repetition": i, "ranks": [_rank(t, profile=profiles.get(name)) for _ in range(2)]}
               for i, t in enumerate(times)]
        for name, times in steps.items()
    }  # fmt: skip


def test_each_repetition_divides_by_the_faster_reference_and_the_gpt_case_has_its_own_row():
    runs = _runs({
        "fsdp_plus_full_shard": [1.00, 1.10],
        "fsdp2_loop_full_shard": [1.00, 1.05],  # the lower median (1.025 vs 1.075): the reference
        "lightning_model_parallel_full_shard": [0.95, 1.20],  # faster in the first repetition only
        "gpt_fsdp_plus_full_shard": [2.0, 2.0],
        "gpt_fsdp2_loop_full_shard": [2.0, 2.0],
        "plain_gpt_fsdp_plus_full_shard": [1.0, 1.0],
        "plain_gpt_lightning_model_parallel_full_shard": [0.5, 0.5],
        "plain_gpt_lightning_model_parallel_default_mesh": [0.1, 0.1],  # shards nothing: never a reference
        "lora_int8_sharded": [0.5, 0.5],  # no reference: no row
    })  # fmt: skip
    ratios = aggregate(runs)["overhead_vs_best_reference"]
    assert set(ratios) == {"FULL_SHARD", "GPT FULL_SHARD", "PLAIN GPT FULL_SHARD"}
    assert ratios["PLAIN GPT FULL_SHARD"]["reference"] == "plain_gpt_lightning_model_parallel_full_shard"
    assert ratios["FULL_SHARD"]["reference"] == "fsdp2_loop_full_shard"
    # each repetition against that reference (the minimum of two noisy times would be biased low)
    assert ratios["FULL_SHARD"]["per_repetition"] == pytest.approx([1.00 / 1.00, 1.10 / 1.05])
    assert ratios["GPT FULL_SHARD"]["median"] == pytest.approx(1.0)


def test_a_refused_reference_is_left_out_and_a_ratio_above_target_names_its_phase():
    runs = _runs({"fsdp_plus_no_shard": [1.1, 1.1], "fsdp2_loop_no_shard": [1.0, 1.0]})
    runs["lightning_model_parallel_no_shard"] = [{"repetition": i, "ranks": [{"refused": "ValueError: no"}] * 2}
                                                 for i in range(2)]  # fmt: skip
    runs["fsdp_plus_no_shard"] = [{"repetition": i, "ranks": [_rank(1.1, backward=0.1)] * 2} for i in range(2)]
    results = aggregate(runs)
    assert results["overhead_vs_best_reference"]["NO_SHARD"]["median"] == pytest.approx(1.1)
    text = to_markdown(results, META)
    assert f"NO_SHARD: 1.100 is above the {TARGET_RATIO} target; most of the difference is in `backward`" in text
    assert text.splitlines()[0].endswith("`python -m benchmarks.run` (15.5 min)")


def test_the_profile_table_lists_the_ops_that_differ_most():
    ours = {"aten::mm": 0.50, PYTHON: 0.030, "gloo:all_gather": 0.080}
    theirs = {"aten::mm": 0.50, PYTHON: 0.020, "gloo:all_gather": 0.040}
    runs = _runs({"fsdp_plus_full_shard": [1.0, 1.0], "fsdp2_loop_full_shard": [1.0, 1.0]},
                 profiles={"fsdp_plus_full_shard": ours, "fsdp2_loop_full_shard": theirs})  # fmt: skip
    results = aggregate(runs)
    rows = results["overhead_vs_best_reference"]["FULL_SHARD"]["profile_delta_s"]
    assert [row[0] for row in rows] == ["gloo:all_gather", PYTHON, "aten::mm"]
    text = to_markdown(results, META)
    assert "| gloo:all_gather | 80.0 | 40.0 | +40.0 |" in text


def test_compiled_fsdp_plus_is_divided_by_the_faster_eager_reference_and_the_hand_compiled_loop():
    runs = _runs({
        "fsdp2_loop_full_shard": [1.00, 1.00],
        "lightning_model_parallel_full_shard": [1.10, 1.10],
        "compiled_fsdp_plus_full_shard": [0.80, 0.90],
        "compiled_fsdp2_loop_full_shard": [0.80, 0.80],
        "bf16_fsdp2_loop_full_shard": [0.50, 0.50],
        "compiled_bf16_fsdp_plus_full_shard": [0.45, 0.45],  # no hand-compiled bf16 loop in this run
        "compiled_fsdp_plus_full_shard_typo": [0.1, 0.1],  # not a compile comparison
    })  # fmt: skip
    for name, reps in runs.items():
        for i, rep in enumerate(reps):
            for rank in rep["ranks"]:
                rank["first_step_s"] = 10.0 + i if name.startswith("compiled") else 0.5
    compiled = aggregate(runs)["compile"]
    assert set(compiled) == {"fp32", "bf16-mixed"}
    fp32 = compiled["fp32"]
    assert fp32["eager_reference"] == "fsdp2_loop_full_shard"
    assert fp32["vs_eager"]["median"] == pytest.approx(0.85) and fp32["vs_eager"]["max"] == pytest.approx(0.90)
    assert fp32["vs_hand_compiled"]["median"] == pytest.approx(1.0625)
    assert fp32["first_step_s"]["compiled_fsdp_plus_full_shard"] == [10.0, 11.0]
    assert "vs_hand_compiled" not in compiled["bf16-mixed"]
    markdown = to_markdown(aggregate(runs), META)
    assert "| fp32 | 0.850 (0.800-0.900) | fsdp2_loop_full_shard | 1.062 (1.000-1.125) |" in markdown
    assert "| bf16-mixed | 0.900 (0.900-0.900) | bf16_fsdp2_loop_full_shard | - |" in markdown
