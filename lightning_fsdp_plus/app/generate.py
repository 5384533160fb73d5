"""Greedy generation that works on a sharded model: every rank runs the same forward passes; and
``fsdp-plus-generate``, answers from a trained adapter or a merged export in one process.

``model.generate`` of a wrapped transformers model would bypass FSDP2's root unit (the LightningModule)
and its all-gathers; this loop calls a forward function you give it instead, so the same code decodes
with the sharded model (``lambda ids: strategy.model(input_ids=ids).logits`` on every rank) and with a
plain single-process model, token for token.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp_plus.tensor_parallel import gathered


@torch.no_grad()
def greedy_generate(
    forward: Callable[[Tensor], Tensor],
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 48,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Decode each prompt greedily (argmax, batch of one, no cache) until EOS or ``max_new_tokens``; logits split
    over the vocabulary (``loss_parallel``) are gathered at the last position only."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(gathered(forward(ids)[0, -1]).argmax())  # loss-parallel logits: the last position
            if next_id == tokenizer.eos_token_id:
                break
            new.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
        outputs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outputs


PROBE_TOKENS = 5
"""How many of the most likely next tokens :func:`next_token_top` reports."""


@torch.no_grad()
def next_token_top(
    forward: Callable[[Tensor], Tensor], tokenizer: Any, prompt: str, *, device: torch.device | str = "cpu"
) -> dict[str, list]:
    """The :data:`PROBE_TOKENS` most likely next tokens after ``prompt`` with their logits: a fingerprint of the model
    (``generations.jsonl`` keeps it, so a reloaded adapter can be checked against the model that trained it)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
    top = gathered(forward(ids)[0, -1]).float().topk(PROBE_TOKENS)
    return {"ids": top.indices.tolist(), "logits": top.values.tolist()}


def load_for_generation(model: str, *, adapter: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode: a model directory (a merged export, or a base with ``adapter``, a PEFT
    adapter directory such as a run's ``adapter/``)."""
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_plus.app.tokenizer import load_tokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model)
    if adapter is not None:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(loaded, adapter)
    return loaded.eval(), load_tokenizer(model)


def generation_prompt(record: dict[str, Any], tokenizer: Any, *, chat: bool = False) -> tuple[str, str]:
    """``(question, prompt)`` for one record, prompted as the app trains it: a chat (``messages``) through the
    tokenizer's chat template up to its last user turn; an instruction as one user turn when the tokenizer has a
    chat template (or ``chat``), else in the app's instruction template."""
    from lightning_fsdp_plus.app.data import (
        MESSAGES_FIELD,
        chat_prompt,
        has_chat_template,
        instruction_messages,
        is_chat,
        last_question,
        normalize_messages,
        render_prompt,
    )

    if is_chat(record):  # answer the last question, not after a given answer
        turns = normalize_messages(record[MESSAGES_FIELD], where="--file")
        return last_question(turns), chat_prompt(turns, tokenizer)
    if chat or has_chat_template(tokenizer):
        turns = instruction_messages({k: v for k, v in record.items() if k != "response"})
        return str(record["instruction"]), chat_prompt(turns, tokenizer)
    return str(record["instruction"]), render_prompt(record)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``fsdp-plus-generate`` (its ``--help`` is in the docs' reference)."""
    parser = argparse.ArgumentParser(prog="fsdp-plus-generate", description=main.__doc__)
    parser.add_argument("model", help="a model directory: a merged export, or the base (with --adapter)")
    parser.add_argument("--adapter", help="a PEFT adapter directory (a run's adapter/ or fsdp-plus-export's)")
    parser.add_argument("--prompt", action="append", default=[], help="an instruction (repeatable)")
    parser.add_argument("--file", help="JSONL/JSON/CSV/Parquet records: 'instruction' (and 'input'), or chats"
                        " ('messages'; answered after their last user turn)")  # fmt: skip
    parser.add_argument("--chat", action="store_true", help="send instructions as a user turn through the"
                        " tokenizer's chat template (for a model trained on chats)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``fsdp-plus-generate MODEL [--adapter DIR] [--chat] (--prompt TEXT ... | --file records.jsonl)``: greedy
    answers to instructions, in the prompt template the app trains with, one JSON line per answer."""
    import json
    import sys

    from lightning_fsdp_plus.app.data import load_records

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompt and not args.file:
        parser.error("give --prompt TEXT (repeatable) or --file RECORDS")
    records = [{"instruction": text} for text in args.prompt]
    records += load_records(files=[args.file]) if args.file else []
    try:
        model, tokenizer = load_for_generation(args.model, adapter=args.adapter)
    except OSError as err:
        parser.exit(2, f"fsdp-plus-generate: error: {err}\n")
    questions, prompts = zip(*(generation_prompt(r, tokenizer, chat=args.chat) for r in records), strict=True)
    answers = greedy_generate(lambda ids: model(input_ids=ids).logits, tokenizer, list(prompts),
                              max_new_tokens=args.max_new_tokens)  # fmt: skip
    for question, answer in zip(questions, answers, strict=True):
        sys.stdout.write(json.dumps({"instruction": question, "answer": answer}) + "\n")
    return 0
