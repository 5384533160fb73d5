"""Build the tiny pretrained base model the examples fine-tune: a byte-level BPE tokenizer and a small Llama,
both trained here, on CPU, from ``examples/assets/corpus.txt`` (text the repo ships; see make_datasets.py).

    python examples/assets/build_tiny_base.py [--out examples/assets/tiny-llama] [--steps 300]
    python examples/assets/build_tiny_base.py --out DIR --stop-after 20   # the first steps only, no weights

Writes a transformers model directory (config.json, model.safetensors, tokenizer.json, ...) and
``build_info.json`` with the settings, the first steps' losses and the final losses, so a rebuild can be checked
against it: in full, or in seconds with ``--stop-after 20`` (the same schedule, stopped after the first steps).
Deterministic for a given torch build: fixed seeds, one thread, a fixed window schedule.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent
EOS, PAD = "<|endoftext|>", "<pad>"
MODEL = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True}  # fmt: skip
TRAIN = {
    "vocab_size": 512,
    "seq_len": 128,
    "batch_size": 16,
    "lr": 3e-3,
    "steps": 300,
    "seed": 0,
    "eval_every_nth_line": 20,
}


def train_tokenizer(text: str, *, vocab_size: int):
    """A byte-level BPE tokenizer (the ``tokenizers`` library), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=PAD)


FIRST = 20
"""Steps whose losses ``build_info.json`` records one by one (what ``--check`` reproduces)."""


def build(out: Path, *, steps: int = TRAIN["steps"], stop_after: int | None = None) -> dict:
    """Train tokenizer and model, save them into ``out``, return the build record; with ``stop_after`` only that
    many steps of the same schedule run and the weights are not saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TRAIN["seed"])
    torch.set_num_threads(1)
    text = (ASSETS / "corpus.txt").read_text()
    tokenizer = train_tokenizer(text, vocab_size=TRAIN["vocab_size"])
    lines = text.splitlines()
    every = TRAIN["eval_every_nth_line"]  # held-out lines spread over the whole corpus

    def token_stream(keep: list[str]) -> torch.Tensor:
        return torch.tensor([t for line in keep for t in [*tokenizer(line)["input_ids"], tokenizer.eos_token_id]])

    train_ids = token_stream([line for i, line in enumerate(lines) if i % every])
    eval_ids = token_stream([line for i, line in enumerate(lines) if i % every == 0])
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL)  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    g = torch.Generator().manual_seed(TRAIN["seed"])
    seq, batch = TRAIN["seq_len"], TRAIN["batch_size"]
    losses = []
    model.train()
    for _ in range(steps if stop_after is None else stop_after):
        starts = torch.randint(0, len(train_ids) - seq - 1, (batch,), generator=g)
        x = torch.stack([train_ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    if stop_after is not None:
        model.config.architectures = [type(model).__name__]  # as model.save_pretrained records them, with the dtype
        model.config.dtype = next(model.parameters()).dtype
        model.config.save_pretrained(out)
        record = {"train": {**TRAIN, "steps": steps}, "first_losses": losses[:FIRST], "torch": torch.__version__}
        (out / "build_info.json").write_text(json.dumps(record, indent=1))
        return record
    model.eval()
    with torch.no_grad():
        windows = eval_ids[: len(eval_ids) // seq * seq].view(-1, seq)
        eval_loss = model(input_ids=windows, labels=windows).loss.item()
    model.save_pretrained(out)
    record = {
        "model": MODEL,
        "train": {**TRAIN, "steps": steps},
        "corpus_tokens": len(train_ids) + len(eval_ids),
        "first_losses": losses[:FIRST],
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "eval_loss": eval_loss,
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
    }
    (out / "build_info.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS / "tiny-llama")
    parser.add_argument("--steps", type=int, default=TRAIN["steps"])
    parser.add_argument("--stop-after", type=int, help="run only this many steps of the schedule; save no weights")
    args = parser.parse_args()
    print(json.dumps(build(args.out, steps=args.steps, stop_after=args.stop_after), indent=1))


if __name__ == "__main__":
    main()
