"""The global sample order: the same global batches on any layout, and a position that resumes on another one."""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_fsdp_plus.sampler import GlobalBatchSampler, LayoutError, accumulation_for

DATASET = list(range(100))
LAYOUTS = [(1, 8), (2, 8), (2, 4), (4, 4), (4, 2), (8, 1)]
"""(ranks, micro-batch) pairs that keep a global batch of 16."""


def _samplers(world: int, micro: int, **kwargs) -> list[GlobalBatchSampler]:
    return [GlobalBatchSampler(DATASET, global_batch_size=16, micro_batch_size=micro, world_size=world, rank=r, seed=3,
                               **kwargs) for r in range(world)]  # fmt: skip


def _assemble(streams: list[list[int]], *, micro: int, accumulate: int) -> list[list[int]]:
    """Each optimizer step's samples from every rank's stream, in the order the layout takes them."""
    out = []
    for k in range(len(streams[0]) // (micro * accumulate)):
        batch = []
        for j in range(accumulate):
            for stream in streams:
                start = (k * accumulate + j) * micro
                batch += stream[start : start + micro]
        out.append(batch)
    return out


def _global_batches(samplers: list[GlobalBatchSampler], epoch: int) -> list[list[int]]:
    """Each optimizer step's samples over every rank and micro-step of one epoch."""
    streams = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        streams.append(list(sampler))
    return _assemble(streams, micro=samplers[0].micro_batch_size, accumulate=samplers[0].accumulate)


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_every_layout_sees_the_same_samples_in_the_same_global_batches(epoch):
    reference = _global_batches(_samplers(2, 8), epoch)
    assert len(reference) == 7 and all(len(b) == 16 for b in reference)
    seen = [i for b in reference for i in b]
    assert set(seen) == set(DATASET) and seen[100:] == seen[:12]  # every sample; the last batch filled from the start
    for world, micro in LAYOUTS:
        assert _global_batches(_samplers(world, micro), epoch) == reference, (world, micro)
    assert _global_batches(_samplers(2, 8), epoch + 1) != reference  # another epoch, another order


def test_weights_give_each_sample_its_global_batchs_total_on_every_layout():
    weights = [i % 7 + 1 for i in DATASET]
    for world, micro in LAYOUTS:
        for sampler in _samplers(world, micro, weights=weights):
            sampler.set_epoch(2)
            pairs = list(sampler)
            order = sampler.order(2)
            for n, (index, total) in enumerate(pairs):
                step = n // (micro * sampler.accumulate)
                members = order[step * 16 : (step + 1) * 16].tolist()
                assert index in members and total == sum(weights[i] for i in members)


@pytest.mark.parametrize(("before", "after"), [((2, 8), (1, 8)), ((2, 8), (4, 4)), ((4, 2), (2, 8)), ((2, 8), (2, 8))])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_position_saved_on_one_layout_continues_at_the_same_sample_on_another(before, after, epoch):
    """Through torchdata's StatefulDataLoader as Lightning drives it on a resume: the loader's state is loaded and
    its iterator made before the sampler is told the epoch (the order that made resuming past epoch 1 inexact)."""
    consumed_steps = 3
    old = _samplers(*before)
    states = []
    for sampler in old:
        loader = StatefulDataLoader(DATASET, batch_size=sampler.micro_batch_size, sampler=sampler)
        sampler.set_epoch(epoch)
        iterator = iter(loader)
        for _ in range(consumed_steps * sampler.accumulate):
            next(iterator)
        states.append(loader.state_dict())
    positions = {s["_sampler_iter_state"]["sampler_state"]["position"] for s in states}
    assert positions == {consumed_steps * 16}  # every rank saves the same global position
    uninterrupted = [b for k, b in enumerate(_global_batches(_samplers(*after), epoch)) if k >= consumed_steps]
    resumed = []
    for sampler in _samplers(*after):
        loader = StatefulDataLoader(DATASET, batch_size=sampler.micro_batch_size, sampler=sampler)
        loader.load_state_dict(states[0])
        iterator = iter(loader)  # Lightning: before _set_sampler_epoch
        sampler.set_epoch(epoch)
        resumed.append(torch.cat(list(iterator)).tolist())
    layout = _samplers(*after)[0]
    assert _assemble(resumed, micro=layout.micro_batch_size, accumulate=layout.accumulate) == uninterrupted


def test_a_position_inside_a_micro_step_of_the_new_layout_is_refused():
    (sampler,) = _samplers(1, 8)
    with pytest.raises(LayoutError, match=r"stopped at sample 4 of its epoch.*1 ranks x micro-batch 8 = 8 samples"):
        sampler.load_state_dict({"epoch": 0, "position": 4, "global_batch_size": 16})


def test_a_changed_global_batch_continues_the_same_order_with_a_warning():
    sampler = GlobalBatchSampler(DATASET, global_batch_size=32, micro_batch_size=8, world_size=2, seed=3)
    with pytest.warns(UserWarning, match="global batch size 32 .*written with 16"):
        sampler.load_state_dict({"epoch": 1, "position": 32, "global_batch_size": 16})
    sampler.set_epoch(1)
    assert list(sampler)[:8] == sampler.order(1)[32:40].tolist()


def test_layouts_that_cannot_keep_the_global_batch_name_the_numbers_and_the_nearest_micro_batch():
    assert accumulation_for(global_batch_size=16, world_size=1, micro_batch_size=8) == 2
    assert accumulation_for(global_batch_size=16, world_size=4, micro_batch_size=4) == 1
    with pytest.raises(LayoutError, match=r"global batch size 16 cannot be split over 3 ranks x micro-batch 8"
                                          r".*no micro-batch keeps it on 3 ranks"):  # fmt: skip
        accumulation_for(global_batch_size=16, world_size=3, micro_batch_size=8)
    with pytest.raises(LayoutError, match=r"over 4 ranks x micro-batch 3 \(12 samples a micro-step\); the nearest"
                                          r" micro-batch that keeps it is 4 \(valid: 1, 2, 4\)"):  # fmt: skip
        accumulation_for(global_batch_size=16, world_size=4, micro_batch_size=3)
    with pytest.raises(LayoutError, match="global_batch_size=0 must be a positive integer"):
        accumulation_for(global_batch_size=0, world_size=1, micro_batch_size=1)


def test_a_training_set_smaller_than_a_global_batch_is_repeated_to_fill_it():
    small = list(range(10))
    samplers = [GlobalBatchSampler(small, global_batch_size=16, micro_batch_size=8, world_size=2, rank=r)
                for r in range(2)]  # fmt: skip
    (batch,) = _global_batches(samplers, 0)
    assert sorted(set(batch)) == small and len(batch) == 16
