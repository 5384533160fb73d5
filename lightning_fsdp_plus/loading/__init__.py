"""Streaming loading of pretrained checkpoints: build on meta, shard, then every rank reads only its shards.

    model = deferred_pretrained("meta-llama/Llama-3.1-8B", dtype="bfloat16")   # no weight read, no memory
    # ... LoRA, int8, fully_shard (FSDPPlusStrategy does this in setup) ...
    load_pretrained_weights(model, device=device)                              # each rank: its slices only

``FSDPPlusStrategy`` calls :func:`load_pretrained_weights` itself as the last stage of its preparation
pipeline; ``CausalLMModule.from_pretrained`` and the app's ``model=pretrained`` use :func:`deferred_pretrained`.
"""

from lightning_fsdp_plus.loading.build import PretrainedSource, deferred_pretrained, pretrained_source
from lightning_fsdp_plus.loading.files import CheckpointFiles, PretrainedLoadError, read_checkpoint
from lightning_fsdp_plus.loading.load import LoadSummary, has_pending_weights, load_pretrained_weights
from lightning_fsdp_plus.loading.targets import LoadTarget, checkpoint_key, collect_targets

__all__ = [
    "CheckpointFiles",
    "LoadSummary",
    "LoadTarget",
    "PretrainedLoadError",
    "PretrainedSource",
    "checkpoint_key",
    "collect_targets",
    "deferred_pretrained",
    "has_pending_weights",
    "load_pretrained_weights",
    "pretrained_source",
    "read_checkpoint",
]
