"""One global sample order for any number of ranks: a run resumed on more or fewer devices sees the same samples in
the same global batches.

torch's ``DistributedSampler`` deals each rank every ``num_replicas``-th index of the epoch's permutation, so the
batches a run sees depend on how many ranks it has, and its resumable position is a per-rank count. Here the order
and the batches belong to the run, not to the layout:

* each epoch's order is a permutation of the dataset fixed by the seed and the epoch alone;
* global batch ``k`` is the order's samples ``[k * G, (k + 1) * G)`` for the global batch size ``G``; an incomplete
  last one is filled from the start of the order (as ``DistributedSampler`` pads, but the same on every layout);
* a global batch is split into ``accumulate`` micro-steps of ``world_size`` micro-batches: micro-step ``j`` of rank
  ``r`` takes ``[(j * world_size + r) * m, ... + m)`` of it (``m``: the micro-batch size), so
  ``G = world_size * m * accumulate``;
* the position saved with the loader (through torchdata's ``StatefulDataLoader``) is the epoch and the number of
  the epoch's samples consumed by all ranks together; loaded on another layout it continues at that sample.

:func:`accumulation_for` checks that a layout can keep a global batch and gives its accumulation. Samplers yield
plain indices, or with ``weights`` (a sample's tokens in the loss) ``(index, weight of its global batch)`` pairs,
so a loss can be normalised by the whole global batch's tokens and come out the same on any layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler


class LayoutError(ValueError):
    """A device layout that cannot keep the global batch size, with the numbers and the nearest valid micro-batch."""


def data_parallel_ranks(trainer: Any) -> tuple[int, int]:
    """``(ranks, this rank)`` among the data-parallel ranks, which see different batches: the strategy's distributed
    sampler arguments (a tensor-parallel group of ``fsdp_plus``, or ``ModelParallelStrategy``'s, counts once), else
    every rank of the world."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return kwargs.get("num_replicas", trainer.world_size), kwargs.get("rank", trainer.global_rank)


def accumulation_for(*, global_batch_size: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-steps per optimizer step that keep ``global_batch_size`` on ``world_size`` ranks of ``micro_batch_size``
    samples; :class:`LayoutError` when it does not divide, naming the micro-batch sizes that would."""
    for key, value in (("global_batch_size", global_batch_size), ("world_size", world_size),
                       ("micro_batch_size", micro_batch_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{key}={value!r} must be a positive integer")
    per_step = world_size * micro_batch_size
    if global_batch_size % per_step == 0:
        return global_batch_size // per_step
    valid = [m for m in range(1, global_batch_size // world_size + 1) if global_batch_size % (world_size * m) == 0]
    nearest = min(valid, key=lambda m: (abs(m - micro_batch_size), -m)) if valid else None
    hint = (f"; the nearest micro-batch that keeps it is {nearest} (valid: {', '.join(map(str, valid))})" if nearest
            else f"; no micro-batch keeps it on {world_size} ranks: use a number of ranks that divides it")  # fmt: skip
    raise LayoutError(f"global batch size {global_batch_size} cannot be split over {world_size} ranks x micro-batch"
                      f" {micro_batch_size} ({per_step} samples a micro-step){hint}")  # fmt: skip


class GlobalBatchSampler(DistributedSampler):
    """This rank's samples of the run's global batches (see the module docstring); resumable on any layout.

    Arguments:
        dataset: The training set (only its length is used).
        global_batch_size: Samples per optimizer step, over all ranks and micro-steps.
        micro_batch_size: Samples per rank per forward (the loader's ``batch_size``).
        world_size: Ranks.
        rank: This rank.
        seed: Seed of the order (with the epoch).
        weights: Per sample, its weight in the loss (tokens counted): then each index comes with its global
            batch's total weight as ``(index, total)``.

    A ``DistributedSampler`` for Lightning, which then leaves it in place and sets its epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        weights: Sequence[int] | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.accumulate = accumulation_for(global_batch_size=global_batch_size, world_size=world_size,
                                           micro_batch_size=micro_batch_size)  # fmt: skip
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.length = len(dataset)  # type: ignore[arg-type]
        if weights is not None and len(weights) != self.length:
            raise ValueError(f"weights has {len(weights)} entries for a dataset of {self.length}")
        self.weights = None if weights is None else torch.as_tensor(list(weights), dtype=torch.int64)
        self.position = 0
        """Samples of this epoch's order consumed by all ranks (a multiple of ``world_size * micro_batch_size``)."""
        self._resume: tuple[int, int] | None = None

    @property
    def global_batches(self) -> int:
        """Global batches an epoch holds (the last one filled up, see :meth:`order`)."""
        return -(-self.length // self.global_batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of sample indices (the same on every layout), filled up to whole global batches
        by repeating it from its start, as ``DistributedSampler`` pads: every sample is seen each epoch."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.length, generator=generator)
        total = self.global_batches * self.global_batch_size
        return perm.repeat(-(-total // self.length))[:total]

    def __len__(self) -> int:
        return self.global_batches * self.accumulate * self.micro_batch_size

    def __iter__(self) -> Iterator[Any]:  # a generator: the epoch is read when the first sample is asked for
        start = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        self._resume, self.position = None, start
        order = self.order(self.epoch)
        step = self.num_replicas * self.micro_batch_size
        for k in range(start // self.global_batch_size, self.global_batches):
            base = k * self.global_batch_size
            members = order[base : base + self.global_batch_size]
            total = None if self.weights is None else int(self.weights[members].sum())
            for j in range(self.accumulate):
                if base + j * step < start:
                    continue  # consumed before the checkpoint
                first = base + j * step + self.rank * self.micro_batch_size
                chunk = order[first : first + self.micro_batch_size].tolist()
                for i, index in enumerate(chunk):
                    if i == len(chunk) - 1:  # the micro-step is complete once its last sample is taken
                        self.position = base + (j + 1) * step
                    yield index if total is None else (index, total)

    def state_dict(self) -> dict[str, int]:
        """The epoch, the samples of its order all ranks consumed, and the global batch size."""
        return {"epoch": self.epoch, "position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s sample, on this sampler's layout (any number of ranks and micro-batch size)."""
        saved = state.get("global_batch_size", self.global_batch_size)
        if saved != self.global_batch_size:
            warnings.warn(f"the run continues with global batch size {self.global_batch_size} (its checkpoint was"
                          f" written with {saved}): the same sample order from the same sample on, in other global"
                          " batches", stacklevel=2)  # fmt: skip
        step = self.num_replicas * self.micro_batch_size
        position = int(state["position"])
        if position % step:
            raise LayoutError(f"the loader stopped at sample {position} of its epoch, inside a micro-step of this"
                              f" layout ({self.num_replicas} ranks x micro-batch {self.micro_batch_size} = {step}"
                              f" samples); resume on a layout whose micro-step divides {position}")  # fmt: skip
        self.epoch = int(state["epoch"])
        self._resume, self.position = (self.epoch, position), position
