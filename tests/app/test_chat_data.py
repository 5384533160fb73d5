"""Instruction records through a real instruct model's chat template (SmolLM2-135M-Instruct's): the prompt masked
out of the loss, the answer and its end-of-turn learned, packing and generation prompts in the same format."""

from __future__ import annotations

from lightning_fsdp_plus.app.data import InstructionDataModule, encode_record, pack_examples
from lightning_fsdp_plus.app.generate import generation_prompt
from lightning_fsdp_plus.app.tokenizer import load_tokenizer
from tests.helpers.launch import REPO

TRAIN = REPO / "examples" / "medical_lora" / "data" / "train.jsonl"
RECORD = {"instruction": "Which condition could explain these symptoms?", "input": "wheezing and chest tightness",
          "response": "These symptoms could point to asthma."}  # fmt: skip


def test_an_instruction_is_one_chat_exchange_with_only_the_answer_in_the_loss(smollm2_checkpoint):
    tokenizer = load_tokenizer(str(smollm2_checkpoint))
    messages = [{"role": "user", "content": f"{RECORD['instruction']}\n\n{RECORD['input']}"},
                {"role": "assistant", "content": RECORD["response"]}]  # fmt: skip
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert full.startswith(prompt) and "<|im_start|>system" in prompt  # the template's own default system turn
    row = encode_record(RECORD, tokenizer, max_seq_len=256)
    assert row["input_ids"] == tokenizer(full, add_special_tokens=False)["input_ids"]
    masked = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert row["labels"][:masked] == [-100] * masked
    assert row["labels"][masked:] == row["input_ids"][masked:]
    learned = tokenizer.decode(row["input_ids"][masked:])
    assert learned == RECORD["response"] + "<|im_end|>\n"  # the answer and the end of its turn, nothing else
    question, asked = generation_prompt({"instruction": RECORD["instruction"], "input": RECORD["input"]}, tokenizer)
    assert question == RECORD["instruction"] and asked == prompt  # answered in the format it was trained on


def test_packing_and_the_data_module_keep_the_chat_format(smollm2_checkpoint):
    data = InstructionDataModule(tokenizer=str(smollm2_checkpoint), train_files=[str(TRAIN)], val_files=[str(TRAIN)],
                                 max_seq_len=256, pack=True, seed=0)  # fmt: skip
    examples = [encode_record(r, data.tokenizer, max_seq_len=256) for r in data.train_records]
    rows, members = pack_examples(examples, row_len=256, seed=0)
    assert len(rows) == len(data.train_set) < len(examples) / 3  # several chats a row
    for row, indices in zip(rows, members, strict=True):
        assert row["input_ids"] == [t for i in indices for t in examples[i]["input_ids"]]
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert len(starts) == len(indices)  # positions restart at every chat
    assert data.generation_prompts(1)[0]["prompt"].endswith("<|im_start|>assistant\n")
