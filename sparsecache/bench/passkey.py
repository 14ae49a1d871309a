"""A RULER-style needle task spread over retrieved chunks, for comparing fusion methods.

Each trial has k chunks of unrelated text (held-out Python documentation); one of them
(two in the multi-key variant) has a sentence inserted that gives a 6-digit number for a
named key, and the question asks for it. A trial is correct when the generated answer
contains the number. Needle chunks are distinct per trial, so they are encoded into the
store like any other document; the filler chunks are shared.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import TextError
from ..measure.suite import chunk_ids_by_doc

KEYS = ("apple", "river", "falcon", "copper", "meadow", "lantern", "violet", "harbor", "cedar", "comet")
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
NEEDLE = " One of the special magic numbers for {key} is: {value}. "


@dataclass(frozen=True)
class Trial:
    chunk_docs: list[str]  # document ids of the k chunks, in context order
    key: str
    value: str
    question: str


def filler_passages(tokenizer, tokens_per_chunk: int, count: int | None) -> list[str]:
    """`count` pieces of held-out documentation of about `tokens_per_chunk` tokens each
    (None: every piece there is)."""
    from ..text.documents import builtin_documents

    pieces = []
    for d in builtin_documents("heldout"):
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - tokens_per_chunk, tokens_per_chunk):
            pieces.append(tokenizer.decode(ids[start : start + tokens_per_chunk]))
            if len(pieces) == count:
                return pieces
    if count is None:
        return pieces
    raise TextError(f"not enough held-out text for {count} filler chunks")


def insert_sentence(text: str, sentence: str, rng: random.Random) -> str:
    cuts = [m.end() for m in re.finditer(r"[.!?]\s", text)] or [len(text) // 2]
    at = rng.choice(cuts)
    return text[:at] + sentence + text[at:]


def make_task(tokenizer, out: str | Path, trials: int = 20, k: int = 4, tokens_per_chunk: int = 240,
              keys_per_trial: int = 1, seed: int = 0) -> list[Trial]:
    """Write `out`/corpus.jsonl (filler + needle chunks) and `out`/trials.json; returns the trials."""
    rng = random.Random(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    filler = filler_passages(tokenizer, tokens_per_chunk, max(k * 2, 16) + trials * keys_per_trial)
    shared, spare = filler[: max(k * 2, 16)], filler[max(k * 2, 16):]
    docs = {f"filler-{i:03d}": t for i, t in enumerate(shared)}
    result = []
    for t in range(trials):
        keys = rng.sample(KEYS, keys_per_trial)
        values = [str(rng.randint(100000, 999999)) for _ in keys]
        slots = rng.sample(range(k), keys_per_trial)
        others = iter(rng.sample(sorted(set(docs) - {d for d in docs if d.startswith("needle")}), k))
        order = []
        for i in range(k):
            if i in slots:
                j = slots.index(i)
                doc = f"needle-{t:03d}-{j}"
                docs[doc] = insert_sentence(spare[t * keys_per_trial + j], NEEDLE.format(key=keys[j], value=values[j]), rng)
                order.append(doc)
            else:
                order.append(next(others))
        ask = rng.randrange(keys_per_trial)
        result.append(Trial(order, keys[ask], values[ask], QUESTION.format(key=keys[ask])))
    with open(out / "corpus.jsonl", "w") as f:
        for doc, text in docs.items():
            f.write(json.dumps({"id": doc, "text": text}) + "\n")
    (out / "trials.json").write_text(json.dumps([asdict(r) for r in result], indent=1))
    return result


def load_trials(out: str | Path) -> list[Trial]:
    return [Trial(**t) for t in json.loads((Path(out) / "trials.json").read_text())]


def run_trials(session, trials: list[Trial], method: str, ratio: float, max_new_tokens: int = 12, **kw) -> dict:
    """Accuracy and mean TTFT of one method over the trials."""
    ids = chunk_ids_by_doc(session.store)
    correct, ttft, answers = 0, [], []
    for t in trials:
        a = session.query(t.question, chunks=[ids[d] for d in t.chunk_docs], method=method, recompute_ratio=ratio,
                          prefill_under=0, max_new_tokens=max_new_tokens, answer_prefix=ANSWER_PREFIX.format(key=t.key), **kw)
        correct += t.value in a.answer
        ttft.append(a.timings_ms["ttft"])
        answers.append(a.answer)
    return {"method": method, "ratio": ratio, "accuracy": correct / len(trials), "trials": len(trials),
            "ttft_ms": sum(ttft) / len(ttft), "answers": answers[:5]}
