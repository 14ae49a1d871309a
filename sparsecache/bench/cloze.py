"""Cloze questions over a store's own documents: fidelity on real text, with no labels (#69 format c).

A sentence of one of the store's chunks that holds a distinctive span (an RFC, a version, a
dotted or snake_case identifier, a number of two or more digits) is shown with that span
blanked out, and the question asks for it. The question is answered by retrieval over the
store, so the context is whatever the store returns for it; the chunk the sentence came from is
the one the answer needs. An answer is correct when it contains the span (`fidelity.contains`),
and fidelity is measured against full prefill of the same retrieved chunks, as for the
generated suites. Nothing but the store is needed: this works on any store (`calibrate`).

Splits are by document: a document's questions are all `dev` or all `test` (by a hash of its
id), so the two splits never share a sentence or a document.
"""

from __future__ import annotations

import hashlib
import random
import re

from ..errors import ConfigError
from .fidelity import SPLITS, Question

# The kinds of span a question may blank out, most distinctive first: a sentence is asked about
# its first kind that occurs exactly once in it.
SPANS = (
    ("rfc", r"\bRFC ?\d{3,5}\b"),
    ("version", r"(?<![\w.])\d+\.\d+(?:\.\d+)*(?!\w|\.\d)"),
    ("identifier", r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?(?!\w|\.\w)"
                   r"|(?<![\w.])[a-z]+_[a-z0-9_]+(?!\w|\.\w)"),
    ("number", r"(?<![\w.,])\d{2,}(?!\w|[.,]\d)"),
)
CLOZE_CORPUS = "builtin:heldout"  # the demo corpus: no dictionary or wrapper was learned on it
CLOZE_CHUNK_TOKENS = 128  # k = 8 of them ~1,100 tokens: where full prefill is reliable for SmolLM2
BLANK = "____"
QUESTION = ("Fill in the blank ({blank}) in this sentence from the documents:\n\"{sentence}\"\n"
            "What goes in the blank? Give only the missing text.")
MIN_CHARS, MAX_CHARS = 40, 300  # sentences shorter say too little to be found, longer ones are lists or code


def split_of(doc_id: str) -> str:
    """The split a document's questions belong to: stable, by a hash of its id."""
    return SPLITS[hashlib.sha256(doc_id.encode()).digest()[0] % 2]


def sentences(text: str) -> list[str]:
    """`text`'s sentences (split at . ! ? followed by space, and at blank lines), stripped."""
    return [s.strip() for para in re.split(r"\n\s*\n", text) for s in re.split(r"(?<=[.!?])\s+", para)
            if s.strip()]


def blank(sentence: str) -> tuple[str, str, str] | None:
    """(kind, span, sentence with the span blanked) for the first kind of SPANS that occurs
    exactly once in `sentence`, or None when none does (or the sentence is too short or long)."""
    flat = " ".join(sentence.split())
    if not MIN_CHARS <= len(flat) <= MAX_CHARS:
        return None
    for kind, pattern in SPANS:
        found = list(re.finditer(pattern, flat))
        if len(found) == 1:
            m = found[0]
            return kind, m.group(0), flat[: m.start()] + BLANK + flat[m.end():]
    return None


def cloze_candidates(store, tokenizer) -> list[dict]:
    """Every blankable sentence of the store's chunks: chunk id, doc id, kind, span, the
    question; in the store's chunk order."""
    chunks = store.chunks()
    out = []
    for c, toks in zip(chunks, store.tokens([c.id for c in chunks])):
        text = tokenizer.decode([t for t in toks if t >= 0], skip_special_tokens=True)  # a wrapper's soft tokens: not text
        for s in sentences(text):
            made = blank(s)
            if made is not None:
                kind, span, blanked = made
                out.append({"chunk": c.id, "doc": c.doc_id, "kind": kind, "span": span,
                            "question": QUESTION.format(blank=BLANK, sentence=blanked)})
    return out


def make_cloze(session, ks=(8,), questions: int = 100, split: str = "dev", seed: int = 0,
               per_document: int = 1000) -> dict[int, list[Question]]:
    """`questions` cloze questions per k from `split`'s documents of `session`'s store, at most
    `per_document` from one document (spread over the corpus), each with the k chunks retrieval
    returns for it (best first) and the chunk its sentence came from as the one it needs."""
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    pool = [c for c in cloze_candidates(session.store, session.model.tokenizer) if split_of(c["doc"]) == split]
    rng = random.Random(f"cloze-{seed}-{split}")
    rng.shuffle(pool)
    picked, per_doc = [], {}
    for c in pool:
        if per_doc.get(c["doc"], 0) < per_document:
            picked.append(c)
            per_doc[c["doc"]] = per_doc.get(c["doc"], 0) + 1
    if len(picked) < questions:
        raise ConfigError(f"the store's {split} documents hold {len(picked)} cloze questions "
                          f"({per_document} per document at most); ask for fewer")
    picked = picked[:questions]
    suite = {}
    for k in ks:
        suite[k] = []
        for i, c in enumerate(picked):
            hits = [h["id"] for h in session.retrieve(c["question"], k)]
            suite[k].append(Question(f"k{k}-cloze-{i:03d}", c["question"], c["span"], [c["chunk"]], hits,
                                     hops=1, chunks=hits, needed=[c["chunk"]]))
    return suite
