"""``Fabric(strategy="fsdp_plus")`` on 2 CPU ranks (issue 49): every sharding strategy x precision against one
process, accumulation under ``no_backward_sync``, LoRA on int8 and NF4 bases, ``fabric.save``/``fabric.load``
(sharded and full, continued on 2 ranks and loaded on 1), a meta-device init, streaming loading — one ``torchrun``
launch of ``tests/helpers/fabric_cases.py``; a failing rank and a preemption as users start Fabric
(``python script.py``, ``tests/helpers/fabric_runs.py``); LitGPT's LoRA model with an int8 base."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.fabric_cases import PRECISIONS, STRATEGIES
from tests.helpers.launch import REPO, failure_excerpt, run_script, subprocess_env

RUNS = REPO / "tests" / "helpers" / "fabric_runs.py"


@pytest.fixture(scope="module")
def fabric_results(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("pretrained")
    save_checkpoint(checkpoints / "llama", "llama")
    out = tmp_path_factory.mktemp("fabric")
    run_script(REPO / "tests" / "helpers" / "fabric_cases.py", "--out", str(out), "--checkpoints", str(checkpoints),
               torchrun=2, timeout=900)  # fmt: skip
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_every_strategy_and_precision_trains_as_one_process(fabric_results, kind):
    _, results = fabric_results
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            case = results[f"parity/{kind}/{strategy}/{precision}"]
            if precision == "32-true":
                assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-5, (strategy, case)
            else:  # compared with the fp32 run, as the Trainer's bf16 tests are; and it really ran in bf16
                assert case["loss_diff"] < 5e-3 and 0 < case["param_diff"] < 2e-3, (strategy, case)
            replicas = {"no_shard": 2, "hybrid_shard": 2}.get(strategy, 1)
            assert case["mesh"] == {"replicate": replicas, "shard": 2 // replicas, "tensor": 1}, (strategy, case)


def test_no_backward_sync_accumulates_two_micro_batches_as_one_process(fabric_results):
    _, results = fabric_results
    case = results["accumulate"]
    assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-5, case


def test_lora_trains_on_int8_and_nf4_bases_and_the_sharded_int8_base_is_half_the_replicated_one(fabric_results):
    _, results = fabric_results
    int8, replicated, nf4 = (results[f"lora/{b}"] for b in ("int8", "int8_replicated", "nf4"))
    for case in (int8, replicated, nf4):
        assert case["quantized_layers"] == 2 * 7 and case["losses"][-1] < case["losses"][0] - 0.5, case
    assert int8["base_bytes"] * 2 == replicated["base_bytes"]  # 2 ranks: half the int8 weights each
    assert nf4["base_bytes"] * 2 <= int8["base_bytes"] * 1.1  # two 4-bit weights a byte (plus block statistics)
    assert int8["trainable"] == replicated["trainable"] == nf4["trainable"]
    assert int8["plan_bytes"] < replicated["plan_bytes"]


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_then_load_continues_exactly_on_two_ranks_and_loads_on_one(fabric_results, tmp_path, fmt):
    out, results = fabric_results
    case = results[f"checkpoint/{fmt}"]
    assert case["loss_diff"] == 0.0 and case["param_diff"] == 0.0, case
    assert case["step"] == 3 and case["rest"] == [] and case["is_dir"] == (fmt == "sharded"), case
    run_script(RUNS, "--scenario", "load1", "--out", str(tmp_path), "--checkpoint", str(out / f"ckpt_{fmt}"))
    one = json.loads((tmp_path / "load1.json").read_text())
    assert one["param_diff"] == 0.0 and one["step"] == 3 and one["optimizer_states"] > 0, one


def test_a_model_built_on_meta_and_a_streamed_pretrained_model_are_set_up_real(fabric_results):
    _, results = fabric_results
    meta = results["meta_init"]
    assert meta["on_meta_before"] and meta["real_after"] and meta["finite"], meta
    streamed = results["streamed"]
    assert streamed["keys_equal"] and streamed["param_diff"] == 0.0, streamed


def test_an_optimizer_made_before_the_strategys_lora_is_refused_with_what_to_do(fabric_results):
    _, results = fabric_results
    error = results["early_optimizer"]["error"]
    assert error is not None and "is not in the set-up model (LoRA or quantization" in error, error
    assert "create the optimizer after model = fabric.setup_module(model)" in error


def _fabric_run(tmp_path, scenario: str) -> tuple[int, str, float]:
    started = time.time()
    proc = subprocess.run([sys.executable, str(RUNS), "--scenario", scenario, "--out", str(tmp_path)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr, time.time() - started


def test_one_rank_failing_ends_every_rank_with_its_message(tmp_path):
    code, output, _ = _fabric_run(tmp_path, "fail")
    assert code != 0
    assert "rank 1 failed first: RuntimeError: boom at step 3 on rank 1" in output, failure_excerpt(output)
    assert not list(tmp_path.glob("*.finished"))  # rank 0 did not carry on alone


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    code, output, _ = _fabric_run(tmp_path, "preempt")
    assert code == 143, failure_excerpt(output)
    records = [json.loads((tmp_path / f"preempt.rank{r}.json").read_text()) for r in range(2)]
    assert records == [{"step": 3, "signal": 15}] * 2
    assert (tmp_path / "ckpt" / "manifest.json").is_file()


def test_litgpt_lora_with_an_int8_base_trains_on_two_ranks(tmp_path):
    run_script(REPO / "tests" / "helpers" / "litgpt_case.py", "--out", str(tmp_path), torchrun=2)
    result = json.loads((tmp_path / "litgpt.json").read_text())
    losses = result["losses"]
    assert len(losses) == 20 and losses[-1] < losses[0] / 2, losses
    # every LoRA layer's frozen nn.Linear (qkv, proj, 3 MLP, 2 blocks) and the head's, int8 and sharded
    assert len(result["quantized"]) == 2 * 5 + 1 and all(n.endswith(".linear") for n in result["quantized"])
    whole = 2 * (128 * 64 + 64 * 64 + 3 * 128 * 64) + 128 * 64  # their int8 weights, bytes
    assert whole / 2 <= result["base_bytes_per_rank"] < whole * 0.55, result["base_bytes_per_rank"]
    assert result["units"] == ["transformer.h.0", "transformer.h.1", ""]
