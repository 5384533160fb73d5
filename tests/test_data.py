"""Instruction data: file formats through ``datasets``, prompt templates, prompt masking, packing, padding; chats
(OpenAI ``messages`` and ShareGPT ``conversations``) with and without a chat template."""

from __future__ import annotations

import json

import datasets
import pytest

from lightning_fsdp_plus.app.data import (
    DataError,
    InstructionDataModule,
    PadCollator,
    chat_prompt,
    chat_segments,
    check_instruction_file,
    load_records,
    render_prompt,
    tokenize_chat,
    tokenize_example,
)
from lightning_fsdp_plus.app.tokenizer import byte_tokenizer, load_tokenizer
from tests.helpers.launch import REPO

TOKENIZER = str(REPO / "examples" / "assets" / "tiny-llama")
VAL = REPO / "examples" / "medical_lora" / "data" / "val.jsonl"


@pytest.fixture(scope="module")
def module() -> InstructionDataModule:
    return InstructionDataModule(tokenizer=TOKENIZER, train_files=[str(VAL)], val_files=[str(VAL)], max_seq_len=96)


def test_prompt_template_with_and_without_input():
    assert render_prompt({"instruction": "Define tort."}) == "### Instruction:\nDefine tort.\n\n### Response:\n"
    assert render_prompt({"instruction": "Which?", "input": "a, b"}) == (
        "### Instruction:\nWhich?\n\n### Input:\na, b\n\n### Response:\n"
    )


def test_prompt_tokens_are_masked_and_the_response_ends_with_eos(module):
    record = {"instruction": "What causes gout?", "response": "Uric acid crystals."}
    example = tokenize_example(record, module.tokenizer, max_seq_len=96)
    prompt_len = len(module.tokenizer(render_prompt(record), add_special_tokens=False)["input_ids"])
    assert example["labels"][:prompt_len] == [-100] * prompt_len
    assert example["labels"][prompt_len:] == example["input_ids"][prompt_len:]
    assert example["input_ids"][-1] == module.tokenizer.eos_token_id
    assert module.tokenizer.decode(example["input_ids"][prompt_len:-1]) == "Uric acid crystals."
    unmasked = tokenize_example(record, module.tokenizer, max_seq_len=96, mask_prompt=False)
    assert unmasked["labels"] == unmasked["input_ids"]
    assert len(tokenize_example(record, module.tokenizer, max_seq_len=5)["input_ids"]) == 5


def test_packing_puts_every_training_example_once_whole_into_fixed_rows():
    train = REPO / "examples" / "medical_lora" / "data" / "train.jsonl"
    kwargs = dict(tokenizer=TOKENIZER, train_files=[str(train)], val_files=[str(VAL)], max_seq_len=256, batch_size=4)
    plain, packed = InstructionDataModule(**kwargs), InstructionDataModule(**kwargs, pack=True, seed=0)
    examples = plain.train_set.rows
    assert sorted(i for row in packed.packed_rows for i in row) == list(range(len(examples)))
    assert len(packed.train_set) == len(packed.packed_rows) < 0.5 * len(examples)
    for row, members in zip(packed.train_set.rows, packed.packed_rows, strict=True):
        assert row["input_ids"] == [t for i in members for t in examples[i]["input_ids"]]
        assert row["position_ids"] == [p for i in members for p in range(len(examples[i]["input_ids"]))]
        assert row["labels"] == [t for i in members for t in [-100, *examples[i]["labels"][1:]]]
    assert InstructionDataModule(**kwargs, pack=True, seed=0).packed_rows == packed.packed_rows
    batch = packed.train_collate(packed.train_set.rows[:4])
    assert batch["input_ids"].shape == batch["position_ids"].shape == (4, 256) and "attention_mask" not in batch
    lengths = [len(r["input_ids"]) for r in packed.train_set.rows[:4]]
    assert batch["padding_tokens"].tolist() == [256 - n for n in lengths]
    assert batch["position_ids"][0, lengths[0] :].tolist() == list(range(256 - lengths[0]))  # padding: its own
    assert batch["target_tokens"].tolist() == [int((r[1:] != -100).sum()) for r in batch["labels"]]
    # the validation set stays one example per row, as unpacked
    assert [r["input_ids"] for r in packed.val_set.rows] == [r["input_ids"] for r in plain.val_set.rows]


def test_collator_pads_with_pad_id_no_attention_and_ignored_labels():
    batch = PadCollator(pad_token_id=9)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                         {"input_ids": [4], "labels": [4]}])  # fmt: skip
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["padding_tokens"].tolist() == [0, 2] and batch["target_tokens"].tolist() == [2, 0]


def test_jsonl_csv_and_parquet_and_a_local_dataset_give_the_same_records(tmp_path):
    records = load_records(files=[str(VAL)])
    table = datasets.Dataset.from_list(records)
    table.to_csv(str(tmp_path / "val.csv"), index=False)
    table.to_parquet(str(tmp_path / "val.parquet"))
    assert load_records(files=[str(tmp_path / "val.parquet")]) == records
    from_csv = load_records(files=[str(tmp_path / "val.csv")])
    assert [r["response"] for r in from_csv] == [r["response"] for r in records]
    folder = tmp_path / "local_dataset"
    folder.mkdir()
    (folder / "validation.jsonl").write_text(VAL.read_text())
    assert load_records(dataset_name=str(folder), split="validation") == records


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data files not found"):
        load_records(files=[str(tmp_path / "nope.jsonl")])
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"must share one of the suffixes \.jsonl, \.json, \.csv, \.parquet"):
        load_records(files=[str(tmp_path / "a.txt")])


def test_module_batches_and_generation_prompts(module):
    batch = next(iter(module.val_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "padding_tokens", "target_tokens"}
    assert batch["input_ids"].shape[0] == 8
    prompts = module.generation_prompts(2)
    first = json.loads(VAL.read_text().splitlines()[0])
    assert prompts[0] == {"question": first["instruction"], "prompt": render_prompt(first),
                          "reference": first["response"]}  # fmt: skip


def _write(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"instruction": "a", "response": "b"}', "", '{"instruction": "c"}'],
         r"bad.jsonl:3: missing field 'response'; expected fields: instruction, response \(required\), input "
         r"\(optional\); or 'messages' \(a chat\); this record has: \['instruction'\]"),
        (['{"instruction": "a", "response": "b"}', '{"instruction": "c", "response": "d",}'],
         r"bad.jsonl:2: not a JSON object \(Expecting property name enclosed in double quotes at column 38\)"),
        (['["a", "b"]'], r"bad.jsonl:1: a record must be a JSON object, got list"),
    ],
)  # fmt: skip
def test_bad_jsonl_records_are_named_by_file_and_line_with_the_expected_fields(tmp_path, lines, message):
    bad = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=message):
        check_instruction_file(bad)
    with pytest.raises(DataError, match=message):  # the data module says the same, not KeyError('response')
        InstructionDataModule(tokenizer=TOKENIZER, train_files=[str(bad)], val_files=[str(VAL)])


def test_other_formats_name_the_record_number(tmp_path):
    bad = _write(tmp_path / "bad.csv", ["instruction,response", "a,b", "c,"])
    with pytest.raises(DataError, match=r"bad.csv: record 2: missing field 'response'"):
        check_instruction_file(bad)


def test_the_app_refuses_a_bad_data_file_before_any_process_starts(tmp_path):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from lightning_fsdp_plus.app.config import register_configs
    from lightning_fsdp_plus.app.config.validate import ConfigError, validate_run_config

    bad = _write(tmp_path / "train.jsonl", ['{"instruction": "a", "response": "b"}', '{"instruction": "c"}'])
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_fsdp_plus.conf", version_base="1.3"):
        cfg = compose("config", overrides=["data=instruction", f"data.train_files=[{bad}]",
                                           f"data.val_files=[{VAL}]", f"data.tokenizer={TOKENIZER}"])  # fmt: skip
    GlobalHydra.instance().clear()
    with pytest.raises(ConfigError, match=r"data.train_files: .*train.jsonl:2: missing field 'response'"):
        validate_run_config(cfg)


def test_alpaca_files_are_read_through_data_columns_and_a_missing_field_says_so(tmp_path):
    records = ['{"instruction": "Name a colour.", "input": "", "output": "Blue."}',
               '{"instruction": "Add 2 and 3.", "input": "", "output": "5"}']  # fmt: skip
    alpaca = _write(tmp_path / "alpaca.jsonl", records)
    with pytest.raises(
        DataError,
        match=r"alpaca.jsonl:1: missing field 'response'.*this record has: \['input',"
        r" 'instruction', 'output'\]; set data.columns.response=output to read it",
    ):
        check_instruction_file(alpaca)
    check_instruction_file(alpaca, columns={"response": "output"})  # mapped: accepted
    module = InstructionDataModule(tokenizer=TOKENIZER, train_files=[str(alpaca)], val_files=[str(alpaca)],
                                   batch_size=2, max_seq_len=64, columns={"response": "output"})  # fmt: skip
    assert [r["response"] for r in module.val_records] == ["Blue.", "5"] and "output" not in module.val_records[0]
    assert module.generation_prompts(1)[0]["reference"] == "Blue."
    with pytest.raises(DataError, match=r"missing field 'response' \(data.columns maps it to 'answer'\)"):
        check_instruction_file(alpaca, columns={"response": "answer"})


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
"""A ChatML template (Qwen's and many others' turn format), set on the tiny base's tokenizer."""
RECORD = {"instruction": "What causes gout?", "response": "Uric acid crystals."}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": RECORD["instruction"]},
        {"role": "assistant", "content": RECORD["response"]}, {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Diet."}]  # fmt: skip


def _learned(example: dict, tokenizer) -> str:
    return tokenizer.decode(
        [i for i, label in zip(example["input_ids"], example["labels"], strict=True) if label != -100]
    )


@pytest.mark.parametrize("tokenizer", [load_tokenizer(TOKENIZER), byte_tokenizer()], ids=["tiny-llama", "bytes"])
def test_a_chat_without_template_is_the_instruction_format_and_learns_only_the_answers(tokenizer):
    one_exchange = [
        {"role": "user", "content": RECORD["instruction"]},
        {"role": "assistant", "content": RECORD["response"]},
    ]
    assert tokenize_chat(one_exchange, tokenizer, max_seq_len=500) == tokenize_example(
        RECORD, tokenizer, max_seq_len=500
    )
    example = tokenize_chat(CHAT, tokenizer, max_seq_len=500)
    eos = tokenizer.eos_token
    assert _learned(example, tokenizer) == f"Uric acid crystals.{eos}Diet.{eos}"
    assert tokenizer.decode(example["input_ids"]) == (
        "Be brief.\n\n### Instruction:\nWhat causes gout?\n\n### Response:\nUric acid crystals."
        f"{eos}### Instruction:\nAnd?\n\n### Response:\nDiet.{eos}")  # fmt: skip
    unmasked = tokenize_chat(CHAT, tokenizer, max_seq_len=500, mask_prompt=False)
    assert (
        unmasked["labels"] == unmasked["input_ids"]
        and len(tokenize_chat(CHAT, tokenizer, max_seq_len=9)["labels"]) == 9
    )
    assert chat_prompt(one_exchange, tokenizer) == render_prompt(RECORD)  # generation asks as training taught


def test_a_chat_template_renders_the_conversation_and_only_answers_and_their_end_of_turn_are_learned():
    tokenizer = load_tokenizer(TOKENIZER)
    tokenizer.chat_template = CHATML
    example = tokenize_chat([*CHAT, {"role": "user", "content": "unanswered"}], tokenizer, max_seq_len=500)
    assert _learned(example, tokenizer) == "Uric acid crystals.<|im_end|>\nDiet.<|im_end|>\n"
    assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert chat_prompt(CHAT, tokenizer) == tokenizer.apply_chat_template(CHAT[:-1], tokenize=False,
                                                                         add_generation_prompt=True)  # fmt: skip
    tokenizer.chat_template = CHATML.replace("{% for m in messages %}", "{% for m in messages|reverse %}")
    with pytest.raises(DataError, match="renders turn 3 differently once an answer follows"):
        chat_segments(CHAT, tokenizer)


def test_sharegpt_files_are_read_through_data_columns_and_bad_turns_are_named(tmp_path):
    conversation = [{"from": "human", "value": "What causes gout?"}, {"from": "gpt", "value": "Uric acid crystals."}]
    sharegpt = _write(
        tmp_path / "sharegpt.jsonl", [json.dumps({"conversations": conversation, "id": i}) for i in range(3)]
    )
    with pytest.raises(DataError, match=r"sharegpt.jsonl:1: missing field 'instruction'.*set data.columns.messages="
                       r"conversations to read 'conversations' as a chat"):  # fmt: skip
        check_instruction_file(sharegpt)
    columns = {"messages": "conversations"}
    module = InstructionDataModule(tokenizer=None, train_files=[str(sharegpt)], val_files=[str(sharegpt)],
                                   batch_size=2, max_seq_len=128, columns=columns)  # fmt: skip
    assert module.val_set[0] == tokenize_example(RECORD, module.tokenizer, max_seq_len=128)  # human/gpt read as chat
    assert module.generation_prompts(1) == [{"question": "What causes gout?", "prompt": render_prompt(RECORD),
                                             "reference": "Uric acid crystals."}]  # fmt: skip
    bad = {
        "role 'narrator'; valid roles: system, user, human, assistant, gpt, model, bot": [{"from": "narrator"}],
        "no assistant turn": [{"role": "user", "content": "x"}],
        "turn 1 is an assistant turn": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
        r"turn 2 \(gpt\) has no text": [{"role": "user", "content": "x"}, {"role": "gpt"}],
        "must be a non-empty list of turns": [],
    }  # fmt: skip
    for i, (message, turns) in enumerate(bad.items()):
        broken = _write(tmp_path / f"bad{i}.jsonl", [json.dumps({"messages": CHAT}), json.dumps({"messages": turns})])
        with pytest.raises(DataError, match=rf"bad{i}.jsonl:2: .*{message}"):
            check_instruction_file(broken)


def test_the_sample_indices_stay_on_the_cpu_when_the_batch_moves_to_the_device():
    import torch

    from lightning_fsdp_plus.app.data import GLOBAL_TOKENS_KEY, SAMPLE_INDEX_KEY, InstructionDataModule

    module = object.__new__(InstructionDataModule)  # the hook needs no data
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), GLOBAL_TOKENS_KEY: torch.tensor([5, 5]),
             SAMPLE_INDEX_KEY: torch.tensor([7, 9])}  # fmt: skip
    moved = module.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved["input_ids"].device.type == "meta" and moved[GLOBAL_TOKENS_KEY].device.type == "meta"
    assert moved[SAMPLE_INDEX_KEY].device.type == "cpu" and moved[SAMPLE_INDEX_KEY].tolist() == [7, 9]
    plain = module.transfer_batch_to_device({"input_ids": torch.ones(1, 2)}, torch.device("meta"), 0)
    assert plain["input_ids"].device.type == "meta"
