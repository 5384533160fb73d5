"""Lightning's tensor-parallel example under ``ModelParallelStrategy`` and under ``FSDPPlusStrategy`` (issue 48).

    python -m torch.distributed.run --nproc_per_node=N --standalone tests/helpers/lightning_tp_cases.py --tp T --out DIR

``tests/helpers/lightning_tp/{model,parallelism}.py`` are Lightning's files as it ships them; the LightningModule is
its ``train.py``'s (``parallelize`` in ``configure_model``, the loss and backward under ``loss_parallel``, AdamW at
3e-3), shrunk through ``ModelArgs``, with its weights initialised once in ``__init__`` from a seed instead of again
in ``on_train_start``, so that both runs start equal and nothing rebuilds the complex64 rotary buffer
``freqs_cis`` after the strategy's setup. Each rank's batches come from the Trainer's distributed sampler (the
data-parallel ranks). Rank 0 writes ``DIR/results.json``: each strategy's losses and ``freqs_cis`` dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank

sys.path.insert(0, str(Path(__file__).parent / "lightning_tp"))  # parallelism.py imports `from model import ...`
from model import ModelArgs, Transformer
from parallelism import parallelize

STEPS, BATCH, SEQ, VOCAB = 5, 2, 16, 128


class Llama3(LightningModule):
    """``train.py``'s module, shrunk; initialised once from a seed (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.model_args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=32, max_seq_len=SEQ)
        torch.manual_seed(0)
        self.model = Transformer(self.model_args)

    def configure_model(self):
        parallelize(self.model, device_mesh=self.device_mesh)

    def training_step(self, batch):
        inputs = batch[:, :-1]
        labels = batch[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        dataset = list(torch.randint(0, VOCAB, (64, SEQ + 1), generator=generator))
        return DataLoader(dataset, batch_size=BATCH)


class Record(Callback):
    """The global loss of every step and the rotary buffer's dtype once training starts."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        self.freqs_dtype = str(module.model.freqs_cis.dtype)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float()
        if isinstance(loss, DTensor):  # loss_parallel's loss: replicated over the tensor-parallel ranks
            loss = loss.full_tensor()
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())


def fit(strategy) -> Record:
    seed_everything(0)
    record = Record()
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[record])  # fmt: skip
    trainer.fit(Llama3())
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    theirs = fit(ModelParallelStrategy(data_parallel_size=world // args.tp, tensor_parallel_size=args.tp))
    options = {"tensor_parallel_size": args.tp} if args.tp > 1 else {}  # TP 1: the default
    ours = fit(FSDPPlusStrategy(**options))
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = {"model_parallel": theirs, "fsdp_plus": ours}
        summary = {name: {"losses": r.losses, "freqs_dtype": r.freqs_dtype} for name, r in runs.items()}
        (args.out / "results.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
    barrier()
