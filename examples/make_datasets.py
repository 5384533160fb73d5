"""Write the example instruction datasets and the pretraining corpus from the fact tables in the repo.

    python examples/make_datasets.py        # rewrites examples/{medical,legal}_lora/data/*.jsonl and
                                            # examples/assets/corpus.txt (deterministic)

Every example is generated from ``examples/medical_lora/facts.py`` and ``examples/legal_lora/facts.py``
(written for this project, CC0-1.0) with question and answer templates; one in six examples is held out
(seeded). ``heldout_questions.jsonl`` asks about the same facts in templates no example uses (kept out of
training: tests/examples check it), for the before/after accuracy of ``benchmarks/heldout.py``. The corpus
states the same facts as prose, in other words than the answers, so that the tiny
base model knows the language of both domains but not the instruction format.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES))

from legal_lora.facts import TERMS  # noqa: E402
from medical_lora.facts import CONDITIONS  # noqa: E402

HELD_OUT_EVERY = 6


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _list(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]


def medical_examples() -> list[dict[str, str]]:
    """Eight question types per condition."""
    rows = []
    for name, system, symptoms, cause, care, specialist, prevention in CONDITIONS:
        label = f"{_article(system)} {system}" if system not in ("whole body",) else "a whole-body"
        rows += [
            {"instruction": f"What are common symptoms of {name}?",
             "response": f"Common symptoms of {name} include {_list(symptoms)}."},
            {"instruction": f"What causes {name}?", "response": f"{_cap(name)} is usually caused by {cause}."},
            {"instruction": f"How is {name} usually treated?",
             "response": f"First-line care for {name} is {care}."},
            {"instruction": f"Which specialist usually treats {name}?",
             "response": f"{_cap(name)} is usually managed by {specialist}."},
            {"instruction": f"How can the risk of {name} be reduced?",
             "response": f"Helpful measures include {prevention}."},
            {"instruction": f"What kind of condition is {name}?",
             "response": f"{_cap(name)} is {label} condition."},
            {"instruction": "Which condition could explain these symptoms?", "input": _list(symptoms),
             "response": f"These symptoms could point to {name}; a doctor should confirm the diagnosis."},
            {"instruction": f"Give a short overview of {name}.",
             "response": f"{_cap(name)} is {label} condition. It is usually caused by {cause}, typical symptoms are "
                         f"{_list(symptoms)}, and first-line care is {care}."},
        ]  # fmt: skip
    return rows


def legal_examples() -> list[dict[str, str]]:
    """Seven question types per term."""
    rows = []
    for term, area, definition, example in TERMS:
        rows += [
            {"instruction": f"What does {term} mean in law?", "response": f"In law, {term} means {definition}."},
            {"instruction": f"Define {term}.", "response": f"{_cap(term)}: {definition}."},
            {"instruction": f"Which area of law deals with {term}?", "response": f"{_cap(term)} belongs to {area}."},
            {"instruction": f"Give an example of {term}.", "response": f"For example, {example}"},
            {"instruction": "Which legal term matches this description?", "input": definition,
             "response": f"The term is {term}."},
            {"instruction": f"Explain {term} in plain language.",
             "response": f"{_cap(term)} is {definition}. For example, {example}"},
            {"instruction": f"Summarize {term} in one sentence.", "response": f"{_cap(term)} is {definition}."},
        ]  # fmt: skip
    return rows


SPECIALIST_ALSO = {
    "general practitioner": ["family doctor", "primary care"],
    "otolaryngologist": ["ENT"],
    "infectious disease specialist": ["infectious disease"],
    "sports medicine doctor": ["sports medicine"],
    "general surgeon": ["surgeon"],
}
"""Other words for a specialist that also count as the right answer."""
CONDITION_ALSO = {"type 2 diabetes": ["diabetes"], "gastroesophageal reflux disease": ["GERD", "acid reflux"],
                  "chronic obstructive pulmonary disease": ["COPD"], "Parkinson disease": ["Parkinson"],
                  "Alzheimer disease": ["Alzheimer"], "iron deficiency anemia": ["iron deficiency"],
                  "generalized anxiety disorder": ["anxiety disorder"], "vitamin B12 deficiency": ["B12 deficiency"],
                  "middle ear infection": ["ear infection", "otitis media"], "urinary tract infection": ["UTI"],
                  "hepatitis A": ["hepatitis"], "the common cold": ["common cold"]}  # fmt: skip
"""Other names of a condition that also count as the right answer."""
SYSTEM_ALSO = {
    "cardiovascular": ["heart"],
    "respiratory": ["lung", "airway"],
    "nervous": ["brain", "nerve"],
    "digestive": ["stomach", "intestin", "bowel", "liver", "gut"],
    "urinary": ["kidney", "bladder"],
    "musculoskeletal": ["bone", "joint", "muscle"],
    "endocrine": ["hormon", "gland"],
    "mental health": ["mental", "mind"],
}
"""Other words for a body system that also count as the right answer (the base model's plainer words are right too)."""
AREA_ALSO = {"tort law": ["tort"], "contract law": ["contract"], "criminal law": ["criminal"], "civil law": ["civil"],
             "property law": ["property"], "constitutional law": ["constitutional"], "procedure": ["procedur"],
             "succession law": ["succession", "inheritance"], "equity": ["equit"], "remedies": ["remed"]}  # fmt: skip
"""Other words for an area of law that also count as the right answer."""
MEDICAL_QUESTIONS = (
    ("specialist", "My doctor thinks I have {name}. What kind of specialist should I be referred to?"),
    ("condition", "I have been having {symptoms}. What condition might this be?"),
    ("specialist", "Who is the right medical specialist to see for {name}?"),
    ("condition", "A patient reports {symptoms}. Which condition is the most likely cause?"),
    ("specialist", "If a patient has {name}, which type of doctor usually looks after them?"),
    ("condition", "What illness typically comes with {symptoms}?"),
    ("system", "Which body system does {name} mainly affect?"),
    ("system", "Which organs or body system are affected by {name}?"),
    ("system", "{Name} is a disorder of which part of the body?"),
)
"""Held-out question templates (worded unlike any training example), cycled over the conditions: each condition is
asked about its specialist, the part of the body it affects and, from its symptoms in another order, its name."""
LEGAL_QUESTIONS = (
    ("area", "Which branch of law is the concept of {term} part of?"),
    ("term", "What is the legal term for {definition}?"),
    ("area", "A lawyer mentions {term}. What field of law is she talking about?"),
    ("term", "Lawyers have a name for {definition}. What is it?"),
    ("area", "In what area of law would you come across {term}?"),
    ("term", "Name the legal concept that means {definition}."),
)
"""Held-out question templates for the legal terms: each term's area of law, and the term from its definition."""


def _pick(templates: tuple[tuple[str, str], ...], kind: str, index: int) -> str:
    of_kind = [text for k, text in templates if k == kind]
    return of_kind[index % len(of_kind)]


def medical_questions() -> list[dict]:
    """Three held-out questions per condition, ``{question, answers, kind, fact}``: ``answers`` are the spans (any one,
    case-insensitive) a right answer contains."""
    rows = []
    for i, (name, system, symptoms, _, _, specialist, _) in enumerate(CONDITIONS):
        who = specialist.split(" ", 1)[1]  # without the article
        shuffled = [symptoms[2], symptoms[0], symptoms[1]]  # another order than every training example's
        rows += [
            {"question": _pick(MEDICAL_QUESTIONS, "specialist", i).format(name=name), "kind": "specialist",
             "answers": [who, *SPECIALIST_ALSO.get(who, [])], "fact": name},
            {"question": _pick(MEDICAL_QUESTIONS, "condition", i).format(symptoms=_list(shuffled)), "kind": "condition",
             "answers": [name.removeprefix("the "), *CONDITION_ALSO.get(name, [])], "fact": name},
            {"question": _pick(MEDICAL_QUESTIONS, "system", i).format(name=name, Name=_cap(name)), "kind": "system",
             "answers": [system.removesuffix(" system"), *SYSTEM_ALSO.get(system.removesuffix(" system"), [])],
             "fact": name},
        ]  # fmt: skip
    return rows


def legal_questions() -> list[dict]:
    """Two held-out questions per term, ``{question, answers, kind, fact}`` (as :func:`medical_questions`)."""
    rows = []
    for i, (term, area, definition, _) in enumerate(TERMS):
        rows += [
            {"question": _pick(LEGAL_QUESTIONS, "area", i).format(term=term), "kind": "area",
             "answers": [area, *AREA_ALSO.get(area, [])], "fact": term},
            {"question": _pick(LEGAL_QUESTIONS, "term", i).format(definition=definition), "kind": "term",
             "answers": [term], "fact": term},
        ]  # fmt: skip
    return rows


def corpus() -> str:
    """Prose about every condition and term, worded differently from the dataset's answers."""
    lines = []
    for name, system, symptoms, cause, care, specialist, prevention in CONDITIONS:
        lines += [
            f"Doctors describe {name} as a problem of the {system}.",
            f"People with {name} often notice {symptoms[0]}, and many also have {symptoms[1]} or {symptoms[2]}.",
            f"The condition develops because of {cause}.",
            f"Care usually starts with {care}, and patients are often seen by {specialist}.",
            f"To lower the chance of {name}, clinicians recommend {prevention}.",
        ]
    for term, area, definition, example in TERMS:
        lines += [
            f"Lawyers use the word {term} in {area}.",
            f"The expression refers to {definition}.",
            f"A typical case: {example}",
            f"Courts and textbooks discuss {term} when they explain {area}.",
        ]
    return "\n".join(lines) + "\n"


def split(rows: list[dict[str, str]], *, seed: int) -> tuple[list[dict], list[dict]]:
    """Seeded shuffle; every ``HELD_OUT_EVERY``-th example is held out."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    val = [rows[i] for n, i in enumerate(order) if n % HELD_OUT_EVERY == 0]
    train = [rows[i] for n, i in enumerate(order) if n % HELD_OUT_EVERY != 0]
    return train, val


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main() -> None:
    for domain, rows, seed in (("medical_lora", medical_examples(), 11), ("legal_lora", legal_examples(), 12)):
        train, val = split(rows, seed=seed)
        _write_jsonl(EXAMPLES / domain / "data" / "train.jsonl", train)
        _write_jsonl(EXAMPLES / domain / "data" / "val.jsonl", val)
        print(f"{domain}: {len(train)} train, {len(val)} held-out")
    for domain, questions in (("medical_lora", medical_questions()), ("legal_lora", legal_questions())):
        _write_jsonl(EXAMPLES / domain / "data" / "heldout_questions.jsonl", questions)
        print(f"{domain}: {len(questions)} held-out questions")
    (EXAMPLES / "assets").mkdir(exist_ok=True)
    (EXAMPLES / "assets" / "corpus.txt").write_text(corpus())
    print(f"corpus: {len(corpus().split())} words")


if __name__ == "__main__":
    main()
