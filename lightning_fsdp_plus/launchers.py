"""Launchers: Lightning's multiprocessing launcher taught to return sharded weights to the main process."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_fsdp_plus._private import _MultiProcessingLauncher, _WorkerOutput
from lightning_fsdp_plus.pipeline import quantize_model


class FSDPPlusSpawnLauncher(_MultiProcessingLauncher):
    """``spawn`` / ``fork`` / ``forkserver`` launch for FSDP2 models.

    Lightning's launcher pickles ``lightning_module.state_dict()`` from rank 0 back to the main process;
    under FSDP2 that holds DTensor shards which cannot be loaded there. Every rank gathers the full
    state dict instead (a collective), and rank 0 hands plain tensors back. The main process's module is given
    the workers' int8 layers first, and takes the tensors as they are (``assign``), so a model that was never
    loaded there (a deferred pretrained one, on meta) receives the trained weights too.
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

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        if worker_output.weights_path is not None:
            module = trainer.lightning_module
            quantize_model(module, self._strategy.options)  # the workers' Int8Linear layers: every key fits
            state_dict = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(state_dict, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
