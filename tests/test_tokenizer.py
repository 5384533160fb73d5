"""The byte-level tokenizer a model built from a config reads own data with, and ``load_tokenizer``."""

from __future__ import annotations

from transformers import AutoTokenizer

from lightning_fsdp_plus.app.tokenizer import BYTE_EOS, BYTE_PAD, byte_tokenizer, load_tokenizer
from tests.helpers.launch import REPO

TEXT = "Dosis: 5 mg/kg — zweimal täglich; 血压 ### Response:\n"


def test_byte_tokenizer_round_trips_any_text_one_token_per_byte():
    tokenizer = byte_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer) == 258
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token, tokenizer.pad_token_id) == (
        BYTE_EOS, 256, BYTE_PAD, 257)  # fmt: skip
    # the EOS written as text is the EOS token (the chat fallback relies on it), and decoding can drop it
    assert tokenizer(f"ok{BYTE_EOS}", add_special_tokens=False)["input_ids"][-1] == 256
    assert tokenizer.decode([*ids, 256], skip_special_tokens=True) == TEXT


def test_byte_tokenizer_is_the_same_every_time_and_after_save_pretrained(tmp_path):
    first, second = byte_tokenizer(), byte_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    first.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(TEXT, add_special_tokens=False)["input_ids"] == first(TEXT, add_special_tokens=False)["input_ids"]
    assert reloaded.eos_token_id == 256 and reloaded.pad_token_id == 257


def test_load_tokenizer_reads_a_directory_and_gives_none_the_byte_tokenizer():
    assert len(load_tokenizer(None)) == 258
    tiny = load_tokenizer(str(REPO / "examples" / "assets" / "tiny-llama"))
    assert len(tiny) == 512 and tiny.pad_token_id is not None
