"""What a chunk wrapper learns from, drawn from nothing an evaluation reads (#69 item 4).

A wrapper learned on one benchmark's generator behaves as a soft prompt for that benchmark's
format. So the default model's wrapper learns from three sources no fidelity format is drawn
from, each made here:

- running text: continuations of the built-in calibration text's train part
  (`learn._text_prompts`, unchanged);
- cloze over the same train part (`cloze_prompts`): a sentence of one of k consecutive pieces
  with a distinctive span blanked, asked as `bench fidelity --format cloze` asks (whose
  questions come from the *held-out* part, the demo corpus, instead);
- specimen logs (`specimen_prompts`): synthetic QA from a generator used nowhere else, a third
  template family (bulleted field notes) beside the entity suite's prose and the records
  format's tables, with names from syllables neither of them uses.

The teacher is full prefill of the same prompt either way: the wrapper learns to give its
answers, right or wrong.
"""

from __future__ import annotations

import random

SOURCES = ("specimens", "cloze", "text")  # the default recipe's question and text sources

# Names from syllables no evaluation generator uses (fidelity.SYLLABLES, fidelity.TRAIN_SYLLABLES, records.SYLLABLES)
SYLLABLES = ("aum", "bix", "cav", "dul", "eph", "fro", "gim", "hux", "ilo", "jem", "kuv", "lix", "mox", "nup",
             "oza", "pev", "quo", "rux", "siv", "tez")
KEEPERS = ("Adela", "Bertil", "Cosima", "Dmitri", "Eyvind", "Fenna", "Gaspard", "Halvard", "Isolde", "Jarek")
HABITATS = ("reed beds", "pine forest", "salt marsh", "limestone cliffs", "river gravel", "heath", "birch woods")
COLOURS = ("amber", "slate", "ochre", "teal", "crimson", "ivory", "umber", "olive")
KINDS = ("moth", "beetle", "fern", "lichen", "snail", "orchid", "sedge")
# Each field: how the log states it, and how a question asks it.
FIELDS = {
    "place": ("- found near: {place}", "Where was the {name} {kind} found?"),
    "habitat": ("- habitat: {habitat}", "What habitat is the {name} {kind} from?"),
    "size": ("- size: {size} mm", "How many millimetres does the {name} {kind} measure?"),
    "year": ("- first recorded: {year}", "In which year was the {name} {kind} first recorded?"),
    "colour": ("- colour: {colour}", "What colour is the {name} {kind}?"),
    "keeper": ("- recorded by: {keeper}", "Who recorded the {name} {kind}?"),
}
NOTES = ("The specimen is kept in a labelled drawer.", "Several duplicates were exchanged with other collections.",
         "The label was rewritten after water damage.", "A sketch accompanies the entry.",
         "The entry was checked during the last inventory.", "No photograph exists of the original find.")


def _name(rng: random.Random, taken: set) -> str:
    while True:
        name = "".join(rng.sample(SYLLABLES, rng.choice((2, 3)))).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def specimen_logs(n_logs: int, seed: int = 0) -> list[dict]:
    """`n_logs` specimen logs: {text, facts: {field: value}, name, kind}."""
    rng, taken = random.Random(f"specimens-{seed}"), set()
    places = [_name(rng, taken) + " " + rng.choice(("Creek", "Ridge", "Fen", "Hollow")) for _ in range(12)]
    logs = []
    for _ in range(n_logs):
        name, kind = _name(rng, taken), rng.choice(KINDS)
        facts = {"place": rng.choice(places), "habitat": rng.choice(HABITATS), "size": str(rng.randint(3, 180)),
                 "year": str(rng.randint(1820, 1990)), "colour": rng.choice(COLOURS),
                 "keeper": f"{rng.choice(KEEPERS)} {_name(rng, taken)}"}
        fields = rng.sample(list(FIELDS), len(FIELDS))
        lines = [f"Specimen log: {name} {kind}"] + [FIELDS[f][0].format(**facts) for f in fields]
        text = "\n".join(lines) + "\n\n" + " ".join(rng.sample(NOTES, 2)) + "\n"
        logs.append({"text": text, "facts": facts, "name": name, "kind": kind})
    return logs


def specimen_prompts(tokenize, n: int, k: int, seed: int = 0) -> list[dict]:
    """`n` question prompts over specimen logs: the asked log among k - 1 others at a random rank.
    `tokenize(text)` gives token ids; each prompt is {kind, chunks (token ids, in context
    order), question (text), truth, id}."""
    rng = random.Random(f"specimen-prompts-{seed}")
    logs = specimen_logs(max(4 * k, n // 3 + k), seed)
    tokens = [tokenize(log["text"]) for log in logs]
    out = []
    for i in range(n):
        j = rng.randrange(len(logs))
        field = rng.choice(list(FIELDS))
        others = rng.sample([x for x in range(len(logs)) if x != j], k - 1)
        others.insert(rng.randrange(k), j)
        log = logs[j]
        out.append({"kind": "question", "chunks": [tokens[x] for x in others], "id": f"specimen-{i:04d}",
                    "question": FIELDS[field][1].format(name=log["name"], kind=log["kind"]),
                    "truth": log["facts"][field]})
    return out


def cloze_prompts(decode, windows: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` cloze prompts over running-text windows (`learn._text_prompts`'s, of the
    calibration text's train part): a blankable sentence of one of a window's k pieces, asked
    as `measure.cloze` asks, with the window's pieces as the chunks; fewer if the windows hold
    fewer such sentences. `decode(ids)` gives text."""
    from ..measure.cloze import BLANK, QUESTION, blank, sentences

    found = [(w, made) for w, window in enumerate(windows) for piece in window["chunks"]
             for s in sentences(decode(piece))[1:-1]  # the first and last may be cut at the piece's edge
             if (made := blank(s)) is not None]
    picked = random.Random(f"cloze-prompts-{seed}").sample(found, min(n, len(found)))
    return [{"kind": "question", "chunks": windows[w]["chunks"], "id": f"cloze-{i:04d}",
             "question": QUESTION.format(blank=BLANK, sentence=blanked), "truth": span}
            for i, (w, (_, span, blanked)) in enumerate(picked)]
