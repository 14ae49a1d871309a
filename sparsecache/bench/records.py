"""Timetable records (#69 format b, the held-out format): questions about tables, with look-alikes.

A second generator with another template family than the entity suite's prose: each document
is one service's timetable, a Markdown table of stops, departure times and platforms, with the
operator and the fare below it. Services come in look-alike families: the same name as an
Express, a Local and a Night service, over overlapping stops, so a question about one has
near-identical distractors. Some questions need two documents: the operator's own record holds
where it is based. Contexts are what the store's own retrieval returns for the question (the
distractors are chosen by retrieval from the whole pool, look-alikes included), so a question
whose document retrieval misses is one full prefill cannot answer either.

This format is HELD OUT (#69): neither it nor its generator is used to learn a wrapper or to
choose anything; its figures are reported apart. dev and test draw from disjoint name pools
and question phrasings.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError
from ..measure.suite import SPLITS, Question

HELD_OUT = True  # #69: never used to learn or choose anything

SYLLABLES = {"dev": ("ard", "bel", "cor", "dun", "elm", "fal", "gar", "hol", "ivr", "jas", "kor", "lum"),
             "test": ("mar", "nor", "osk", "pel", "quin", "ros", "sal", "tor", "ulv", "ves", "wen", "yar")}
KINDS = ("Express", "Local", "Night")
COMPANY_SUFFIX = ("Rail", "Lines", "Transit", "Coaches")
# Each fact: how a question asks it, per split (dev and test never share a phrasing).
ASK = {
    "time": {"dev": ("When does the {s} leave {stop}?", "At what time does the {s} depart from {stop}?"),
             "test": ("What is the departure time of the {s} at {stop}?", "Which time is the {s} due to leave {stop}?")},
    "platform": {"dev": ("From which platform does the {s} leave {stop}?",),
                 "test": ("What platform number does the {s} use at {stop}?",)},
    "fare": {"dev": ("How many crowns does a ticket on the {s} cost?",),
             "test": ("What is the fare, in crowns, for the {s}?",)},
    "operator": {"dev": ("Which company operates the {s}?",), "test": ("Who runs the {s}?",)},
    "base": {"dev": ("In which town is the operator of the {s} based?",),
             "test": ("Where does the company running the {s} have its base?",)},
}


def _name(rng: random.Random, syllables: tuple[str, ...], taken: set) -> str:
    while True:
        name = "".join(rng.sample(syllables, rng.choice((2, 3)))).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def make_records(out: str | Path, questions: int = 100, families: int = 30, split: str = "dev",
                 seed: int = 0) -> list[dict]:
    """Write `out`/corpus.jsonl (a timetable per service, a record per operator) and return
    `questions` facts to ask: {question, truth, docs (the documents the answer needs), hops};
    a fifth need two documents (the operator's base). Contexts come from retrieval
    (`records_suite`), once the corpus is a store."""
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    rng, taken = random.Random(f"records-{seed}-{split}"), set()
    syl = SYLLABLES[split]
    towns = [_name(rng, syl, taken) for _ in range(10)]
    stops = [_name(rng, syl, taken) + " " + rng.choice(("Square", "Bridge", "Halt", "Cross", "Gate"))
             for _ in range(24)]
    companies = [f"{_name(rng, syl, taken)} {rng.choice(COMPANY_SUFFIX)}" for _ in range(max(4, families // 3))]
    docs, one, two = {}, [], []
    for c, company in enumerate(companies):
        docs[f"operator-{c:03d}"] = (f"# {company}\n\n{company} is a transport company based in {rng.choice(towns)}. "
                                     f"It was founded in {rng.randint(1890, 1990)} and runs services across the "
                                     "region.\n")
    for f in range(families):
        base = _name(rng, syl, taken)
        route = rng.sample(stops, 6)
        for kind in KINDS:
            s, c = f"{base} {kind}", rng.randrange(len(companies))
            doc = f"service-{f:03d}-{kind.lower()}"
            visited = sorted(rng.sample(route, 4), key=route.index)  # look-alikes share most stops
            hour, rows = rng.randint(5, 21), []
            for stop in visited:
                minute = rng.randint(0, 59)
                rows.append((stop, f"{hour:02d}:{minute:02d}", str(rng.randint(1, 12))))
                hour = min(23, hour + rng.randint(0, 1))
            fare = str(rng.randint(3, 60))
            table = "\n".join(f"| {a} | {b} | {p} |" for a, b, p in rows)
            docs[doc] = (f"# {s} timetable\n\n| Stop | Departs | Platform |\n| --- | --- | --- |\n{table}\n\n"
                         f"Operated by {companies[c]}. A single ticket costs {fare} crowns.\n")
            stop, time, platform = rng.choice(rows)
            for fact, truth in (("time", time), ("platform", platform), ("fare", fare), ("operator", companies[c])):
                one.append({"question": rng.choice(ASK[fact][split]).format(s=s, stop=stop), "truth": truth,
                            "docs": [doc], "hops": 1})
            town = docs[f"operator-{c:03d}"].split(" based in ", 1)[1].split(".", 1)[0]
            two.append({"question": rng.choice(ASK["base"][split]).format(s=s), "truth": town,
                        "docs": [doc, f"operator-{c:03d}"], "hops": 2})
    n_two = questions // 5
    if n_two > len(two) or questions - n_two > len(one):
        raise ConfigError(f"--questions {questions}: {families} service families hold {len(one)} one-document and "
                          f"{len(two)} two-document questions; ask for fewer or add families")
    picked = rng.sample(two, n_two) + rng.sample(one, questions - n_two)
    rng.shuffle(picked)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "corpus.jsonl", "".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in docs.items()))
    return picked


def records_suite(session, facts: list[dict], ks=(8,)) -> dict[int, list[Question]]:
    """The facts as questions per k, each with the k chunks `session`'s retrieval returns for it
    (best first) as its context and its documents' chunks as the ones it needs."""
    from .fidelity import retrieved

    return retrieved(session, {k: [Question(f"k{k}-records-{i:03d}", f["question"], f["truth"], f["docs"], [],
                                            f["hops"]) for i, f in enumerate(facts)] for k in ks})
