"""The estimator: ZeRO arithmetic, the docs' figures, the CLI, FakeTensor counts against real ones, simulate."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from lightning_fsdp_plus.loss import causal_lm_loss
from lightning_fsdp_plus.memory.assumptions import assumptions_markdown
from lightning_fsdp_plus.memory.cli import run
from lightning_fsdp_plus.memory.estimate import count_activations, describe_config, estimate_memory
from lightning_fsdp_plus.memory.fake import EstimateError, ForwardBatch
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.sharding import apply_activation_checkpointing
from tests.helpers.launch import REPO
from tests.helpers.models import LORA, LORA_LLAMA, tiny_llama

DOCS = REPO / "docs" / "memory.md"


def _by_strategy(**kwargs) -> dict:
    _, estimates = estimate_memory(**kwargs)
    return {e.sharding_strategy: e for e in estimates}


def test_zero_paper_figures_for_7_5b_on_64_ranks():
    psi, n = 7.5e9, 64
    zero = {"NO_SHARD": 16 * psi, "SHARD_GRAD_OP": 2 * psi + 14 * psi / n, "FULL_SHARD": 16 * psi / n}
    paper = {"NO_SHARD": 120e9, "SHARD_GRAD_OP": 16.6e9, "FULL_SHARD": 1.9e9}  # as printed in the paper
    assert zero == pytest.approx(paper, rel=0.02)
    estimates = _by_strategy(params=psi, world_size=n, precision="bf16-mixed", optimizer="adamw")
    for name, expected in zero.items():
        assert estimates[name].model_state_bytes_per_rank == pytest.approx(expected, rel=0.02), name


def test_docs_carry_the_assumption_table_and_the_tools_own_output():
    text = DOCS.read_text()
    assert assumptions_markdown() in text
    assert run(["--params", "7.5e9", "--world-size", "64"]) in text
    assert run(["--params", "13e9", "--world-size", "8"]) in text


def test_parameter_count_arithmetic_for_lora_on_an_int8_base():
    psi, fraction = 1e9, 0.01
    replicated = _by_strategy(params=psi, world_size=4, strategy="full_shard", trainable_fraction=fraction,
                              quantize_base="int8", lora_only=True)["FULL_SHARD"]  # fmt: skip
    trainable = psi * fraction
    assert replicated.params == psi - trainable + trainable * 4 / 4  # int8 base whole, fp32 LoRA shard
    assert (replicated.grads, replicated.optimizer) == (trainable * 4 / 4, trainable * 8 / 4)
    sharded = _by_strategy(params=psi, world_size=4, strategy="full_shard", trainable_fraction=fraction,
                           quantize_base="int8")["FULL_SHARD"]  # fmt: skip
    assert sharded.params == (psi - trainable) / 4 + trainable


def test_parameter_count_arithmetic_for_lora_on_an_nf4_base():
    psi, fraction = 1.28e9, 0.01
    trainable = psi * fraction
    frozen = psi - trainable
    sharded = _by_strategy(params=psi, world_size=4, strategy="full_shard", trainable_fraction=fraction,
                           quantize_base="nf4")["FULL_SHARD"]  # fmt: skip
    assert sharded.params == (frozen / 2 + frozen / 64 * 4) / 4 + trainable  # packed 4-bit + fp32 absmax per 64


def test_json_maps_each_strategy_to_its_model_state(capsys):
    doc = json.loads(run(["--params", "1e9", "--world-size", "8", "--json"]))
    assert doc["world_size"] == 8
    assert set(doc["strategies"]) == {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}
    assert doc["strategies"]["FULL_SHARD"]["model_state_bytes_per_rank"] == 16e9 / 8
    several = json.loads(run(["--params", "1e9", "--world-size", "8", "16", "--json", "--strategy", "hybrid_shard",
                              "--hybrid-shard-size", "8"]))  # fmt: skip
    assert [d["world_size"] for d in several] == [8, 16]
    assert [d["strategies"]["HYBRID_SHARD"]["shard_size"] for d in several] == [8, 8]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "1e9", "--world-size", "8", "--strategy", "ZeRO3"],
         "strategy='ZeRO3' is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (or all)"),
        (["--params", "1e9", "--world-size", "0"], "world_size=0 must be a positive integer"),
        (["--config", "/no/such/config.json", "--world-size", "2"],
         "config='/no/such/config.json' is not a readable transformers config.json (FileNotFoundError"),
        (["--params", "1e9", "--world-size", "8", "--strategy", "hybrid_shard", "--hybrid-shard-size", "3"],
         "hybrid_shard_size=3 does not divide the world size 8; valid choices: 1, 2, 4, 8"),
        (["--params", "1e9", "--world-size", "8", "--precision", "fp8"],
         "argument --precision: invalid choice: 'fp8' (choose from '32-true', 'bf16-mixed'"),
        (["--params", "1e9", "--world-size", "8", "--lora-rank", "8"], "--lora-rank needs --config"),
        (["--params", "1e9", "--world-size", "8", "--simulate"], "simulate=True builds the model: give config="),
        (["--params", "1e9", "--world-size", "8", "--activation-checkpointing"],
         "activation_checkpointing needs config=..."),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_key_value_and_choices(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_without_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match=r"is not a readable transformers config.json \(no model_type\)"):
        estimate_memory(config=tmp_path, world_size=2)


def test_console_script_prints_a_table_and_fails_with_status_2():
    cli = [sys.executable, "-m", "lightning_fsdp_plus.memory.cli", "--params", "7.5e9"]
    runs = [
        subprocess.Popen([*cli, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for args in (["--world-size", "64", "--strategy", "full_shard"], ["--world-size", "-2"])
    ]  # together
    (ok_out, _), (_, bad_err) = (run.communicate(timeout=120) for run in runs)
    assert runs[0].returncode == 0 and "FULL_SHARD" in ok_out and "1.875" in ok_out
    assert runs[1].returncode == 2 and "world_size=-2 must be a positive integer" in bad_err


@pytest.mark.parametrize(("precision", "checkpointing"), [("32-true", False), ("bf16-mixed", False), ("32-true", True)])
def test_fake_forward_counts_the_same_activations_as_a_real_one(tmp_path, precision, checkpointing):
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    model = model.to(dtype)
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    batch = {"input_ids": ids, "labels": ids}
    full = count_activations(lambda: causal_lm_loss(model, batch), precision=precision)  # the app's (chunked) loss
    if checkpointing:
        apply_activation_checkpointing(model, [f"model.layers.{i}" for i in range(len(model.model.layers))])
    real = count_activations(lambda: causal_lm_loss(model, batch), precision=precision)
    description, _ = estimate_memory(config=tmp_path, world_size=2, precision=precision, batch_size=3, seq_len=16,
                                     activation_checkpointing=checkpointing)  # fmt: skip
    assert description.activation_bytes == real
    assert description.recompute_bytes == ((full - real) // len(model.model.layers) if checkpointing else 0)
    assert (real < full) is checkpointing


def test_a_config_that_says_bfloat16_is_counted_in_the_precision_s_dtype(tmp_path):
    # hub configs carry dtype=bfloat16 and transformers' from_config follows it; a 32-true run computes in fp32
    model = tiny_llama()
    model.config.dtype = torch.bfloat16
    model.config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    real = count_activations(lambda: causal_lm_loss(model, {"input_ids": ids}), precision="32-true")
    description, _ = estimate_memory(config=tmp_path, world_size=2, precision="32-true", batch_size=3, seq_len=16)
    assert next(model.parameters()).dtype == torch.float32
    assert description.activation_bytes == real


def test_padded_batches_take_the_masked_attention_path_and_save_more(tmp_path):
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    real = count_activations(lambda: causal_lm_loss(model, {"input_ids": ids, "attention_mask": mask}),
                             precision="32-true")  # fmt: skip
    plain, _ = estimate_memory(config=tmp_path, world_size=2, precision="32-true", batch_size=3, seq_len=16)
    padded, _ = estimate_memory(config=tmp_path, world_size=2, precision="32-true", batch_size=3, seq_len=16,
                                padded=True)  # fmt: skip
    assert padded.activation_bytes == real > plain.activation_bytes


def test_packed_rows_are_counted_as_they_run_with_their_block_mask(tmp_path):
    from lightning_fsdp_plus.app.packing import packed_model_inputs

    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]  # two examples a row, as estimated
    ids = torch.tensor([[t for row in rows for t in row]] * 3)
    positions = torch.tensor([[p for row in rows for p in range(len(row))]] * 3)
    batch = packed_model_inputs(model, {"input_ids": ids, "position_ids": positions})
    real = count_activations(lambda: causal_lm_loss(model, batch), precision="32-true")
    plain, _ = estimate_memory(config=tmp_path, world_size=2, precision="32-true", batch_size=3, seq_len=16)
    packed, _ = estimate_memory(config=tmp_path, world_size=2, precision="32-true", batch_size=3, seq_len=16,
                                packed=True)  # fmt: skip
    assert packed.activation_bytes == real > plain.activation_bytes
    with pytest.raises(EstimateError, match="padded=True and packed=True: a batch is rows of single examples"):
        estimate_memory(config=tmp_path, world_size=2, seq_len=16, padded=True, packed=True)


def test_simulate_agrees_with_the_arithmetic_on_what_both_count(tmp_path):
    tiny_llama(0, **LORA_LLAMA).config.save_pretrained(tmp_path)
    _, estimates = estimate_memory(
        config=tmp_path, world_size=2, strategy=["full_shard", "shard_grad_op"], precision="bf16-mixed",
        lora=LORA, quantize_base="int8", batch_size=2, seq_len=16, simulate=True,
    )  # fmt: skip
    for estimate in estimates:
        simulated = estimate.simulated
        assert simulated["sharded_param"] == estimate.params  # the int8 base and LoRA shards, byte for byte
        lora_tensors = 2 * 2 * len(LORA["target_modules"])  # A and B in 2 layers
        assert simulated["optstate"] == estimate.optimizer + 4 * lora_tensors  # + Adam's fp32 scalar step counters
        assert simulated["total"] >= estimate.peak_bytes_per_rank * 0.9
    full, sgo = estimates
    _, nf4 = estimate_memory(config=tmp_path, world_size=2, strategy="full_shard", precision="bf16-mixed", lora=LORA,
                             quantize_base="nf4", batch_size=2, seq_len=16, simulate=True)  # fmt: skip
    assert nf4[0].simulated["sharded_param"] == nf4[0].params  # the packed 4-bit base too, byte for byte
    assert nf4[0].params < 0.7 * full.params  # LoRA and the float embeddings stay as they were
    assert nf4[0].simulated["all_gather"] < 0.35 * full.simulated["all_gather"]  # the unit gathers packed 4-bit
    # the step's timeline and torch's tracker agree on what is gathered at the peak: SHARD_GRAD_OP's peak is the last
    # block's backward, the head already resharded after its own backward, every other unit's copy still kept
    peak = next(m for m in sgo.timeline if m["name"] == sgo.peak_moment)
    assert sgo.peak_moment.startswith("backward") and sgo.peak_moment.endswith("layers.1")
    assert sgo.simulated["unsharded_param"] == pytest.approx(peak["parts"]["gathered"], rel=1e-3)
    assert peak["parts"]["gathered"] < sgo.unsharded_params  # less than all kept at the end of forward
    assert full.simulated["unsharded_param"] < sgo.simulated["unsharded_param"]


CONFIGS = REPO / "examples" / "configs"


def test_budget_prints_the_auto_plans_table_for_llama_3_8b_on_eight_gpus(capsys):
    argv = ["--config", str(CONFIGS / "llama-3-8b"), "--world-size", "8", "--lora-rank", "16", "--precision",
            "bf16-true", "--seq-len", "128", "--budget", "24GiB", "--hardware", "l4",
            "--allow-quantize", "int8"]  # fmt: skip
    table = run(argv)
    rows = [line for line in table.splitlines() if line.lstrip(" *").split(" ")[0].isdigit()]
    # strategies with HYBRID_SHARD in groups of 2 and 4; lora_only (not for NO_SHARD); checkpointing; offload; int8
    assert len(rows) == (4 * 2 + 1) * 2 * 3 * 2 and "HYBRID_SHARD/4 + lora_only + cpu_offload + int8" in table
    assert "budget 24.00 GiB per device, 21.60 GiB usable" in table and "l4 preset" in table
    chosen = next(line for line in table.splitlines() if line.startswith("chosen: #"))
    number = int(chosen.split("#")[1].split(" ")[0])
    steps = {int(r.split()[0].lstrip("*")): float(r.split(" yes ")[1].split()[0]) for r in rows if " yes " in r}
    assert number in steps and steps[number] == min(steps.values())  # the fastest of those that fit
    assert rows[number - 1].lstrip().startswith(f"*{number} ") and len(steps) < len(rows)  # and some do not


def test_budget_below_every_candidate_exits_2_with_the_closest_for_llama_3_70b(capsys):
    argv = ["--config", str(CONFIGS / "llama-3-70b"), "--world-size", "8", "--seq-len", "256", "--budget", "8GiB"]
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and "auto plan for" in out  # the table still shows what was considered
    assert re.search(r"none of the 30 candidates fits at 8 rank\(s\).*Closest: FULL_SHARD( \+ [a-z_]+)*"
                     r" needs [\d.]+ GiB per rank, [\d.]+ GiB \([\d,]+ bytes\) more", err)  # fmt: skip
    with pytest.raises(SystemExit):
        run(["--params", "7e10", "--world-size", "8", "--budget", "80GiB"])
    assert "--budget needs --config" in capsys.readouterr().err


def test_budget_json_holds_every_candidate_and_the_choice():
    tiny = REPO / "examples" / "assets" / "tiny-llama"
    document = json.loads(run(["--config", str(tiny), "--world-size", "2", "--lora-rank", "4", "--budget", "0.5",
                               "--hardware", "a100", "--seq-len", "64", "--json"]))  # fmt: skip
    fitting = [c for c in document["candidates"] if c["fits"]]
    best = document["candidates"][document["chosen"]]
    assert len(document["candidates"]) == 30 and best["fits"]  # 3 layouts, lora_only on 2, 3 checkpointings, offload
    assert best["step"]["total"] == min(c["step"]["total"] for c in fitting)
    assert document["hardware"]["source"].startswith("a100 preset")


def test_the_root_kept_gathered_counts_at_the_end_of_forward_and_a_resharded_one_in_the_transient():
    from lightning_fsdp_plus.memory.estimate import ModelDescription, describe_param_count, estimate_strategy
    from lightning_fsdp_plus.plan import ParamInfo, ShardingStrategy

    def info(name, shape):
        return ParamInfo(name, shape, torch.float32, True, True, 0)

    # unit a: 1000 elements; the root: 100 (fp32: 4000 and 400 bytes gathered)
    model = ModelDescription(units=((info("a.weight", (100, 10)),), (info("r.weight", (10, 10)),)),
                             activation_bytes=0)  # fmt: skip
    full = ShardingStrategy.FULL_SHARD

    def estimate(strategy=full, **kwargs):
        return estimate_strategy(model, sharding_strategy=strategy, world_size=2, precision="32-true", **kwargs)

    kept, freed = estimate(), estimate(reshard_root=True)
    assert kept.unsharded_params == 400 and freed.unsharded_params == 0
    # backward around unit a: twice (its 4000-byte gathered copy + 4000 bytes of gradients), whatever the root does
    assert kept.largest_unit_transient_bytes == freed.largest_unit_transient_bytes == 2 * 8000
    assert estimate(ShardingStrategy.SHARD_GRAD_OP, reshard_root=True).unsharded_params == 4400  # nothing reshards
    # a model known only by its size has no root apart: nothing is kept under FULL_SHARD
    assert estimate_strategy(describe_param_count(1e6), sharding_strategy=full, world_size=2).unsharded_params == 0


def test_backward_transient_counts_two_of_the_largest_activation_and_the_largest_weight_dequantized():
    from lightning_fsdp_plus.memory.estimate import ModelDescription, estimate_strategy
    from lightning_fsdp_plus.plan import ParamInfo, ShardingStrategy

    # unit a: an int8 weight of 100 x 10 (and its scale) plus 40 LoRA elements; the root: 100 float elements
    int8 = (ParamInfo("a.weight", (100, 10), torch.int8, False, True, 0),
            ParamInfo("a.weight_scale", (100,), torch.int32, False, True, 0),
            ParamInfo("a.lora_A.weight", (4, 10), torch.float32, True, True, 0))  # fmt: skip
    root = (ParamInfo("r.weight", (10, 10), torch.float32, True, True, 0),)
    plain = ModelDescription(units=(int8, root), activation_bytes=0)
    saved = dataclasses.replace(plain, largest_activation_bytes=3000)
    for precision, compute in (("32-true", 4), ("bf16-mixed", 2)):
        before, after = (estimate_strategy(m, sharding_strategy=ShardingStrategy.FULL_SHARD, world_size=2,
                                           precision=precision) for m in (plain, saved))  # fmt: skip
        # unit a re-gathered: 1000 int8 + 400 scale bytes + 40 LoRA elements, and 40 gradients; doubled
        assert before.largest_unit_transient_bytes == 2 * (1000 + 400 + 80 * compute) + 1000 * compute
        assert after.largest_unit_transient_bytes == before.largest_unit_transient_bytes + 2 * 3000
    tiny = REPO / "examples" / "assets" / "tiny-llama"
    config = json.loads((tiny / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    plain = describe_config(tiny, precision="32-true", options=FSDPPlusOptions(), batch=ForwardBatch(2, 16),
                            chunked_loss=False)  # fmt: skip
    assert plain.largest_activation_bytes == 2 * 16 * vocab * 4  # the model's own loss: the fp32 logits
    chunked = describe_config(tiny, precision="32-true", options=FSDPPlusOptions(), batch=ForwardBatch(2, 16))
    # the chunked loss keeps the (trained, tied) head's weight gradient from forward instead: vocab x hidden fp32
    assert chunked.largest_activation_bytes == vocab * hidden * 4


def test_the_real_peak_adds_the_platforms_gather_copy_of_the_largest_unit_and_its_allocator_factor():
    import math

    from lightning_fsdp_plus.memory.allocator import CUDA_CONTEXT_BYTES, GLIBC_FACTOR, PLATFORMS, TCMALLOC_FACTOR
    from lightning_fsdp_plus.memory.estimate import ModelDescription, estimate_strategy
    from lightning_fsdp_plus.plan import ParamInfo, ShardingStrategy

    def info(name, shape):
        return ParamInfo(name, shape, torch.float32, True, True, 0)

    # unit a: 1000 elements (4000 bytes gathered in fp32), the root 100
    model = ModelDescription(units=((info("a.weight", (100, 10)),), (info("r.weight", (10, 10)),)),
                             activation_bytes=500)  # fmt: skip

    def estimate(strategy=ShardingStrategy.FULL_SHARD, platform="cuda"):
        return estimate_strategy(model, sharding_strategy=strategy, world_size=2, precision="32-true",
                                 platform=PLATFORMS[platform])  # fmt: skip

    cuda, tcmalloc, glibc = estimate(), estimate(platform="cpu-tcmalloc"), estimate(platform="cpu-glibc")
    assert cuda.live_peak_bytes_per_rank == cuda.peak_with_transient_bytes_per_rank  # NCCL gathers in place
    # outside the allocator: the CUDA context and one 2-rank NCCL communicator (544 MiB, NVIDIA/nccl#964)
    assert cuda.real_peak_bytes_per_rank - cuda.live_peak_bytes_per_rank == cuda.runtime_bytes_per_rank
    assert cuda.runtime_bytes_per_rank == CUDA_CONTEXT_BYTES + 544 * 2**20
    assert tcmalloc.runtime_bytes_per_rank == 0
    assert tcmalloc.live_peak_bytes_per_rank == cuda.peak_with_transient_bytes_per_rank + 4000  # gloo's temporary
    assert tcmalloc.real_peak_bytes_per_rank == math.ceil(tcmalloc.live_peak_bytes_per_rank * TCMALLOC_FACTOR)
    assert glibc.real_peak_bytes_per_rank == math.ceil(tcmalloc.live_peak_bytes_per_rank * GLIBC_FACTOR)
    assert (tcmalloc.platform, glibc.platform) == ("cpu-tcmalloc", "cpu-glibc")
    no_shard = estimate(ShardingStrategy.NO_SHARD, platform="cpu-tcmalloc")  # nothing is gathered over ranks
    assert no_shard.live_peak_bytes_per_rank == no_shard.peak_with_transient_bytes_per_rank


def test_the_table_says_what_the_cuda_runtime_adds_outside_the_allocator(tmp_path):
    from lightning_fsdp_plus.memory.allocator import CUDA_CONTEXT_BYTES

    tiny_llama().config.save_pretrained(tmp_path)
    common = ["--config", str(tmp_path), "--strategy", "full_shard", "--batch-size", "2", "--seq-len", "16"]
    cuda = run([*common, "--world-size", "1", "2"])
    low, high = CUDA_CONTEXT_BYTES / 2**30, (CUDA_CONTEXT_BYTES + 544 * 2**20) / 2**30
    assert f"note: the real peak includes {low:.2f} to {high:.2f} GiB the CUDA runtime holds" in cuda
    doc = json.loads(run([*common, "--world-size", "2", "--json"]))["strategies"]["FULL_SHARD"]
    assert doc["real_peak_bytes_per_rank"] == doc["live_peak_bytes_per_rank"] + doc["runtime_bytes_per_rank"]
    assert "CUDA runtime" not in run([*common, "--world-size", "2", "--platform", "cpu-tcmalloc"])


def test_tensor_parallel_splits_the_planned_layers_and_fsdp_shards_over_the_data_parallel_ranks(tmp_path):
    """Issue 48: at tensor 2 x data 2, each projection of the declared plan counts half its elements, sharded over
    2 ranks; the embeddings, norms and head whole, sharded over the same 2 (32-true: 4 bytes an element)."""
    from lightning_fsdp_plus.plan import sharded_numel

    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    split = {".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj."}
    expected = 0
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if any(s in name for s in split):
            shape[1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0] //= 2
        expected += sharded_numel(tuple(shape), 2) * 4
    _, (tp,) = estimate_memory(config=tmp_path, world_size=4, strategy="FULL_SHARD", precision="32-true",
                               tensor_parallel_size=2)  # fmt: skip
    _, (fsdp,) = estimate_memory(config=tmp_path, world_size=4, strategy="FULL_SHARD", precision="32-true")
    assert tp.params == expected and tp.shard_size == 2 and tp.tensor_parallel_size == 2
    assert tp.params != fsdp.params
    with pytest.raises(EstimateError, match=r"tensor_parallel_size=2 does not divide world_size=3"):
        estimate_memory(config=tmp_path, world_size=3, strategy="FULL_SHARD", tensor_parallel_size=2)
    with pytest.raises(EstimateError, match=r"tensor_parallel_size needs config="):
        estimate_memory(params=1e9, world_size=4, tensor_parallel_size=2)
    # loss parallel: the head's rows split too, and the loss is the model's own (the whole logits counted)
    even = tmp_path / "vocab64"
    model.config.vocab_size = 64  # tiny_llama's 61 rows do not split in 2
    model.config.save_pretrained(even)
    common = dict(config=even, world_size=4, strategy="FULL_SHARD", precision="32-true", tensor_parallel_size=2)
    model_lp, (lp,) = estimate_memory(**common, loss_parallel=True)
    model_own, (own,) = estimate_memory(**common, chunked_loss=False)
    model_chunked, _ = estimate_memory(**common)
    head = (64, model.config.hidden_size)
    assert own.params - lp.params == (sharded_numel(head, 2) - sharded_numel((32, head[1]), 2)) * 4
    assert model_lp.activation_bytes == model_own.activation_bytes != model_chunked.activation_bytes
    with pytest.raises(EstimateError, match=r"does not divide the vocabulary of model\.lm_head \(out_features=61\)"):
        estimate_memory(config=tmp_path, world_size=4, tensor_parallel_size=2, loss_parallel=True)
