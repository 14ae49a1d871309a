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
from .suite import SPLITS, Question

# The kinds of span a question may blank out, most distinctive first: a sentence is asked about
# its first kind that occurs exactly once in it.
SPANS = (
    ("rfc", r"\bRFC ?\d{3,5}\b"),
    ("version", r"(?<![\w.])\d+\.\d+(?:\.\d+)*(?!\w|\.\d)"),
    ("identifier", r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?(?!\w|\.\w)"
                   r"|(?<![\w.])[a-z]+_[a-z0-9_]+(?!\w|\.\w)"),
    ("number", r"(?<![\w.,])\d{2,}(?!\w|[.,]\d)"),
)
# `continue` questions may also ask for a plainer span, where a sentence has none of the above:
# a capitalised or CamelCase name inside the sentence, else a long word. `make_cloze` takes the
# questions about SPANS' kinds first, so these only fill up a store with few distinctive spans.
PLAIN_SPANS = (
    ("name", r"(?<=[\w,;:] )(?:[A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]{3,})(?![\w.])"),
    ("word", r"(?<![\w.])[a-z]{8,}(?![\w.])"),
)
CLOZE_CORPUS = "builtin:heldout"  # the demo corpus: no dictionary or wrapper was learned on it
CLOZE_CHUNK_TOKENS = 128  # k = 8 of them ~1,100 tokens: where full prefill is reliable for SmolLM2
BLANK = "____"
QUESTION = ("Fill in the blank ({blank}) in this sentence from the documents:\n\"{sentence}\"\n"
            "What goes in the blank? Give only the missing text.")
# `continue` (calibrate's style): the answer is begun with the sentence up to the span, so the
# model continues a sentence of its context, the question naming the sentence's first words
CONTINUE = "Quote the sentence from the documents that begins \"{start} …\", word for word."
START_WORDS = 6  # of the sentence, in a `continue` question
MIN_BEFORE = 3  # words a `continue` sentence holds before its span: something to continue from
STYLES = ("blank", "continue")
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
    made = _span(sentence)
    if made is None:
        return None
    kind, flat, m = made
    return kind, m.group(0), flat[: m.start()] + BLANK + flat[m.end():]


def _span(sentence: str, min_before: int = 0, kinds=SPANS):
    """(kind, the sentence with its spaces normalised, the match) of its first kind of `kinds`
    that occurs exactly once, after at least `min_before` words; None where there is none."""
    flat = " ".join(sentence.split())
    if not MIN_CHARS <= len(flat) <= MAX_CHARS:
        return None
    for kind, pattern in kinds:
        found = list(re.finditer(pattern, flat))
        if len(found) == 1 and len(flat[: found[0].start()].split()) >= min_before:
            return kind, flat, found[0]
    return None


def question(sentence: str, style: str = "blank") -> dict | None:
    """A cloze question about `sentence` in `style` (STYLES): {kind, span, question,
    answer_prefix}, or None where it has no span to ask for.

    - `blank` (#69's format c): the sentence with its span blanked, the answer from scratch;
    - `continue`: the question names the sentence by its first words and the answer is begun
      with the sentence up to the span, so the model continues it (copying from its context is
      what even a small model does reliably, so full prefill is confident on more of these)."""
    if style not in STYLES:
        raise ConfigError(f"cloze style must be one of {', '.join(STYLES)}, got {style!r}")
    if style == "blank":
        made = blank(sentence)
        return None if made is None else {"kind": made[0], "span": made[1], "answer_prefix": "",
                                          "question": QUESTION.format(blank=BLANK, sentence=made[2])}
    made = _span(sentence, MIN_BEFORE, SPANS + PLAIN_SPANS)
    if made is None:
        return None
    kind, flat, m = made
    words = flat.split()
    start = " ".join(words[: min(START_WORDS, len(flat[: m.start()].split()))])
    return {"kind": kind, "span": m.group(0), "answer_prefix": flat[: m.start()].rstrip(),
            "question": CONTINUE.format(start=start)}


def cloze_candidates(store, tokenizer, style: str = "blank") -> list[dict]:
    """Every sentence of the store's chunks with a cloze question in `style`: chunk id, doc id,
    kind, span, the question and the start of its answer; in the store's chunk order."""
    chunks = store.chunks()
    out = []
    for c, toks in zip(chunks, store.tokens([c.id for c in chunks])):
        text = tokenizer.decode([t for t in toks if t >= 0], skip_special_tokens=True)  # a wrapper's soft tokens: not text
        for s in sentences(text):
            made = question(s, style)
            if made is not None:
                out.append({"chunk": c.id, "doc": c.doc_id, **made})
    return out


def distinctive_first(pool: list[dict]) -> None:
    """Sort cloze candidates in place so those about SPANS' kinds come before PLAIN_SPANS' (a
    stable sort: their order within each stays as it was, shuffled)."""
    plain = {kind for kind, _ in PLAIN_SPANS}
    pool.sort(key=lambda c: c["kind"] in plain)


def make_cloze(session, ks=(8,), questions: int = 100, split: str | None = "dev", seed: int = 0,
               per_document: int = 1000, style: str = "blank") -> dict[int, list[Question]]:
    """`questions` cloze questions in `style` per k from `split`'s documents of `session`'s store
    (None: every document, as `calibrate` asks), at most `per_document` from one document
    (spread over the corpus), each with the k chunks retrieval returns for it (best first) and
    the chunk its sentence came from as the one it needs."""
    if split is not None and split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    pool = [c for c in cloze_candidates(session.store, session.model.tokenizer, style)
            if split is None or split_of(c["doc"]) == split]
    rng = random.Random(f"cloze-{seed}-{split}")
    rng.shuffle(pool)
    if style == "continue":
        distinctive_first(pool)
    picked, per_doc = [], {}
    for c in pool:
        if per_doc.get(c["doc"], 0) < per_document:
            picked.append(c)
            per_doc[c["doc"]] = per_doc.get(c["doc"], 0) + 1
    if len(picked) < questions:
        where = "the store's documents" if split is None else f"the store's {split} documents"
        raise ConfigError(f"{where} hold {len(picked)} cloze questions ({per_document} per document at most); "
                          "ask for fewer")
    picked = picked[:questions]
    suite = {}
    for k in ks:
        suite[k] = []
        for i, c in enumerate(picked):
            hits = [h["id"] for h in session.retrieve(c["question"], k)]
            suite[k].append(Question(f"k{k}-cloze-{i:03d}", c["question"], c["span"], [c["chunk"]], hits,
                                     hops=1, chunks=hits, needed=[c["chunk"]],
                                     answer_prefix=c["answer_prefix"] or None))
    return suite
