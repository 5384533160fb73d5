"""``start_method="spawn"`` with a deferred pretrained model: the main process gets the trained weights.

    python tests/loading/spawn_fit.py --checkpoint DIR --out OUT

The main process never loads the weights (its model stays on meta); the workers stream them, train LoRA on an
int8 base, and hand the full state dict back. Writes ``OUT/spawn.json``: whether the main process's state dict
equals what rank 0 gathered in the workers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.app.lm import CausalLMModule


class SaveWorkerState(Callback):
    """Rank 0 saves the full state dict at the end of training (every rank gathers)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, module: CausalLMModule) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(trainer.strategy.model, options=options)
        if trainer.global_rank == 0:
            torch.save(state, self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    seed_everything(0)
    module = CausalLMModule.from_pretrained(str(args.checkpoint), lr=1e-2)
    data = [(torch.arange(16).view(2, 8) * (i + 3)) % 200 for i in range(3)]
    strategy = FSDPPlusStrategy(start_method="spawn", lora={"r": 4, "alpha": 8}, quantize_base="int8")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[SaveWorkerState(args.out / "worker.pt")])  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    worker, main_process = torch.load(args.out / "worker.pt", weights_only=True), module.state_dict()
    result = {
        "meta_left": [k for k, t in main_process.items() if t.is_meta],
        "missing": sorted(set(worker) - set(main_process)),
        "different": [k for k in worker if k in main_process and not torch.equal(main_process[k], worker[k])],
        "int8_layers": sum(t.dtype == torch.int8 for t in main_process.values()),
    }
    (args.out / "spawn.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
