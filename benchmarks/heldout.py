"""Ask a fine-tune's held-out questions to the base and to the adapted model, with plain transformers + peft.

    python -m benchmarks.heldout outputs/medical_smollm2/runs/<time>      # a finished run's directory
    python -m benchmarks.heldout RUN --out results.json --show 5

The run's ``metrics.json`` names its PEFT adapter (``adapter_dir``, whose ``adapter_config.json`` names the base
checkpoint) and how the base was held (``quantize_base``: an int8 base is loaded as transformers' LLM.int8, the
layers it trained against); the run's config names the question file (``generate.questions``: JSONL rows of
``{question, answers}``, phrased unlike any training example). Every question goes through the tokenizer's chat
template as one user turn and is answered greedily by the base (the adapter disabled) and by the tuned model; an
answer is right when it contains one of the question's ``answers`` (case-insensitive). Nothing of this project is
imported: the adapter must stand on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 32
"""Tokens each answer may have at most (the shipped answers are one sentence)."""


def is_right(answer: str, spans: list[str]) -> bool:
    """Whether ``answer`` contains one of ``spans`` (case-insensitive)."""
    text = answer.lower()
    return any(span.lower() in text for span in spans)


def run_settings(run_dir: Path, *, questions: Path | None = None) -> dict[str, Any]:
    """What the evaluation needs from a finished run: adapter, base, quantization, question file, perplexities."""
    from omegaconf import OmegaConf

    metrics = json.loads((run_dir / "metrics.json").read_text())
    if not metrics.get("adapter_dir"):
        raise SystemExit(f"{run_dir}: the run saved no adapter (metrics.json has no adapter_dir)")
    adapter = Path(metrics["adapter_dir"])
    adapter = adapter if adapter.is_absolute() else run_dir / adapter
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    if not OmegaConf.has_resolver("shipped"):  # the shipped experiments name their files ${shipped:examples/...}
        OmegaConf.register_new_resolver("shipped", lambda relative: str(REPO / relative))
    questions = questions or OmegaConf.select(config, "generate.questions", default=None)
    if not questions:
        raise SystemExit(f"{run_dir}: the run's config names no generate.questions file")
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    return {"adapter": adapter, "base": base, "quantize_base": metrics.get("quantize_base"),
            "questions": Path(str(questions)), "task": config.get("task_name"), "metrics": metrics}  # fmt: skip


def load_models(base: str, adapter: Path, *, quantize_base: str | None) -> tuple[Any, Any]:
    """``(peft model, tokenizer)``: the base as the run held it (float, or LLM.int8 for an int8 base) with the
    adapter on top, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_8bit=True) if quantize_base == "int8" else None
    if quantize_base not in (None, "int8"):
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=quantization)
    return PeftModel.from_pretrained(model, str(adapter)).eval(), AutoTokenizer.from_pretrained(base)


@torch.no_grad()
def answer(model: Any, tokenizer: Any, question: str) -> str:
    """The greedy answer to ``question`` asked alone (no padding: LLM.int8's outlier columns depend on the batch) as
    one user turn through the chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def answers(model: Any, tokenizer: Any, questions: list[str]) -> list[str]:
    """The greedy answers to ``questions``, one at a time."""
    return [answer(model, tokenizer, q) for q in questions]


def accuracies(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The number of ``rows`` and the share the base and the tuned model answered right."""
    count = len(rows)
    return {
        "questions": count,
        "base_accuracy": sum(r["base_right"] for r in rows) / count,
        "tuned_accuracy": sum(r["tuned_right"] for r in rows) / count,
    }


def evaluate(run_dir: Path, *, questions: Path | None = None) -> dict[str, Any]:
    """Every question answered by the base and the tuned model, with the accuracies (overall and per kind)."""
    import peft
    import transformers

    settings = run_settings(run_dir, questions=questions)
    asked = [json.loads(line) for line in settings["questions"].read_text().splitlines() if line.strip()]
    started = time.perf_counter()
    model, tokenizer = load_models(settings["base"], settings["adapter"], quantize_base=settings["quantize_base"])
    texts = [item["question"] for item in asked]
    with model.disable_adapter():
        base = answers(model, tokenizer, texts)
    tuned = answers(model, tokenizer, texts)
    rows = [
        {
            **item,
            "base": b,
            "tuned": t,
            "base_right": is_right(b, item["answers"]),
            "tuned_right": is_right(t, item["answers"]),
        }
        for item, b, t in zip(asked, base, tuned, strict=True)
    ]
    metrics = settings["metrics"]
    kinds = {r["kind"] for r in rows}
    return {
        "task": settings["task"],
        "run_dir": str(run_dir),
        "questions_file": str(settings["questions"]),
        **accuracies(rows),
        "by_kind": {kind: accuracies([r for r in rows if r["kind"] == kind]) for kind in sorted(kinds)},
        "base_val_perplexity": metrics.get("base_val_perplexity"),
        "val_perplexity": metrics.get("val_perplexity"),
        "steps": metrics.get("steps"),
        "fit_time_s": metrics.get("fit_time_s"),
        "quantize_base": settings["quantize_base"],
        "evaluation_s": time.perf_counter() - started,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Evaluate one run; print the accuracies and a few answers side by side; write the JSON with ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished fsdp-plus-train run directory (with metrics.json)")
    parser.add_argument("--out", type=Path, help="write every question and answer here as JSON")
    parser.add_argument("--show", type=int, default=3, help="answers to print side by side")
    parser.add_argument("--questions", type=Path, help="a question file (default: the run's generate.questions)")
    args = parser.parse_args(argv)
    result = evaluate(args.run_dir, questions=args.questions)
    print(f"{result['task']}: {result['questions']} held-out questions, right answers: base"
          f" {result['base_accuracy']:.0%} -> tuned {result['tuned_accuracy']:.0%}")  # fmt: skip
    for row in result["rows"][: args.show]:
        print(f"Q: {row['question']}\n   base:  {row['base']}\n   tuned: {row['tuned']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
