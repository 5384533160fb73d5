"""``fsdp-plus-generate``'s prompts: instructions in the training template, as a chat turn, and chat records."""

from __future__ import annotations

from lightning_fsdp_plus.app.data import render_prompt
from lightning_fsdp_plus.app.generate import generation_prompt
from lightning_fsdp_plus.app.tokenizer import load_tokenizer
from tests.helpers.launch import REPO
from tests.test_data import CHAT, CHATML, RECORD

TOKENIZER = str(REPO / "examples" / "assets" / "tiny-llama")


def test_instructions_use_the_training_template_unless_asked_as_a_chat_turn():
    plain = load_tokenizer(TOKENIZER)
    assert generation_prompt(RECORD, plain) == (RECORD["instruction"], render_prompt(RECORD))
    assert generation_prompt(RECORD, plain, chat=True) == (RECORD["instruction"], render_prompt(RECORD))  # no template
    templated = load_tokenizer(TOKENIZER)
    templated.chat_template = CHATML
    question, prompt = generation_prompt(RECORD, templated, chat=True)
    assert prompt == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_record_is_answered_after_its_last_user_turn():
    tokenizer = load_tokenizer(TOKENIZER)
    tokenizer.chat_template = CHATML
    question, prompt = generation_prompt({"messages": CHAT}, tokenizer)  # ends with an answer: that one is dropped
    assert question == "And?"
    assert prompt == tokenizer.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True)
