"""``StreamingLoadPlanner``: a ``torch.distributed.checkpoint`` load planner that converts while it reads.

DCP's documented extension point: the plan asks the storage reader (``HuggingFaceStorageReader``, which reads
``safe_open(...).get_slice(key)[rows]``) for exactly this rank's slice of each target; ``resolve_tensor`` hands
it the destination — the shard itself when nothing needs converting, else a staging buffer of that slice only —
and ``commit_tensor`` converts the buffer into the shard (a second dtype cast, a transpose, LLM.int8 quantization
of the rows) and lets it go. A rank never holds more than its shards plus one slice. A replicated int8 weight is
quantized in row blocks (each rank its own) and completed by an all-gather after the read (``finish``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from lightning_fsdp_plus.loading.files import PretrainedLoadError
from lightning_fsdp_plus.loading.targets import LoadTarget
from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear, quantize_rows


def local_part(tensor: Tensor) -> tuple[Tensor, ChunkStorageMetadata]:
    """This rank's local tensor and where it sits in the full tensor (offsets, sizes)."""
    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()
        return tensor.to_local(), chunk
    return tensor, ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())


def row_block(rows: int, *, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of this rank's rows when ``rows`` are split as ``torch.chunk`` / DTensor ``Shard(0)`` do."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@torch.no_grad()
def _all_gather_rows(param: Tensor, block: Tensor, *, world: int) -> None:
    """Fill ``param`` with every rank's row block (torch.chunk split): one ``all_gather_single``, into
    ``param`` itself when the rows split evenly, else into a padded buffer first."""
    rows = param.size(0)
    size = -(-rows // world)
    if block.size(0) < size:  # the last blocks of an uneven split are shorter (or empty): pad to the same size
        block = torch.cat([block, block.new_zeros(size - block.size(0), *block.shape[1:])])
    if size * world == rows and param.is_contiguous():
        dist.all_gather_single(param, block)
        return
    gathered = block.new_empty(size * world, *block.shape[1:])
    dist.all_gather_single(gathered, block)
    param.copy_(gathered[:rows])


ROW_TENSORS = {Int8Linear: ("weight", "weight_scale"), FourBitLinear: ("weight", "weight_absmax")}
"""The tensors of a quantized layer that hold one row (or row of blocks) per output feature."""


def quantized_rows(layer: nn.Module, rows: Tensor) -> dict[str, Tensor]:
    """A block of float weight rows quantized as ``layer`` stores them, by tensor name (rows quantize on their own:
    LLM.int8 per row; 4-bit per block, and blocks lie inside rows)."""
    if isinstance(layer, Int8Linear):
        weight, scale = quantize_rows(rows)
        return {"weight": weight, "weight_scale": scale.to(torch.float32).view(torch.int32)}
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(rows.contiguous(), blocksize=layer.blocksize, quant_type=layer.quant_type)
    absmax = state.absmax.to(torch.float32).view(torch.int32).reshape(rows.size(0), -1)
    return {"weight": packed.reshape(rows.size(0), -1), "weight_absmax": absmax}


def _narrow(tensor: Tensor, offsets: Any, lengths: Any) -> Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class StreamingLoadPlanner(DefaultLoadPlanner):
    """Reads each :class:`LoadTarget`'s local slice from the checkpoint into ``root``'s (sharded) tensors.

    Arguments:
        root: The module the targets' paths start from.
        targets: What to fill, from which checkpoint key.
    """

    def __init__(self, root: nn.Module, targets: list[LoadTarget]) -> None:
        super().__init__()
        self.root, self.targets = root, targets
        self.bytes_read = 0
        self._buffers: dict[torch.dtype, Tensor] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """Keep the checkpoint's metadata (the state dict is unused: the targets say what to load)."""
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """One read per target and checkpoint chunk overlapping this rank's part of it."""
        assert self.metadata is not None
        items: list[ReadItem] = []
        for i, target in enumerate(self.targets):
            stored = self.metadata.state_dict_metadata.get(target.key)
            if stored is None:  # the files changed since the model was built
                raise PretrainedLoadError(f"{target.key} is no longer in the checkpoint's files")
            tensor = target.tensor(self.root)
            _, chunk = local_part(tensor)
            if target.gather:  # this rank's block of rows of the replicated weight
                start, stop = row_block(tensor.size(0), rank=dist.get_rank(), world=dist.get_world_size())
                chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([stop - start, 1]))
            if target.quantize:  # whole float rows, however the quantized layer packs them
                in_features = self.root.get_submodule(target.module_path).in_features
                chunk = ChunkStorageMetadata(offsets=torch.Size([chunk.offsets[0], 0]),
                                             sizes=torch.Size([chunk.sizes[0], in_features]))  # fmt: skip
            if chunk.sizes.numel() == 0:
                continue  # an uneven split left this rank no rows
            if target.transposed:
                chunk = ChunkStorageMetadata(
                    offsets=torch.Size(chunk.offsets[::-1]), sizes=torch.Size(chunk.sizes[::-1])
                )
            for item in create_read_items_for_chunk_list(target.key, stored, [chunk]):  # type: ignore[arg-type]
                dest = MetadataIndex(str(i), item.dest_index.offset, item.dest_index.index)
                items.append(dataclasses.replace(item, dest_index=dest))
        return LoadPlan(items)

    def _target(self, item: ReadItem) -> LoadTarget:
        return self.targets[int(item.dest_index.fqn)]

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        """The shard slice itself when no conversion is needed, else a staging buffer of the slice."""
        target = self._target(read_item)
        local, _ = local_part(target.tensor(self.root))
        stored = self.metadata.state_dict_metadata[target.key]  # type: ignore[union-attr]
        self.bytes_read += read_item.lengths.numel() * stored.properties.dtype.itemsize  # type: ignore[union-attr]
        if target.quantize or target.transposed or target.load_dtype != local.dtype:
            return self._staging(read_item.lengths, self._staging_dtype(target, stored.properties.dtype))
        return _narrow(local, read_item.dest_offsets, read_item.lengths)

    def _staging(self, shape: Any, dtype: torch.dtype) -> Tensor:
        # one grow-only buffer per dtype, reused for every slice: fresh pages cost a page fault each, and the
        # reader (thread_count=1) commits each slice before it resolves the next
        numel = torch.Size(shape).numel()
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(tuple(shape))

    def _staging_dtype(self, target: LoadTarget, stored: torch.dtype) -> torch.dtype:
        # LLM.int8 quantizes fp16 rows; when the stored dtype is the load dtype the first cast is exact, so the
        # slice is read straight into fp16 (one copy less, the same bits). 4-bit quantizes the load dtype itself.
        int8 = isinstance(self.root.get_submodule(target.module_path), Int8Linear)
        if target.quantize and int8 and stored == target.load_dtype:
            return torch.float16
        return target.load_dtype

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        """Convert a staged slice into the shard (cast, transpose, quantize); a direct read is already there."""
        target = self._target(read_item)
        owner = self.root.get_submodule(target.module_path)
        local, _ = local_part(getattr(owner, target.attribute))
        offsets, lengths = tuple(read_item.dest_offsets), tuple(read_item.lengths)
        if target.transposed:
            tensor, offsets, lengths = tensor.t(), offsets[::-1], lengths[::-1]
        if not target.quantize and tensor.data_ptr() == _narrow(local, offsets, lengths).data_ptr():
            return  # read straight into the shard
        with torch.no_grad():
            if not target.quantize:
                _narrow(local, offsets, lengths).copy_(tensor)
                return
            if lengths[1] != owner.in_features:
                raise PretrainedLoadError(f"{target.key}: quantization needs whole rows, but a read covers part of one")
            if target.gather:  # this rank's rows go to their place in the full weight; the rest comes by all-gather
                offsets = (row_block(local.size(0), rank=dist.get_rank(), world=dist.get_world_size())[0], 0)
            rows = slice(offsets[0], offsets[0] + lengths[0])
            for name, value in quantized_rows(owner, tensor).items():
                destination, _ = local_part(getattr(owner, name))
                destination[rows].copy_(value)

    def finish(self) -> None:
        """After the read, on every rank: 4-bit layers get their type's 16 levels (``quant_map``; a rank may have
        read no row of a layer), and every replicated quantized weight is completed from the row blocks the ranks
        quantized, by all-gather, in target order."""
        from bitsandbytes.functional import get_4bit_type

        for target in self.targets:
            owner = self.root.get_submodule(target.module_path)
            if target.quantize and isinstance(owner, FourBitLinear):
                levels = get_4bit_type(owner.quant_type, device=owner.quant_map.device)
                owner.quant_map.copy_(levels.to(torch.float32).view(torch.int32))
        if not any(t.gather for t in self.targets):
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        for target in self.targets:
            if target.gather:
                owner = self.root.get_submodule(target.module_path)
                start, stop = row_block(owner.weight.size(0), rank=rank, world=world)
                for name in ROW_TENSORS[type(owner)]:
                    param = getattr(owner, name)
                    _all_gather_rows(param, param[start:stop].clone(), world=world)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Pretrained checkpoints hold tensors only."""
        raise PretrainedLoadError(f"{read_item.storage_index.fqn} is not a tensor in the checkpoint")
