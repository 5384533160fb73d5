"""Greedy generation that works on a sharded model: every rank runs the same forward passes; and
``fsdp-plus-generate``, answers from a trained adapter or a merged export in one process.

``model.generate`` of a wrapped transformers model would bypass FSDP2's root unit (the LightningModule)
and its all-gathers; this loop calls a forward function you give it instead, so the same code decodes
with the sharded model (``lambda ids: strategy.model(input_ids=ids).logits`` on every rank) and with a
plain single-process model, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


@torch.no_grad()
def greedy_generate(
    forward: Callable[[Tensor], Tensor],
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 48,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Decode each prompt greedily (argmax, batch of one, no cache) until EOS or ``max_new_tokens``."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(forward(ids)[0, -1].argmax())
            if next_id == tokenizer.eos_token_id:
                break
            new.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
        outputs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outputs


def load_for_generation(model: str, *, adapter: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode: a model directory (a merged export, or a base with ``adapter``, a PEFT
    adapter directory such as a run's ``adapter/``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model)
    if adapter is not None:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(loaded, adapter)
    return loaded.eval(), AutoTokenizer.from_pretrained(model)


def main(argv: list[str] | None = None) -> int:
    """``fsdp-plus-generate MODEL [--adapter DIR] (--prompt TEXT ... | --file records.jsonl)``: greedy answers to
    instructions, in the prompt template the app trains with, one JSON line per answer."""
    import argparse
    import json
    import sys

    from lightning_fsdp_plus.app.data import load_records, render_prompt

    parser = argparse.ArgumentParser(prog="fsdp-plus-generate", description=main.__doc__)
    parser.add_argument("model", help="a model directory: a merged export, or the base (with --adapter)")
    parser.add_argument("--adapter", help="a PEFT adapter directory (a run's adapter/ or fsdp-plus-export's)")
    parser.add_argument("--prompt", action="append", default=[], help="an instruction (repeatable)")
    parser.add_argument("--file", help="JSONL/JSON/CSV/Parquet records with 'instruction' (and 'input')")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not args.prompt and not args.file:
        parser.error("give --prompt TEXT (repeatable) or --file RECORDS")
    records = [{"instruction": text} for text in args.prompt]
    records += load_records(files=[args.file]) if args.file else []
    try:
        model, tokenizer = load_for_generation(args.model, adapter=args.adapter)
    except OSError as err:
        parser.exit(2, f"fsdp-plus-generate: error: {err}\n")
    prompts = [render_prompt(r) for r in records]
    answers = greedy_generate(lambda ids: model(input_ids=ids).logits, tokenizer, prompts,
                              max_new_tokens=args.max_new_tokens)  # fmt: skip
    for record, answer in zip(records, answers, strict=True):
        sys.stdout.write(json.dumps({"instruction": record["instruction"], "answer": answer}) + "\n")
    return 0
