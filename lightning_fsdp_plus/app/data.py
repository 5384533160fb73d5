"""Data modules for the ``fsdp-plus-train`` app: synthetic sequences, and instruction datasets.

``InstructionDataModule`` reads local JSONL/JSON/CSV/Parquet files (or a ``datasets`` dataset from the
local cache) with Hugging Face ``datasets``, renders each example with a prompt template (a chat with the
tokenizer's chat template where it has one), tokenizes it, masks the prompt out of the loss (labels -100), and
optionally packs whole examples into fixed-length rows (:mod:`lightning_fsdp_plus.app.packing`).

Training loaders are torchdata's ``StatefulDataLoader``: Lightning saves their position in checkpoints, so a run
resumed mid-epoch (after a preemption) continues with the next batch instead of starting the epoch again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_fsdp_plus.app.packing import pack_rows, packed_row
from lightning_fsdp_plus.app.tokenizer import load_tokenizer
from lightning_fsdp_plus.sampler import GlobalBatchSampler, LayoutError, accumulation_for, data_parallel_ranks

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
"""Alpaca-style prompt for examples without an input."""
PROMPT_WITH_INPUT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""Alpaca-style prompt for examples with an input."""
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
REQUIRED_FIELDS = ("instruction", "response")
"""Fields every instruction record must have (non-empty)."""
OPTIONAL_FIELDS = ("input",)
"""Fields an instruction record may have."""
MESSAGES_FIELD = "messages"
"""The field of a chat record: a list of turns ``{role, content}`` (or ShareGPT's ``{from, value}``)."""
DATA_FIELDS = (*REQUIRED_FIELDS, *OPTIONAL_FIELDS, MESSAGES_FIELD)
"""Every field ``data.columns`` can map."""
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "bot": "assistant"}  # fmt: skip
"""Turn roles a chat record may use (ShareGPT's ``human``/``gpt`` included) and the chat role each stands for."""


COMMON_NAMES = {"instruction": ("prompt", "question", "query"), "response": ("output", "completion", "answer"),
                "input": ("context",), MESSAGES_FIELD: ("conversations", "conversation", "dialog")}  # fmt: skip
"""Other datasets' names for our fields (Alpaca's ``output``, ShareGPT's ``conversations``), for the hint a
missing field gets."""


class DataError(ValueError):
    """A data file the run cannot use, with the file and the line (JSONL) or record number."""


def rename_fields(record: dict[str, Any], columns: Mapping[str, str] | None) -> dict[str, Any]:
    """``record`` with the file's field names mapped onto ours (``columns``: our field -> the file's)."""
    if not columns:
        return record
    renamed = {k: v for k, v in record.items() if k not in columns.values()}
    renamed |= {ours: record[theirs] for ours, theirs in columns.items() if theirs in record}
    return renamed


def is_chat(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` (fields already renamed) is a conversation rather than an instruction."""
    return record.get(MESSAGES_FIELD) is not None


def normalize_messages(messages: Any, *, where: str = "messages") -> list[dict[str, str]]:
    """A conversation as ``[{role, content}]`` with roles system/user/assistant, from OpenAI-style ``{role,
    content}`` or ShareGPT ``{from, value}`` turns; it must open with a system or user turn and hold an assistant
    turn (the text the model learns). Raises DataError naming the turn (1-based) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {MESSAGES_FIELD!r} must be a non-empty list of turns, got {messages!r:.60}")
    turns = []
    for number, turn in enumerate(messages, 1):
        if not isinstance(turn, Mapping):
            raise DataError(f"{where}: turn {number} must be an object with role and content, got {turn!r:.60}")
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if role not in ROLES:
            raise DataError(f"{where}: turn {number} has role {role!r}; valid roles: {', '.join(ROLES)} (in 'role'"
                            " or ShareGPT's 'from')")  # fmt: skip
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {number} ({role}) has no text in 'content' (or ShareGPT's 'value')")
        turns.append({"role": ROLES[role], "content": content})
    if turns[0]["role"] == "assistant":
        raise DataError(f"{where}: turn 1 is an assistant turn; a conversation opens with a system or user turn")
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{where}: no assistant turn (role assistant or gpt): nothing to learn from")
    return turns


def _check_record(record: Any, *, where: str, columns: Mapping[str, str] | None = None) -> None:
    expected = (f"expected fields: {', '.join(REQUIRED_FIELDS)} (required), {', '.join(OPTIONAL_FIELDS)}"
                f" (optional); or {MESSAGES_FIELD!r} (a chat)")  # fmt: skip
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}; {expected}")
    fields = rename_fields(record, columns)
    if is_chat(fields):
        normalize_messages(fields[MESSAGES_FIELD], where=where)
        return
    missing = [f for f in REQUIRED_FIELDS if fields.get(f) is None or fields.get(f) == ""]
    if missing:
        field = missing[0]
        mapped = f" (data.columns maps it to {columns[field]!r})" if (columns or {}).get(field, field) != field else ""
        chat = next((a for a in COMMON_NAMES[MESSAGES_FIELD] if isinstance(record.get(a), list)), None)
        alias = next((a for a in COMMON_NAMES.get(field, ()) if a in record), None)
        hint = f"; set data.columns.{field}={alias} to read it from {alias!r}" if alias and not mapped else ""
        hint = f"; set data.columns.{MESSAGES_FIELD}={chat} to read {chat!r} as a chat" if chat else hint
        raise DataError(f"{where}: missing field {field!r}{mapped}; {expected}; this record has:"
                        f" {sorted(record) or 'no fields'}{hint}")  # fmt: skip


def check_instruction_file(path: str | Path, *, columns: Mapping[str, str] | None = None) -> None:
    """Raise DataError for the first record of ``path`` that is neither ``{instruction, input?, response}`` nor a
    chat (``{messages: [...]}``, checked by ``normalize_messages``).

    JSONL errors name the line (``file:line``, also for lines that are not JSON); other formats the record number.
    """
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        for number, record in enumerate(load_records(files=[str(path)]), 1):
            _check_record(record, where=f"{path}: record {number}", columns=columns)
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not a JSON object ({err.msg} at column {err.colno})") from None
            _check_record(record, where=f"{path}:{number}", columns=columns)


def shuffled_sampler(
    dataset: Dataset,
    *,
    trainer: Any,
    micro_batch_size: int,
    global_batch_size: int | None = None,
    weights: Sequence[int] | None = None,
) -> GlobalBatchSampler:
    """This rank's share of the run's global batches, in an order fixed by the seed and the epoch alone
    (:class:`~lightning_fsdp_plus.sampler.GlobalBatchSampler`): a run resumed mid-epoch, in any epoch and on any
    number of ranks, sees exactly the samples the uninterrupted run would have seen, in the same global batches.

    ``global_batch_size`` defaults to ``micro_batch_size x ranks x trainer.accumulate_grad_batches``; given, the
    trainer's accumulation must be the one that keeps it (the app sets it).
    """
    world, rank = data_parallel_ranks(trainer) if trainer is not None else (1, 0)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
    total = global_batch_size or micro_batch_size * world * accumulate
    needed = accumulation_for(global_batch_size=total, world_size=world, micro_batch_size=micro_batch_size)
    if needed != accumulate:
        raise LayoutError(f"global batch size {total} on {world} ranks x micro-batch {micro_batch_size} needs"
                          f" Trainer(accumulate_grad_batches={needed}), not {accumulate}")  # fmt: skip
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, as Lightning's own distributed sampler
    return GlobalBatchSampler(dataset, global_batch_size=total, micro_batch_size=micro_batch_size, world_size=world,
                              rank=rank, seed=seed, weights=weights)  # fmt: skip


def data_layout(sampler: GlobalBatchSampler | None) -> dict[str, int]:
    """What a data module saves in checkpoints about its layout (a resume on another one keeps the global batch)."""
    if sampler is None:
        return {}
    return {"global_batch_size": sampler.global_batch_size, "world_size": sampler.num_replicas,
            "micro_batch_size": sampler.micro_batch_size, "accumulate_grad_batches": sampler.accumulate}  # fmt: skip


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
        global_batch_size: Sequences per optimizer step over all ranks and accumulation (default: ``batch_size``
            x ranks x ``accumulate_grad_batches``); kept when a run resumes on another number of ranks.
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
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.global_batch_size = batch_size, num_workers, global_batch_size
        self.train_set = ArithmeticSequences(n=train_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
        self.val_set = ArithmeticSequences(n=val_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed + 1)
        self.sampler: GlobalBatchSampler | None = None

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, resumable mid-epoch on any number of ranks (every sequence has the same
        tokens, so the mean of micro-batch losses is the global batch's)."""
        self.sampler = shuffled_sampler(self.train_set, trainer=self.trainer, micro_batch_size=self.batch_size,
                                        global_batch_size=self.global_batch_size)  # fmt: skip
        return StatefulDataLoader(self.train_set, batch_size=self.batch_size, num_workers=self.num_workers,
                                  sampler=self.sampler)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The data layout, saved in checkpoints."""
        return data_layout(self.sampler)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches in a fixed order."""
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


def load_records(
    *, files: Sequence[str] | None = None, dataset_name: str | None = None, split: str = "train"
) -> list[dict[str, Any]]:
    """Rows of local JSONL/JSON/CSV/Parquet files (one format per call), or of a cached ``datasets`` split."""
    import datasets

    if dataset_name is not None:
        return list(datasets.load_dataset(dataset_name, split=split))
    if not files:
        raise ValueError("data: give train_files/val_files or dataset_name")
    suffixes = {Path(f).suffix.lower() for f in files}
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
        raise ValueError(f"data files {list(files)} must share one of the suffixes {', '.join(_BUILDERS)}")
    builder = _BUILDERS[suffixes.pop()]
    return list(datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train"))


def render_prompt(record: dict[str, Any], *, instruction_field: str = "instruction", input_field: str = "input") -> str:
    """The prompt for one example (with the input section only when the example has an input)."""
    extra = record.get(input_field)
    template = PROMPT_WITH_INPUT_TEMPLATE if extra else PROMPT_TEMPLATE
    return template.format(instruction=record[instruction_field], input=extra or "")


def tokenize_example(
    record: dict[str, Any],
    tokenizer: Any,
    *,
    max_seq_len: int,
    mask_prompt: bool = True,
    response_field: str = "response",
) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` for prompt + response + EOS; prompt labels are -100 when masked."""
    prompt = tokenizer(render_prompt(record), add_special_tokens=False)["input_ids"]
    response = tokenizer(str(record[response_field]), add_special_tokens=False)["input_ids"]
    response = [*response, tokenizer.eos_token_id]
    ids = (prompt + response)[:max_seq_len]
    labels = ([-100] * len(prompt) if mask_prompt else list(prompt)) + response
    return {"input_ids": ids, "labels": labels[:max_seq_len]}


def chat_segments(messages: Sequence[Mapping[str, str]], tokenizer: Any) -> list[tuple[str, bool]]:
    """A conversation (``normalize_messages``' form) as ``(text, trained)`` pieces up to its last assistant turn:
    each assistant answer is trained, everything before it is prompt.

    With the tokenizer's chat template, an answer's piece is what rendering it adds after the generation prompt
    (end-of-turn tokens included); without one, the app's instruction template is used (a system turn, then
    ``### Instruction`` / ``### Response`` per exchange, each answer ending in EOS), so a one-exchange chat is
    exactly the instruction record ``{instruction, response}``.
    """
    last = max(i for i, turn in enumerate(messages) if turn["role"] == "assistant")
    messages = [dict(turn) for turn in messages[: last + 1]]
    if not getattr(tokenizer, "chat_template", None):
        formats = {"system": "{}\n\n", "user": PROMPT_TEMPLATE.replace("{instruction}", "{}"),
                   "assistant": "{}" + tokenizer.eos_token}  # fmt: skip
        return [(formats[t["role"]].format(t["content"]), t["role"] == "assistant") for t in messages]

    def render(turns: list[dict[str, str]], *, prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)

    pieces, done = [], ""
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        head, full = render(messages[:i], prompt=True), render(messages[: i + 1], prompt=False)
        if not (head.startswith(done) and full.startswith(head)):
            raise DataError(f"the tokenizer's chat template renders turn {i + 1} differently once an answer follows"
                            " (its output is not a prefix of the longer conversation's), so prompt and answer"
                            " cannot be told apart; data.tokenizer names another tokenizer")  # fmt: skip
        pieces += [(head[len(done) :], False), (full[len(head) :], True)]
        done = full
    return pieces


def tokenize_chat(
    messages: Sequence[Mapping[str, str]], tokenizer: Any, *, max_seq_len: int, mask_prompt: bool = True
) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` of a conversation: only assistant answers are learned when ``mask_prompt``."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in chat_segments(messages, tokenizer):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained or not mask_prompt else [-100] * len(piece)
    return {"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len]}


def chat_prompt(messages: Sequence[Mapping[str, str]], tokenizer: Any) -> str:
    """The text a model continues to answer the conversation's last user turn (answers after it are dropped)."""
    turns = list(messages)
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    pieces = chat_segments([*turns, {"role": "assistant", "content": ""}], tokenizer)
    return "".join(text for text, _ in pieces[:-1])


def last_question(messages: Sequence[Mapping[str, str]]) -> str:
    """The content of the conversation's last user turn (``""`` when it has none)."""
    return next((turn["content"] for turn in reversed(messages) if turn["role"] == "user"), "")


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders conversations with a chat template of its own (an instruct model's)."""
    return bool(getattr(tokenizer, "chat_template", None))


def instruction_messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """An instruction record as a one-exchange chat: the instruction (and its input, after a blank line) as the user
    turn, the response (when the record has one) as the assistant turn."""
    extra = record.get("input")
    question = f"{record['instruction']}\n\n{extra}" if extra else str(record["instruction"])
    turns = [{"role": "user", "content": question}]
    if record.get("response") is not None:
        turns.append({"role": "assistant", "content": str(record["response"])})
    return turns


def record_messages(record: Mapping[str, Any], tokenizer: Any) -> list[dict[str, str]] | None:
    """The conversation a record is trained and prompted as: a chat's own turns; an instruction's one exchange when
    the tokenizer has a chat template (an instruct model learns in the format it was tuned on); else ``None`` (the
    app's instruction template, :data:`PROMPT_TEMPLATE`)."""
    if is_chat(record):
        return normalize_messages(record[MESSAGES_FIELD])
    return instruction_messages(record) if has_chat_template(tokenizer) else None


def encode_record(
    record: Mapping[str, Any], tokenizer: Any, *, max_seq_len: int, mask_prompt: bool = True
) -> dict[str, list[int]]:
    """A record (fields already renamed) tokenized: as a conversation through ``tokenize_chat``
    (:func:`record_messages`), else with the instruction template (``tokenize_example``)."""
    messages = record_messages(record, tokenizer)
    if messages is not None:
        return tokenize_chat(messages, tokenizer, max_seq_len=max_seq_len, mask_prompt=mask_prompt)
    return tokenize_example(dict(record), tokenizer, max_seq_len=max_seq_len, mask_prompt=mask_prompt)


def pack_examples(
    examples: Sequence[dict[str, list[int]]], *, row_len: int, seed: int = 0
) -> tuple[list[dict[str, list[int]]], list[list[int]]]:
    """Tokenized examples packed whole into rows of at most ``row_len`` tokens (:mod:`lightning_fsdp_plus.app.packing`:
    best-fit decreasing, positions restarting per example, no loss across examples); returns the rows and, for
    each, the indices of its examples."""
    members = pack_rows([len(e["input_ids"]) for e in examples], row_len=row_len, seed=seed)
    return [packed_row([examples[i] for i in row]) for row in members], members


GLOBAL_TOKENS_KEY = "global_target_tokens"
"""Batch key: the target tokens of the whole global batch the micro-batch belongs to (one value per row), which
the loss is normalised by so that it is the same on any layout."""
SAMPLE_INDEX_KEY = "sample_index"
"""Batch key: each row's index in the training set (the run directory's ``samples.rank<R>.jsonl`` logs them)."""
PADDING_KEY = "padding_tokens"
"""Batch key: each row's padding tokens (for the run's padding share)."""
TARGETS_KEY = "target_tokens"
"""Batch key: each row's tokens in the loss (the run's *useful* tokens per second)."""
BOOKKEEPING_KEYS = (GLOBAL_TOKENS_KEY, SAMPLE_INDEX_KEY, PADDING_KEY, TARGETS_KEY)
"""Batch keys that describe the batch and are not model inputs."""
HOST_KEYS = (SAMPLE_INDEX_KEY, PADDING_KEY, TARGETS_KEY)
"""Bookkeeping keys that stay on the CPU when a batch moves to the device: read every micro-batch on the host, they
would otherwise wait for the device."""


def target_count(row: Mapping[str, Sequence[int]]) -> int:
    """The tokens of a tokenized row that are next-token targets in the loss (labels after the first, not -100)."""
    return sum(1 for label in row["labels"][1:] if label != -100)


class _Tokenized(Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows
        self.targets = [target_count(row) for row in rows]  # counted once: the sampler's weights, the batches' counts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        if isinstance(key, tuple):  # (index, target tokens of its global batch) from a weighted GlobalBatchSampler
            index = key[0]
            return {**self.rows[index], TARGETS_KEY: self.targets[index], GLOBAL_TOKENS_KEY: key[1],
                    SAMPLE_INDEX_KEY: index}  # fmt: skip
        return self.rows[key]  # the held-out set's rows as tokenized (the collator counts their targets)


class PadCollator:
    """Right-pads a batch to its longest row, or to ``length`` (packed rows: static shapes).

    Padding gets label -100 and, in rows of single examples, attention 0. Packed rows (they carry ``position_ids``)
    get no ``attention_mask``: their padding is one more sequence with positions from 0, which transformers keeps
    apart like any other example (:mod:`lightning_fsdp_plus.app.packing`). Every batch counts each row's padding and
    loss tokens (``padding_tokens``, ``target_tokens``).
    """

    def __init__(self, pad_token_id: int, *, length: int | None = None) -> None:
        self.pad_token_id, self.length = pad_token_id, length

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = self.length or max(len(b["input_ids"]) for b in batch)
        pad = lambda seq, value: seq + [value] * (width - len(seq))  # noqa: E731
        out = {
            "input_ids": torch.tensor([pad(b["input_ids"], self.pad_token_id) for b in batch]),
            "labels": torch.tensor([pad(b["labels"], -100) for b in batch]),
        }
        if "position_ids" in batch[0]:
            out["position_ids"] = torch.tensor([b["position_ids"] + list(range(width - len(b["position_ids"])))
                                                for b in batch])  # fmt: skip
        else:
            out["attention_mask"] = torch.tensor([pad([1] * len(b["input_ids"]), 0) for b in batch])
        out[PADDING_KEY] = torch.tensor([width - len(b["input_ids"]) for b in batch])
        out[TARGETS_KEY] = torch.tensor([b[TARGETS_KEY] if TARGETS_KEY in b else target_count(b) for b in batch])
        for key in (GLOBAL_TOKENS_KEY, SAMPLE_INDEX_KEY):
            if key in batch[0]:
                out[key] = torch.tensor([b[key] for b in batch])
        return out


class InstructionDataModule(LightningDataModule):
    """Instruction tuning data: ``{instruction, input?, response}`` records or chats (``{messages: [{role,
    content}, ...]}``, ShareGPT's ``{from, value}`` turns too), prompt-masked and tokenized.

    Arguments:
        tokenizer: Tokenizer directory or hub id (``AutoTokenizer``), usually the model's; ``None``: the
            byte-level tokenizer built in code (for a model built from a config).
        train_files: Local JSONL/JSON/CSV/Parquet files for training.
        val_files: Local files for held-out evaluation.
        dataset_name: A ``datasets`` dataset (local cache) used instead of files.
        train_split: Split of ``dataset_name`` for training.
        val_split: Split of ``dataset_name`` for evaluation.
        batch_size: Sequences per rank per step.
        max_seq_len: Tokens per example (longer ones are truncated), and per packed row.
        mask_prompt: Leave prompt tokens out of the loss (labels -100).
        pack: Pack whole training examples into rows of ``max_seq_len`` tokens (:mod:`lightning_fsdp_plus.app.packing`:
            positions restart per example, no attention or loss across examples); the rows are made once, from
            ``seed``, and shuffled every epoch like examples. Validation stays one example per row.
        num_workers: DataLoader workers per rank.
        columns: The files' names for our fields, e.g. ``{"response": "output"}`` for Alpaca-format files or
            ``{"messages": "conversations"}`` for ShareGPT ones.
        global_batch_size: Examples per optimizer step over all ranks and accumulation (default: ``batch_size`` x
            ranks x ``accumulate_grad_batches``); kept when a run resumes on another number of ranks. Batches
            carry their global batch's target tokens (``global_target_tokens``), so the loss is the global batch's
            token mean on any layout.
        seed: Seed of the packing's order among examples of equal length (default: the run's seed,
            ``seed_everything``'s).
    """

    def __init__(
        self,
        *,
        tokenizer: str | None,
        train_files: Sequence[str] | None = None,
        val_files: Sequence[str] | None = None,
        dataset_name: str | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        batch_size: int = 8,
        max_seq_len: int = 256,
        mask_prompt: bool = True,
        pack: bool = False,
        num_workers: int = 0,
        columns: Mapping[str, str] | None = None,
        global_batch_size: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.tokenizer = load_tokenizer(tokenizer)
        self.batch_size, self.num_workers, self.global_batch_size = batch_size, num_workers, global_batch_size
        self.sampler: GlobalBatchSampler | None = None
        for file in [*(train_files or []), *(val_files or [])]:
            check_instruction_file(file, columns=columns)
        self.train_records = [
            rename_fields(r, columns)
            for r in load_records(files=train_files, dataset_name=dataset_name, split=train_split)
        ]
        self.val_records = [rename_fields(r, columns) for r in
                            load_records(files=val_files, dataset_name=dataset_name, split=val_split)]  # fmt: skip
        encode = lambda r: encode_record(r, self.tokenizer, max_seq_len=max_seq_len, mask_prompt=mask_prompt)  # noqa: E731
        train = [encode(r) for r in self.train_records]
        self.packed_rows: list[list[int]] | None = None
        """With ``pack``: the training examples in each row (indices into ``train_records``)."""
        if pack:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
            train, self.packed_rows = pack_examples(train, row_len=max_seq_len, seed=seed)
        self.train_set = _Tokenized(train)
        self.val_set = _Tokenized([encode(r) for r in self.val_records])
        self.train_collate = PadCollator(self.tokenizer.pad_token_id, length=max_seq_len if pack else None)
        self.collate = PadCollator(self.tokenizer.pad_token_id)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, resumable mid-epoch on any number of ranks."""
        self.sampler = shuffled_sampler(self.train_set, trainer=self.trainer, micro_batch_size=self.batch_size,
                                        global_batch_size=self.global_batch_size,
                                        weights=self.train_set.targets)  # fmt: skip
        return StatefulDataLoader(self.train_set, batch_size=self.batch_size, collate_fn=self.train_collate,
                                  sampler=self.sampler, num_workers=self.num_workers)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The data layout, saved in checkpoints."""
        return data_layout(self.sampler)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """The batch on ``device``, its sample indices and token counts left on the CPU (:data:`HOST_KEYS`): the
        sample log and the run's metrics read them every micro-batch, which on an accelerator would wait for the
        device each time."""
        if not isinstance(batch, dict):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        rest = {k: v for k, v in batch.items() if k not in HOST_KEYS}
        return {**super().transfer_batch_to_device(rest, device, dataloader_idx),
                **{k: v for k, v in batch.items() if k in HOST_KEYS}}  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        """Held-out batches in file order."""
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self.collate,
                          num_workers=self.num_workers)  # fmt: skip

    def generation_prompts(self, n: int) -> list[dict[str, str]]:
        """The first ``n`` held-out examples as ``{question, prompt, reference}`` for generation, prompted as they are
        trained (:func:`record_messages`: a chat's last answer is the reference, the conversation before it the
        prompt)."""
        prompts = []
        for record in self.val_records[:n]:
            turns = record_messages(record, self.tokenizer)
            if turns is not None:
                turns = turns[: max(i for i, t in enumerate(turns) if t["role"] == "assistant") + 1]
                prompts.append({"question": last_question(turns[:-1]), "prompt": chat_prompt(turns, self.tokenizer),
                                "reference": turns[-1]["content"]})  # fmt: skip
            else:
                prompts.append({"question": str(record["instruction"]), "prompt": render_prompt(record),
                                "reference": str(record["response"])})  # fmt: skip
        return prompts
