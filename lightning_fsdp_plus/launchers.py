"""Launchers: Lightning's multiprocessing launcher taught to return sharded weights to the main process."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_fsdp_plus._private import _MultiProcessingLauncher, _WorkerOutput


class FSDPPlusSpawnLauncher(_MultiProcessingLauncher):
    """``spawn`` / ``fork`` / ``forkserver`` launch for FSDP2 models.

    Lightning's launcher pickles ``lightning_module.state_dict()`` from rank 0 back to the main process;
    under FSDP2 that holds DTensor shards which cannot be loaded there. Every rank gathers the full
    state dict instead (a collective), and rank 0 hands plain tensors back.
    """

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(trainer.strategy.model, options=options)
        if self._strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
