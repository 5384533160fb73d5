"""Data modules for the ``fsdp-plus-train`` app."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset


class ArithmeticSequences(Dataset):
    """Sequences ``a, a+d, a+2d, ... (mod vocab_size)``: a pattern a small model learns in a few dozen steps."""

    def __init__(self, *, n: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (n, 1), generator=g)
        step = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + step * torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class SyntheticLMDataModule(LightningDataModule):
    """Arithmetic token sequences generated in memory (no files, no download).

    Arguments:
        batch_size: Sequences per rank per step.
        seq_len: Tokens per sequence.
        vocab_size: Token ids are drawn below this.
        train_size: Training sequences.
        val_size: Held-out sequences (a different seed).
        num_workers: DataLoader workers per rank.
        seed: Seed of the training sequences.
    """

    def __init__(
        self,
        *,
        batch_size: int = 8,
        seq_len: int = 32,
        vocab_size: int = 128,
        train_size: int = 2048,
        val_size: int = 128,
        num_workers: int = 0,
        seed: int = 1,
    ) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_set = ArithmeticSequences(n=train_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
        self.val_set = ArithmeticSequences(n=val_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed + 1)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (Lightning adds the distributed sampler)."""
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches in a fixed order."""
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
