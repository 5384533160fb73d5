"""The step-time model, by hand: a two-unit model whose every figure is worked out in the comments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_fsdp_plus.autoplan.candidates import Candidate
from lightning_fsdp_plus.autoplan.cost import Hardware, predict_step_time
from lightning_fsdp_plus.memory.estimate import ModelDescription, weight_elements
from lightning_fsdp_plus.plan import ParamInfo, ShardingStrategy

FULL, GRAD_OP, NO, HYBRID = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
                             ShardingStrategy.HYBRID_SHARD)  # fmt: skip
# 1 GFLOP/s, 1 MB/s links with 1 ms per collective, 1 M optimizer elements/s, nothing overlapped
HW = Hardware(matmul_flops=1e9, link_bandwidth=1e6, link_latency=1e-3, optimizer_rate=1e6,
              quantized_flops={"int8": 5e8}, host_optimizer_rate=1e5, pcie_bandwidth=1e6)  # fmt: skip


def info(name, shape, dtype=torch.float32, trainable=True, sharded=True):
    return ParamInfo(name, shape, dtype, trainable, sharded, 0)


# unit "a": a 100 x 10 weight (1000 elements, 4000 bytes); the root: 10 x 10 (100 elements, 400 bytes)
FLOAT = ModelDescription(units=((info("a.weight", (100, 10)),), (info("r.weight", (10, 10)),)))


def predict(model=FLOAT, candidate=None, hardware=HW, world_size=2):
    return predict_step_time(model, candidate or Candidate(FULL), hardware=hardware, world_size=world_size, tokens=10,
                             precision="32-true")  # fmt: skip


def test_full_shard_gathers_each_unit_twice_but_the_root_once():
    step = predict()
    # forward 2 x 10 tokens x 1100 weights / 1e9; backward the same again plus the weight gradients
    assert step.compute == pytest.approx(2.2e-5 + 2 * 2.2e-5)
    # unit a: 2 all-gathers + 1 reduce-scatter of 4000 bytes, each 1 ms + 2000 bytes on the wire / 1 MB/s;
    # the root: 1 all-gather + 1 reduce-scatter of 400 bytes (1 ms + 200 us each)
    assert step.collectives == pytest.approx(3 * 3e-3 + 2 * 1.2e-3)
    assert step.optimizer == pytest.approx(550 / 1e6)  # half of the 1100 trainable elements per rank
    assert step.total == pytest.approx(step.compute + step.collectives + step.optimizer)


def test_a_resharded_root_is_gathered_again_for_backward():
    kept, resharded = predict(), predict(candidate=Candidate(FULL, reshard_root=True))
    assert resharded.collectives - kept.collectives == pytest.approx(1.2e-3)  # one more 400-byte all-gather
    # SHARD_GRAD_OP reshards no unit, so neither the root
    assert predict(candidate=Candidate(GRAD_OP, reshard_root=True)).collectives == predict(
        candidate=Candidate(GRAD_OP)).collectives  # fmt: skip


def test_shard_grad_op_gathers_once_and_no_shard_all_reduces():
    assert predict(candidate=Candidate(GRAD_OP)).collectives == pytest.approx(2 * 3e-3 + 2 * 1.2e-3)
    no_shard = predict(candidate=Candidate(NO))
    # all-reduce over 2 replicas: 1 ms + 2 x 4000 x 1/2 bytes / 1 MB/s, and 1 ms + 400 us for the root
    assert no_shard.collectives == pytest.approx(5e-3 + 1.4e-3)
    assert no_shard.optimizer == pytest.approx(1100 / 1e6)


def test_hybrid_shard_reduce_scatters_in_the_group_and_all_reduces_the_shard_across_groups():
    step = predict(candidate=Candidate(HYBRID, 2), world_size=4)
    # in the group of 2 as FULL_SHARD, plus an all-reduce of each unit's half gradient across 2 groups
    assert step.collectives == pytest.approx(3 * 3e-3 + 2 * 1.2e-3 + (1e-3 + 2e-3) + (1e-3 + 2e-4))


def test_checkpointing_recomputes_the_forward_of_every_unit_but_the_root():
    plain, checkpointed = predict(), predict(candidate=Candidate(FULL, activation_checkpointing=True))
    assert checkpointed.compute - plain.compute == pytest.approx(2.2e-5 * 1000 / 1100)


def test_an_int8_base_moves_a_quarter_of_the_fp32_bytes_and_runs_at_its_measured_rate():
    int8 = ModelDescription(units=((info("a.weight", (100, 10), torch.int8, False),
                                    info("a.weight_scale", (100,), torch.int32, False)),
                                   FLOAT.units[1]))  # fmt: skip
    step = predict(int8, Candidate(FULL, quantize_base="int8"))
    # forward 2 x 10 x (100 / 1e9 + 1000 / 5e8) = 4.2e-5, backward the same plus the root's weight gradient
    assert step.compute == pytest.approx(2 * 4.2e-5 + 2e-6)
    # unit a: two gathers of 1000 + 400 bytes and no gradient; the root as before
    assert step.collectives == pytest.approx(2 * (1e-3 + 700 / 1e6) + 2 * 1.2e-3)
    assert weight_elements(info("w.weight", (100, 5), torch.uint8, False)) == 1000  # packed 4-bit: two per byte
    assert weight_elements(info("w.weight_absmax", (100,), torch.int32, False)) == 0


def test_lora_only_gathers_no_base_weights():
    base = info("a.weight", (100, 10), trainable=False, sharded=False)
    replicated = ModelDescription(units=((info("a.lora", (10, 10)),), FLOAT.units[1]), replicated=(base,))
    step = predict(replicated, Candidate(FULL, lora_only=True))
    assert step.collectives == pytest.approx(3 * 1.2e-3 + 2 * 1.2e-3)  # 400-byte LoRA unit and root only


def test_cpu_offload_pays_pcie_and_a_host_optimizer_only_on_accelerators():
    gpu = dataclasses.replace(HW, accelerator=True)
    step = predict(hardware=gpu, candidate=Candidate(FULL, cpu_offload=True))
    # unit a: 2 uploads of its 2000-byte shard + its 2000-byte gradient shard down; the root: 200 + 200
    assert step.offload == pytest.approx(6400 / 1e6) and step.optimizer == pytest.approx(550 / 1e5)
    assert predict(candidate=Candidate(FULL, cpu_offload=True)).offload == 0.0


def test_overlap_hides_collectives_behind_compute():
    slow_compute = dataclasses.replace(HW, matmul_flops=1e6, overlap=0.8)
    step = predict(hardware=slow_compute)
    assert step.total == pytest.approx(step.compute + step.optimizer + max(0.0, step.collectives - 0.8 * step.compute))
    assert step.total < step.compute + step.optimizer + step.collectives


def test_elementwise_work_is_passes_over_the_saved_activations_at_the_probed_memory_bandwidth():
    from lightning_fsdp_plus.autoplan.cost import ELEMENTWISE_PASSES

    # 1000 bytes saved; 1 MB/s streaming: ELEMENTWISE_PASSES x 1 ms on top of the matmuls
    saved = dataclasses.replace(FLOAT, activation_bytes=1000)
    plain = predict(saved, Candidate(FULL))
    streamed = predict_step_time(saved, Candidate(FULL), hardware=dataclasses.replace(HW, memory_bandwidth=1e6),
                                 world_size=2, tokens=10, precision="32-true")  # fmt: skip
    assert streamed.compute == pytest.approx(plain.compute + ELEMENTWISE_PASSES * 1e-3)
    # checkpointing: 200 bytes kept, 400 recomputed per unit (one unit but the root): a third of them once more
    kept = dataclasses.replace(FLOAT, activation_bytes=200, recompute_bytes=400)
    ckpt = predict_step_time(kept, Candidate(FULL, activation_checkpointing=True),
                             hardware=dataclasses.replace(HW, memory_bandwidth=1e6), world_size=2, tokens=10,
                             precision="32-true")  # fmt: skip
    no_stream = predict(kept, Candidate(FULL, activation_checkpointing=True))
    assert ckpt.compute == pytest.approx(no_stream.compute + ELEMENTWISE_PASSES * (200 + 4 / 3 * 400) / 1e6)


def test_selective_checkpointing_recomputes_no_matmul():
    plain = predict()
    full = predict(candidate=Candidate(FULL, activation_checkpointing=True))
    selective = predict(candidate=Candidate(FULL, activation_checkpointing=True, checkpointing_mode="selective"))
    assert plain.compute <= selective.compute < full.compute  # only elementwise work again, no matmul
