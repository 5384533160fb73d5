"""The one stream of batches every system trains on, and the digest that proves it.

:func:`make_plan` tokenizes the shipped examples once (the chat template, the prompt out of the loss: the app's
``encode_record``) and fixes, for every optimizer step and rank, which examples form the micro-batch. Every system
reads the plan file; :func:`micro_batch` pads a micro-batch to its longest example (right padding, labels -100), as
transformers' and TRL's collators do; :func:`digest` hashes the token ids a model was actually given (padding left
out), so a run's per-step digests can be compared across systems.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_FILE = REPO / "examples" / "medical_lora" / "data" / "train.jsonl"
VAL_FILE = REPO / "examples" / "medical_lora" / "data" / "val.jsonl"


def _tokenized(path: Path, tokenizer: Any, *, max_seq_len: int) -> list[dict[str, list[int]]]:
    from lightning_fsdp_plus.app.data import encode_record

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [encode_record(r, tokenizer, max_seq_len=max_seq_len) for r in records]


def step_order(count: int, *, steps: int, ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    """``[step][rank]`` -> example indices: seeded epochs of ``count`` examples, read in order, ``per_rank`` a rank."""
    flat: list[int] = []
    epoch = 0
    while len(flat) < steps * ranks * per_rank:
        order = list(range(count))
        random.Random(seed + epoch).shuffle(order)
        flat += order
        epoch += 1
    take = iter(flat)
    return [[[next(take) for _ in range(per_rank)] for _ in range(ranks)] for _ in range(steps)]


def make_plan(*, base: str, steps: int, ranks: int, per_rank: int, max_seq_len: int, seed: int) -> dict[str, Any]:
    """The plan: the base checkpoint, the tokenized training and held-out examples, and each step's micro-batches."""
    from lightning_fsdp_plus.app.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(base)
    train = _tokenized(TRAIN_FILE, tokenizer, max_seq_len=max_seq_len)
    return {
        "base": base,
        "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        "examples": train,
        "val": _tokenized(VAL_FILE, tokenizer, max_seq_len=max_seq_len),
        "steps": step_order(len(train), steps=steps, ranks=ranks, per_rank=per_rank, seed=seed),
    }


def load_plan(path: str | Path) -> dict[str, Any]:
    """A plan written by :func:`make_plan` (``python -m benchmarks.peers`` writes ``plan.json``)."""
    return json.loads(Path(path).read_text())


def micro_batch(rows: list[dict[str, list[int]]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` of ``rows``, right-padded to the longest."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rank_rows(plan: dict[str, Any], *, step: int, rank: int) -> list[dict[str, list[int]]]:
    """The examples of ``rank``'s micro-batch at ``step``."""
    return [plan["examples"][i] for i in plan["steps"][step][rank]]


def digest(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> str:
    """sha256 of a micro-batch's token ids row by row, padding left out (16 hex digits)."""
    h = hashlib.sha256()
    for i, row in enumerate(input_ids.tolist()):
        kept = row if attention_mask is None else [t for t, m in zip(row, attention_mask[i].tolist(), strict=True) if m]
        h.update(json.dumps(kept).encode())
    return h.hexdigest()[:16]


def target_tokens(labels: torch.Tensor) -> int:
    """Tokens in the loss (after the shift: a label at position 0 is never predicted)."""
    return int((labels[:, 1:] != -100).sum())
