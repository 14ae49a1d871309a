"""The fidelity suite: does the compressed path give full prefill's answer to ordinary questions?

Needle tasks ask for a planted number; users ask about what their documents say. This suite
generates documents about fictional entities (made-up names, so the model cannot know the
answers from training), one document per chunk, and ordinary questions about them in
several phrasings:

- one fact per question (a year, a count, a name, a place, a weekday, a colour);
- some questions need two chunks: the entity's document names a person, and the person's
  own document holds the fact asked (`hops` = 2);
- each question's context is k chunks as retrieval would give them: the answer's chunk(s)
  at random ranks among other entities' documents;
- two splits, `dev` (every choice is tuned on it) and `test` (measured once, for the final
  table), drawn from disjoint pools: name syllables, given names and question phrasings
  (`split=None` draws from all of them, as the suite did before it had splits).

What is scored, per configuration, each with a 95% interval. The reference is full prefill of
the same chunks in the same order, and the primary figure is fidelity to it (#69):

- `kept`: of the questions full prefill answers right *with confidence* (CONFIDENT_MARGIN,
  stated before anything was measured with it: its answer holds the true value, and at every
  token of that value its chosen token is at least 4x as likely as the runner-up), the share the
  configuration also answers right (Wilson interval);
- `disagreement`: (gains + losses) / n over all questions: right where full prefill is wrong,
  or wrong where it is right (beating full prefill is not fidelity);
- `value_agreement` and `value_kl`: teacher-forced along full prefill's answer, at the tokens of
  the answer's value only, whether the configuration's top-1 token is full prefill's and the KL
  divergence from full prefill's distribution (its top TOP_SUPPORT tokens and the rest as one);
- `holds_hops1` / `holds_hops2`: for a method that drops chunks, how often it kept every chunk
  the answer needs, for one- and two-chunk questions;

and, secondary: `correct` (the true value appears in the answer, full prefill's too);
`correct_vs_full` (its correct answers relative to full prefill's, capped at 1: beyond full
prefill is not the goal); `right_where_full_right` (the share of the questions full prefill gets
right that it gets right too, confident or not);
`token_agreement` (the fraction of full prefill's answer tokens the method's context predicts
when fed that answer, as `query --compare` computes it); `same_answer` (the answers' first
sentences are equal after normalising case, spaces and punctuation; on questions full prefill
gets wrong a small model's answers are unstable, so this one undercounts); mean TTFT.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError, TextError
from .ruler import wilson

# The confidence rule (#69), fixed before any figure was measured with it: full prefill is
# confident of an answer holding the true value when, at every token of that value in its
# answer, its chosen token's log-probability exceeds the runner-up's by at least ln 4.
CONFIDENT_MARGIN = math.log(4)
TOP_SUPPORT = 64  # full prefill's distribution at a value token: its top 64 tokens and the rest lumped

# #69's formats: (a) generated entity documents, (b) timetable records with look-alikes (held out:
# nothing is learned or chosen on it, `records.HELD_OUT`), (c) cloze over real text
FORMATS = ("entities", "records", "cloze")
SPLITS = ("dev", "test")
TRAIN = "train"  # what learned chunk wrappers train on (`learn-wrapper`): pools shared with neither split
SPLIT = "dev"  # what `bench fidelity` measures unless told: the test split is run once, at the end

SYLLABLES = ("bar", "tel", "mon", "kri", "vos", "lan", "dre", "sul", "pim", "gor", "nea", "wyl", "thar", "quen",
             "bel", "rov", "zan", "mir", "dov", "kel", "ost", "ula", "fen", "jor")
GIVEN = ("Ilse", "Tomas", "Maren", "Oskar", "Livia", "Anselm", "Greta", "Pavel", "Noor", "Elio", "Sabine", "Bruno",
         "Katla", "Ruben", "Ines", "Florin", "Dagny", "Matteo", "Yara", "Emil")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "grey", "white")
TRADES = ("a clockmaker", "a ferry pilot", "a botanist", "a glassblower", "a cartographer", "a beekeeper",
          "a violin maker", "a surveyor")

# The train split's own pools and phrasings: a question asks for the kind of value, not the fact
# as either split phrases it (person facts through the entity's role).
TRAIN_SYLLABLES = ("cas", "nor", "vel", "pra", "tun", "hil", "sor", "mab", "lod", "gen", "ery", "fal", "bri",
                   "dun", "esk", "har")
TRAIN_GIVEN = ("Hedda", "Jonas", "Milla", "Aksel", "Runa", "Cyril", "Vera", "Lasse", "Edda", "Nils", "Tove", "Artur")
TRAIN_ASK = {
    "year": ("Which year do the documents give for {n}?", "Name the year the text mentions for {n}."),
    "count": ("What number is given for {n}?", "Which figure does the text state about {n}?"),
    "weekday": ("Which day of the week is mentioned for {n}?",),
    "colour": ("Which colour is mentioned in connection with {n}?",),
    "person": ("Which person is named in connection with {n}?", "Whose name appears in the text about {n}?"),
    "place": ("Which place is named for {n}?", "What town does the text name for {n}?"),
    "trade": ("Which occupation is named for {role}?",),
}

# Each kind: the sentences stating its facts ({n} is the entity's name) and, per fact, the
# phrasings of a question about it (`make_suite` picks one per entity and fact).
KINDS = {
    "town": {
        "intro": "{n} is a small town in the hills of the {region} valley.",
        "facts": {
            "year": ("{n} was founded in {year}.", ("When was {n} founded?", "In what year was the town of {n} founded?",
                                                    "How old is {n}? Give the year it was founded.")),
            "count": ("{n} has {count} bridges over its river.", ("How many bridges does {n} have?",
                                                                  "What is the number of bridges in {n}?")),
            "weekday": ("The market in {n} is held every {weekday}.", ("On which day is the market held in {n}?",
                                                                       "What day of the week is market day in {n}?")),
            "colour": ("Most houses in {n} have {colour} roofs.", ("What colour are the roofs in {n}?",
                                                                   "Which roof colour is typical of {n}?")),
            "person": ("The mayor of {n} is {person}.", ("Who is the mayor of {n}?", "What is the name of {n}'s mayor?")),
        },
    },
    "company": {
        "intro": "{n} is a family business that makes {product}.",
        "facts": {
            "year": ("{n} opened its first workshop in {year}.", ("When did {n} open its first workshop?",
                                                                  "In which year did {n} start?")),
            "count": ("{n} employs {count} people.", ("How many people work at {n}?", "How many employees does {n} have?")),
            "place": ("The headquarters of {n} are in {place}.", ("Where are the headquarters of {n}?",
                                                                  "In which town is {n} based?")),
            "weekday": ("{n} is closed every {weekday}.", ("On which day is {n} closed?",
                                                           "What day of the week does {n} not open?")),
            "person": ("{n} was founded by {person}.", ("Who founded {n}?", "What is the name of the founder of {n}?")),
        },
    },
    "ship": {
        "intro": "The {n} is a wooden sailing ship that carries {product} along the coast.",
        "facts": {
            "year": ("The {n} was launched in {year}.", ("When was the {n} launched?", "In what year was the {n} launched?")),
            "count": ("The {n} has a crew of {count}.", ("How many sailors are in the crew of the {n}?",
                                                          "How large is the crew of the {n}?")),
            "place": ("The home port of the {n} is {place}.", ("What is the home port of the {n}?",
                                                               "Where is the {n} based?")),
            "colour": ("The hull of the {n} is painted {colour}.", ("What colour is the hull of the {n}?",
                                                                     "Which colour is the {n} painted?")),
            "person": ("The captain of the {n} is {person}.", ("Who is the captain of the {n}?",
                                                               "Who commands the {n}?")),
        },
    },
}
PRODUCTS = ("barrels", "lanterns", "rope", "salt", "wool blankets", "clay pots", "maps", "candles")
# What a person's own document says, and how a two-chunk question asks it (through the entity).
PERSON_FACTS = {
    "year": ("{p} was born in {year}.", ("In what year was {role} born?", "What year was {role} born in?")),
    "place": ("{p} grew up in {place}.", ("Where did {role} grow up?", "In which town did {role} spend their childhood?")),
    "trade": ("Before that, {p} worked as {trade}.", ("What did {role} work as before?",
                                                      "What was the earlier trade of {role}?")),
}
ROLES = {"town": "the mayor of {n}", "company": "the founder of {n}", "ship": "the captain of the {n}"}
# Sentences that say nothing a question asks, so a document has a realistic length.
FILLER = (
    "Visitors often remark on how quiet {n} is in the early morning.",
    "Much of what is known about {n} comes from letters kept in a regional archive.",
    "Over the years {n} has changed less than its neighbours.",
    "A short guide to {n} was printed some decades ago and is now hard to find.",
    "People who know {n} well say that its character comes from its history.",
    "There are several stories about {n}, not all of them reliable.",
    "In winter the roads around {n} are sometimes closed by snow.",
    "Local newspapers have written about {n} on many occasions.",
    "The records of {n} were carefully copied by hand before being stored.",
    "Travellers who pass through {n} rarely stay for long, but many come back.",
    "Some of the older residents remember when things were done differently in {n}.",
    "Photographs of {n} from the last century show much the same scene as today.",
    "A few paintings of {n} hang in the houses of people who once lived there.",
    "Some say the name {n} is older than anything else about the place.",
    "Letters sent from {n} usually mention the weather before anything else.",
    "The path that leads to {n} is lined with old stone walls.",
    "Nobody agrees on the best season to see {n}.",
    "Children who grow up around {n} learn its stories early.",
    "There is a small museum nearby with a room about {n}.",
    "More than one book mentions {n} in passing.",
)

PERSON_FILLER = (
    "Friends of {n} describe a patient and careful person.",
    "Several letters written by {n} survive in a family collection.",
    "{n} rarely spoke about the early years.",
    "Neighbours remember {n} walking the same route every evening.",
    "A portrait of {n} hangs in a small local gallery.",
    "{n} kept detailed notebooks, most of which are now lost.",
    "Many stories about {n} were told long after the events they describe.",
    "Those who worked with {n} remember long days and few complaints.",
    "{n} was known for a dry sense of humour.",
    "In later years {n} received many visitors.",
    "Some of the furniture {n} owned is still in use.",
    "{n} travelled less than most people expected.",
    "A street was once going to be named after {n}, but the plan was dropped.",
    "Relatives say {n} could recite long poems from memory.",
)


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    truth: str  # the value; an answer is correct when it contains it
    docs: list[str]  # the document(s) the answer needs
    chunk_docs: list[str]  # the k documents of its context, in retrieval order
    hops: int
    # a suite over a store's own chunks (`cloze`): the context's chunk ids and those the answer
    # needs, given directly (None: one chunk per document, found by document id)
    chunks: list[str] | None = None
    needed: list[str] | None = None
    answer_prefix: str | None = None  # the start of the answer, given (a `continue` cloze question: `cloze`)


@dataclass(frozen=True)
class Pools:
    """What a split draws from: `dev` and `test` share no name syllable, given name or
    question phrasing, and `train` (learned wrappers' prompts) shares none with either
    (`split=None`: everything, the suite before splits)."""

    syllables: tuple[str, ...]
    given: tuple[str, ...]
    part: int | None  # the phrasings of a fact a split asks with: every other one, from this index (-1: TRAIN_ASK)
    taken: set | None = None  # names given so far (a split's names are unique; None: as before splits)

    @classmethod
    def of(cls, split: str | None) -> "Pools":
        if split is None:
            return cls(SYLLABLES, GIVEN, None)
        if split not in SPLITS + (TRAIN,):
            raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if split == TRAIN:
            return cls(TRAIN_SYLLABLES, TRAIN_GIVEN, -1, set())
        i = SPLITS.index(split)
        return cls(SYLLABLES[i::2], GIVEN[i::2], i, set())

    def phrasings(self, options: tuple[str, ...], fact: str = "", person: bool = False) -> tuple[str, ...]:
        if self.part == -1:  # train: by the kind of value (a person fact about the role, not the entity)
            asks = TRAIN_ASK[fact]
            return tuple(a.replace("{n}", "{role}") for a in asks) if person else asks
        return options if self.part is None else options[self.part::2]

    def name(self, rng: random.Random) -> str:
        while True:
            name = "".join(rng.sample(self.syllables, rng.choice((2, 3)))).capitalize()
            if self.taken is None or name not in self.taken:
                break
        if self.taken is not None:
            self.taken.add(name)
        return name

    def person(self, rng: random.Random) -> str:
        return f"{rng.choice(self.given)} {self.name(rng)}"


def _values(rng: random.Random, places: list[str], pools: Pools) -> dict:
    return {"year": str(rng.randint(1650, 1950)), "count": str(rng.randint(3, 60)), "weekday": rng.choice(WEEKDAYS),
            "colour": rng.choice(COLOURS), "place": rng.choice(places), "region": pools.name(rng),
            "product": rng.choice(PRODUCTS), "trade": rng.choice(TRADES)}


def _document(rng: random.Random, sentences: list[str], n: str, filler: int, pool=FILLER) -> str:
    """The fact sentences in order with `filler` sentences of `pool` between them, in paragraphs."""
    body = list(sentences[1:])
    for s in rng.sample(pool, min(filler, len(pool))):
        body.insert(rng.randint(0, len(body)), s.format(n=n))
    paragraphs = [body[i:i + 4] for i in range(0, len(body), 4)]
    return sentences[0] + " " + "\n\n".join(" ".join(p) for p in paragraphs) + "\n"


ENTITIES = 40  # documents about entities (and as many about their people): ~250 questions at most


NAMES_PER_ENTITY = 4  # an entity's name and region, its person's surname and region (`make_suite`)
PLACES = 12  # place names a suite draws before its entities'


def check_suite(ks, questions: int, entities: int = ENTITIES, split: str | None = None) -> None:
    """Refuses settings the suite cannot be made with (before any model loads)."""
    if not ks or min(ks) < 2:
        raise ConfigError("k must be >= 2: a context holds the answer's chunk and others")
    if entities < max(ks) + 2:
        raise ConfigError(f"--entities must be at least max(k) + 2 = {max(ks) + 2}")
    n = len(Pools.of(split).syllables)
    names = n * (n - 1) + n * (n - 1) * (n - 2)  # two or three distinct syllables
    if split is not None and NAMES_PER_ENTITY * entities + PLACES > 0.9 * names:  # a split's names are unique
        raise ConfigError(f"--entities {entities}: the {split} split's {n} syllables make {names} names, too few for "
                          f"{NAMES_PER_ENTITY} unique names per entity; use at most "
                          f"{int((0.9 * names - PLACES) // NAMES_PER_ENTITY)}")
    kinds = list(KINDS)
    one = sum(len(KINDS[kinds[e % len(kinds)]]["facts"]) for e in range(entities))
    two = entities * len(PERSON_FACTS)
    if questions < 1:
        raise ConfigError(f"--questions must be at least 1, got {questions}")
    if questions // 5 > two or questions - questions // 5 > one:
        raise ConfigError(f"--questions {questions}: {entities} entities hold {one} one-hop and {two} two-hop "
                          "questions, and a fifth must be two-hop; ask for fewer or add entities")


FILLER_SENTENCES = 14  # per document: ~300 tokens, k = 8 ~2,400 (beyond SmolLM2's 2,048 positions)


def make_suite(out: str | Path, ks=(4, 8), questions: int = 100, entities: int = ENTITIES, filler: int = FILLER_SENTENCES,
               seed: int = 0, split: str | None = None) -> dict[int, list[Question]]:
    """Write `out`/corpus.jsonl (one document per entity and per person) and
    `out`/questions.json; returns `questions` questions for each k, a fifth of them two-hop,
    drawn from `split`'s pools (`Pools.of`)."""
    check_suite(ks, questions, entities, split)
    pools = Pools.of(split)
    rng = random.Random(seed if split is None else f"{seed}-{split}")
    places = [pools.name(rng) for _ in range(PLACES)]
    docs, facts = {}, []  # facts: (doc ids needed, question, truth, hops)
    kinds = list(KINDS)
    for e in range(entities):
        kind = kinds[e % len(kinds)]
        spec, n, v = KINDS[kind], pools.name(rng), _values(rng, places, pools)
        v["person"] = person = pools.person(rng)
        doc = f"{kind}-{e:03d}"
        sentences = [spec["intro"].format(n=n, **v)]
        for fact, (sentence, phrasings) in spec["facts"].items():
            sentences.append(sentence.format(n=n, **v))
            facts.append(([doc], rng.choice(pools.phrasings(phrasings, fact)).format(n=n), v[fact], 1))
        docs[doc] = _document(rng, sentences, n, filler)
        pdoc, pv = f"person-{e:03d}", _values(rng, places, pools)
        psentences = [f"{person} is remembered in {v['region']} for a long life of work."]
        for fact, (sentence, asked) in PERSON_FACTS.items():
            psentences.append(sentence.format(p=person, **pv))
            asked = rng.choice(pools.phrasings(asked, fact, person=True)) if split is not None else asked[0]
            facts.append(([doc, pdoc], asked.format(role=ROLES[kind].format(n=n)), pv[fact].removeprefix("a "), 2))
        docs[pdoc] = _document(rng, psentences, person, filler, PERSON_FILLER)
    one = [f for f in facts if f[3] == 1]
    two = [f for f in facts if f[3] == 2]
    suite = {}
    for k in ks:
        n_two = questions // 5
        picked = rng.sample(two, n_two) + rng.sample(one, questions - n_two)
        rng.shuffle(picked)
        suite[k] = [Question(f"k{k}-{i:03d}", q, truth, need, _context(rng, need, list(docs), k), hops)
                    for i, (need, q, truth, hops) in enumerate(picked)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "corpus.jsonl", "".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in docs.items()))
    save_suite(out, suite)
    return suite


def _context(rng: random.Random, need: list[str], docs: list[str], k: int) -> list[str]:
    """k document ids: those the answer needs at random ranks, the rest other documents."""
    entity = {n.split("-")[1] for n in need}  # no other document of the same entity (or person)
    others = rng.sample([d for d in docs if d.split("-")[1] not in entity], k - len(need))
    slots = sorted(rng.sample(range(k), len(need)))
    out, it_need, it_other = [], iter(need), iter(others)
    for i in range(k):
        out.append(next(it_need) if i in slots else next(it_other))
    return out


def save_suite(out: str | Path, suite: dict[int, list[Question]]) -> None:
    """`out`/questions.json (fields left None are not written: older suites' files stay the same)."""
    write_atomic(Path(out) / "questions.json", json.dumps(
        {str(k): [{f: v for f, v in asdict(q).items() if v is not None} for q in qs] for k, qs in suite.items()},
        indent=1))


def retrieved(session, suite: dict[int, list[Question]]) -> dict[int, list[Question]]:
    """The suite with each question's context replaced by the k chunks `session`'s retrieval
    returns for it, best first (#69: distractors chosen by the store's own retrieval from the
    whole pool, look-alikes included), and its documents' chunks as the ones it needs. A
    question whose document retrieval misses is one full prefill cannot answer either."""
    from dataclasses import replace

    from .passkey import chunk_ids_by_doc

    ids = chunk_ids_by_doc(session.store)
    return {k: [replace(q, chunk_docs=[], chunks=[h["id"] for h in session.retrieve(q.question, k)],
                        needed=[ids[d] for d in q.docs]) for q in qs] for k, qs in suite.items()}


def load_suite(out: str | Path) -> dict[int, list[Question]]:
    path = Path(out) / "questions.json"
    if not path.exists():
        raise TextError(f"{path} does not exist (make_suite writes it)")
    return {int(k): [Question(**q) for q in qs] for k, qs in json.loads(path.read_text()).items()}


# ---------------------------------------------------------------- scoring


def answer_span(text: str) -> str:
    """The answer's first sentence, lower-cased, punctuation and repeated spaces removed:
    what `same_answer` compares (two answers that differ after it still agree)."""
    return _words(re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0])


def contains(answer: str, truth: str) -> bool:
    """The true value appears in the answer as whole words."""
    return f" {_words(truth)} " in f" {_words(answer)} "


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


# ---------------------------------------------------------------- value tokens


def value_positions(tokenizer, tokens: list[int], truth: str) -> list[int]:
    """The positions of `tokens` (an answer) whose text overlaps the first whole-word occurrence
    of `truth` in it (case-insensitive); [] when the answer does not contain it."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    found = re.search(r"(?<![A-Za-z0-9])" + re.escape(truth) + r"(?![A-Za-z0-9])", text, re.I)
    if found is None:
        return []
    ends = [len(tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)) for i in range(len(tokens))]
    starts = [0] + ends[:-1]
    return [i for i, (a, b) in enumerate(zip(starts, ends)) if a < found.end() and b > found.start()]


def value_reference(logprobs, tokens: list[int], positions: list[int]) -> dict:
    """What full prefill's row keeps of its answer's value tokens: their positions, the smallest
    margin of the chosen token over the runner-up (log-probabilities [len(tokens), vocab]
    `logprobs` of its own steps), and at each position its top TOP_SUPPORT (ids, log-probs)."""
    import torch

    if not positions:
        return {"value_positions": [], "margin": None}
    lp = logprobs[positions]  # (P, V)
    top2 = lp.topk(2, -1).values
    support = lp.topk(TOP_SUPPORT, -1)
    assert all(int(lp[i].argmax()) == tokens[p] for i, p in enumerate(positions)), "not its own greedy tokens"
    return {"value_positions": positions, "margin": round(float((top2[:, 0] - top2[:, 1]).min()), 4),
            "value_support": [[ids.tolist(), [round(x, 5) for x in vals.tolist()]]
                              for ids, vals in zip(support.indices, support.values.to(torch.float64))]}


def value_figures(ref: dict, reference_logprobs) -> dict:
    """A configuration's agreement with full prefill's row `ref` at its value tokens, from its
    log-probabilities along full prefill's answer: the share of them where its top-1 token is full
    prefill's, and the mean KL(full || it) over full prefill's top tokens with the rest as one."""
    positions = ref.get("value_positions") or []
    if not positions:
        return {}
    agree, kls = 0, []
    for pos, (ids, ref_lp) in zip(positions, ref["value_support"]):
        q = reference_logprobs[pos].double()
        agree += int(q.argmax()) == ref["tokens"][pos]
        p_top = [math.exp(x) for x in ref_lp]
        q_top = q[ids].exp().tolist()
        p_rest, q_rest = max(0.0, 1 - sum(p_top)), max(1e-12, 1 - sum(q_top))
        kl = sum(p * (lp - math.log(max(qq, 1e-30))) for p, lp, qq in zip(p_top, ref_lp, q_top) if p > 0)
        kls.append(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0))
    return {"value_agreement": round(agree / len(positions), 4), "value_kl": round(sum(kls) / len(kls), 5)}


# ---------------------------------------------------------------- running


# A configuration's `context`: "gold" answers from the chunks the answer needs alone (full
# prefill of them): the ceiling of any method that picks chunks.
GOLD = {"method": "full", "context": "gold"}


def parse_configs(spec: str) -> dict[str, dict]:
    """`ruler.parse_methods`, with the label `gold` too."""
    from .ruler import parse_methods

    return parse_methods(spec, {"gold": GOLD})


def run_fidelity(session, suite: dict[int, list[Question]], methods: dict[str, dict], results: Path | None = None,
                 max_new_tokens: int = 24, wrapped=None, confident_only: bool = False) -> list[dict]:
    """Every method on every question of every k, after full prefill's answer to it (with
    `confident_only`, only on the questions full prefill answers with confidence: what `kept`
    and the value-token figures read, at a fraction of the cost; the other figures then describe
    those questions only).

    One row per (k, method, question); with `results`, every row is saved as it is made and a
    rerun skips rows already there, so an interrupted run resumes where it stopped. A row says
    whether the context the method answered from still held the chunks the answer needs
    (`holds_answer`: a method may drop chunks). Methods marked `store: wrapped` answer from the
    session `wrapped` (the same corpus encoded with a learned wrapper)."""
    from .passkey import chunk_ids_by_doc
    from .ruler import query_settings, sessions

    by_store = sessions(session, wrapped, methods)
    ids_of: dict = {}

    def chunk_ids(key, q: Question) -> tuple[list[str], list[str]]:
        """The question's context and needed chunk ids in the store `key`."""
        if q.chunks is not None:
            return q.chunks, q.needed
        if key not in ids_of:
            ids_of[key] = chunk_ids_by_doc(by_store[key].store)
        return [ids_of[key][d] for d in q.chunk_docs], [ids_of[key][d] for d in q.docs]

    rows = json.loads(results.read_text())["rows"] if results is not None and results.exists() else []
    if any(r["label"] == "full" and "confident" not in r for r in rows):
        raise ConfigError(f"{results} was made before full prefill's confidence was recorded (#69): "
                          "measure in a new --workdir")
    done = {(r["k"], r["label"], r["question"]) for r in rows}
    refs = {(r["k"], r["question"]): r for r in rows if r["label"] == "full"}
    for k, questions in suite.items():
        for label, cfg in {"full": {"method": "full"}, **methods}.items():
            query = query_settings(cfg)
            ask = by_store[cfg.get("store")]
            for q in questions:
                if (k, label, q.id) in done:
                    continue
                if confident_only and label != "full" and not refs[(k, q.id)]["confident"]:
                    continue
                context, needed = chunk_ids(cfg.get("store"), q)
                chunks = [c for c in context if cfg.get("context") != "gold" or c in needed]
                ref = refs.get((k, q.id))
                a = ask.query(q.question, chunks=chunks, max_new_tokens=max_new_tokens, logprobs=True,
                              answer_prefix=q.answer_prefix or "",
                              reference=None if ref is None else ref["tokens"], **query)
                row = {"k": k, "label": label, **cfg, "question": q.id, "hops": q.hops, "answer": a.answer,
                       "tokens": a.tokens, "correct": contains(a.answer, q.truth), "ttft_ms": a.timings_ms["ttft"],
                       "context_tokens": a.context_tokens, "recomputed_tokens": a.recomputed_tokens,
                       # retrieval's context held the chunks the answer needs; the method kept those it held
                       # (a chunk retrieval missed is no method's loss) and left out `dropped` of the context's
                       "retrieved_answer": set(needed) <= set(chunks),
                       "holds_answer": set(needed) & set(chunks) <= set(a.context_ids),
                       "dropped": len(set(chunks) - set(a.context_ids))}
                if ref is None:
                    positions = value_positions(ask.model.tokenizer, a.tokens, q.truth) if row["correct"] else []
                    row |= value_reference(a.logprobs, a.tokens, positions)
                    row["confident"] = row["correct"] and row["margin"] is not None and \
                        row["margin"] >= CONFIDENT_MARGIN
                    refs[(k, q.id)] = row
                else:
                    row |= {"same_answer": answer_span(a.answer) == answer_span(ref["answer"]),
                            "token_agreement": a.agreement, "full_correct": ref["correct"],
                            "full_confident": bool(ref.get("confident")),
                            **value_figures(ref, a.reference_logprobs)}
                rows.append(row)
                if results is not None:
                    write_atomic(results, json.dumps({"rows": rows}))
            print(line(k, label, summarise([r for r in rows if r["k"] == k and r["label"] == label])),
                  file=sys.stderr, flush=True)
    return rows


def line(k: int, label: str, s: dict) -> str:
    """One configuration's summary in a line (`-` where full prefill's own row has no figure)."""
    def f(key, spec=".2f"):
        return format(s[key], spec) if key in s else "-"
    return (f"k={k} {label:>24}  kept {f('kept')} {s.get('kept_ci95', '')} of {s.get('confident', '-')}  "
            f"disagree {f('disagreement')}  value tokens {f('value_agreement', '.3f')} kl {f('value_kl', '.3f')}  "
            f"correct vs full {f('correct_vs_full')}  same {f('same_answer')}  correct {s['correct']:.2f}  "
            f"ttft {s['ttft_ms']:.0f} ms")


BOOTSTRAP = 2000  # resamples of the questions for the intervals of ratios and means


def summarise(rows: list[dict], full: dict[str, dict] | None = None) -> dict:
    """One configuration's figures, each with a 95% interval (Wilson for shares, a paired
    bootstrap over the questions for ratios and means): correct; against full prefill's rows
    by question (`full`, else each row's `full_correct` and `full_confident`): kept (right
    where full prefill is confidently right), disagreement, the value tokens' agreement and KL,
    correct relative to full prefill's (capped at 1) and right where full prefill is right;
    agreement with full prefill's answer (same first sentence, token agreement); mean TTFT; by
    hops; how often the context held the answer's chunks, by hops, where a method dropped some."""
    n = len(rows)
    correct = [bool(r["correct"]) for r in rows]
    out = {"questions": n, "correct": sum(correct) / n, "correct_ci95": wilson(sum(correct), n),
           "ttft_ms": round(sum(r["ttft_ms"] for r in rows) / n, 1)}
    for hops in (1, 2):
        part = [r for r in rows if r["hops"] == hops]
        if part:
            out[f"correct_hops{hops}"] = round(sum(bool(r["correct"]) for r in part) / len(part), 4)
    if "same_answer" not in rows[0]:
        return out
    ref = [bool(full[r["question"]]["correct"]) if full is not None else bool(r["full_correct"]) for r in rows]
    sure = [bool(full[r["question"]].get("confident")) if full is not None else bool(r.get("full_confident"))
            for r in rows]
    if any(sure):
        kept = sum(c for c, s in zip(correct, sure) if s)
        out |= {"confident": sum(sure), "kept": round(kept / sum(sure), 4), "kept_ci95": wilson(kept, sum(sure))}
    out["disagreement"] = round(sum(c != f for c, f in zip(correct, ref)) / n, 4)
    out |= summarise_values([r for r, s in zip(rows, sure) if s])
    same = sum(r["same_answer"] for r in rows)
    agreement = [r["token_agreement"] for r in rows]
    out |= {"same_answer": same / n, "same_answer_ci95": wilson(same, n),
            "token_agreement": round(sum(agreement) / n, 4), "token_agreement_ci95": _bootstrap(agreement, _mean)}
    if any(ref):
        both = sum(c and f for c, f in zip(correct, ref))
        out |= {"correct_vs_full": round(min(1.0, sum(correct) / sum(ref)), 4),
                "correct_vs_full_ci95": tuple(min(1.0, x) for x in _bootstrap(list(zip(correct, ref)), _ratio)),
                "right_where_full_right": round(both / sum(ref), 4),
                "right_where_full_right_ci95": wilson(both, sum(ref)), "full_correct": sum(ref) / n}
    held = [r.get("holds_answer", True) for r in rows]
    if any(r.get("dropped", 0) for r in rows) or not all(held):  # a method that leaves chunks out
        out["drops_chunks"] = True
        out["holds_answer"] = round(sum(held) / n, 4)
        for hops in (1, 2):  # over the questions whose retrieved context held what the answer needs
            part = [r.get("holds_answer", True) for r in rows if r["hops"] == hops and r.get("retrieved_answer", True)]
            out[f"holds_hops{hops}_n"] = len(part)
            if part:
                out[f"holds_hops{hops}"] = round(sum(part) / len(part), 4)
    for hops in (1, 2):
        part = [r for r in rows if r["hops"] == hops]
        if part:
            out[f"same_answer_hops{hops}"] = round(sum(r["same_answer"] for r in part) / len(part), 4)
    return out


def summarise_values(rows: list[dict]) -> dict:
    """The value tokens' agreement with full prefill (mean, bootstrap 95% interval) and mean KL
    over the rows that have them ({} where none does)."""
    valued = [r for r in rows if "value_agreement" in r]
    if not valued:
        return {}
    agree = [r["value_agreement"] for r in valued]
    return {"value_agreement": round(_mean(agree), 4), "value_agreement_ci95": _bootstrap(agree, _mean),
            "value_kl": round(_mean([r["value_kl"] for r in valued]), 4)}


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _ratio(pairs) -> float:
    den = sum(f for _, f in pairs)
    return sum(c for c, _ in pairs) / den if den else float("nan")


def _bootstrap(items: list, statistic, resamples: int = BOOTSTRAP) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of `statistic` over resamples of `items` (seeded: the
    same rows give the same interval)."""
    rng = random.Random(0)
    stats = sorted(s for s in (statistic(rng.choices(items, k=len(items))) for _ in range(resamples)) if s == s)
    if not stats:
        return (float("nan"), float("nan"))
    return round(stats[int(0.025 * (len(stats) - 1))], 3), round(stats[int(0.975 * (len(stats) - 1))], 3)


def table(rows: list[dict]) -> list[dict]:
    """`summarise` of every (k, label) in the order the rows were made, each against full
    prefill's rows of the same k."""
    keys = list(dict.fromkeys((r["k"], r["label"]) for r in rows))
    full = {k: {r["question"]: r for r in rows if r["k"] == k and r["label"] == "full"} for k, _ in keys}
    return [{"k": k, "label": label, **summarise([r for r in rows if r["k"] == k and r["label"] == label],
                                                 full[k] or None)}
            for k, label in keys]


def by_context_length(rows: list[dict], k: int, bins: int = 4) -> list[dict]:
    """Full prefill's accuracy at k by context length: its questions in `bins` equal groups by
    context tokens, each with its token range, accuracy and share confident."""
    full = sorted((r for r in rows if r["k"] == k and r["label"] == "full"), key=lambda r: r["context_tokens"])
    out = []
    for i in range(bins):
        part = full[i * len(full) // bins:(i + 1) * len(full) // bins]
        if part:
            out.append({"k": k, "tokens": [part[0]["context_tokens"], part[-1]["context_tokens"]], "questions": len(part),
                        "correct": round(sum(bool(r["correct"]) for r in part) / len(part), 4),
                        "confident": round(sum(bool(r.get("confident")) for r in part) / len(part), 4)})
    return out


# The rules a default is chosen by, stated before they are applied: the keys compared, in order
# (a key "-x" prefers the lower x). #69's, `kept`: the highest lower bound of kept, then the
# value tokens' agreement, then the lower TTFT; a method that drops chunks is eligible only if it
# kept every needed chunk on >= 99% of one-chunk and >= 95% of two-chunk questions.
RULES = {"same_answer": ("same_answer", "token_agreement"),  # #34's (2026-11-26)
         "correct_vs_full": ("correct_vs_full", "right_where_full_right"),  # #51's (rewarded beating full prefill)
         "kept": ("kept_low", "value_agreement", "-ttft_ms")}  # #69's
RULE = "kept"
HOLDS = {1: 0.99, 2: 0.95}  # #69: the needed chunks a chunk-dropping method must keep, by hops


def pick_default(agreement: list[dict], ttft: list[dict], k: int = 8, budget: float = 0.5, rule: str = RULE) -> dict:
    """A default chosen by `rule` (RULES): among the configurations whose mean TTFT at k is at
    most `budget` of full prefill's (both from `ttft`, one run), the one highest by the rule's
    keys (from `agreement`; both are `table` rows, possibly from different runs). Returns the
    merged rows (agreement, TTFT, its ratio to full prefill's, whether it is within the
    budget) and the chosen label."""
    times = {r["label"]: r["ttft_ms"] for r in ttft if r["k"] == k}
    if "full" not in times:
        raise ValueError(f"no full-prefill TTFT at k={k}")
    rows = []
    for r in agreement:
        if r["k"] != k or r["label"] == "full" or r["label"] not in times:
            continue
        ratio = times[r["label"]] / times["full"]
        # a method that leaves chunks out must be seen keeping the needed ones on both kinds of question
        holds = not r.get("drops_chunks") or all(r.get(f"holds_hops{h}_n", 1) > 0 and r.get(f"holds_hops{h}", 1.0)
                                                  >= share for h, share in HOLDS.items())
        rows.append({**r, "ttft_ms": times[r["label"]], "ttft_vs_full": round(ratio, 3),
                     "kept_low": r.get("kept_ci95", (0.0, 0.0))[0], "keeps_chunks": holds,
                     "within": ratio <= budget and (holds or rule != "kept")})
    eligible = [r for r in rows if r["within"]]
    keys = RULES[rule]
    chosen = max(eligible, key=lambda r: tuple(-r[key[1:]] if key.startswith("-") else r.get(key, 0.0)
                                               for key in keys))["label"] if eligible else None
    return {"k": k, "budget": budget, "rule": rule, "full_ttft_ms": times["full"], "chosen": chosen, "rows": rows}


def plot_frontier(picked: dict, out, title: str = "") -> None:
    """#69's frontier: each configuration's kept (95% interval) against its TTFT as a fraction of
    full prefill's, full prefill at (1, 1), the TTFT budget as a line and the chosen one circled
    (`picked`: `pick_default`'s result; hollow markers: not eligible, e.g. dropping needed chunks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    ax.axvline(picked["budget"], color="grey", ls="--", lw=1, label=f"TTFT budget ({picked['budget']:g}x)")
    ax.plot([1.0], [1.0], "ks", label="full prefill")
    for i, r in enumerate(sorted(picked["rows"], key=lambda r: r["ttft_vs_full"])):
        if "kept" not in r:
            continue
        lo, hi = r["kept_ci95"]
        colour = f"C{i % 10}"
        ax.errorbar(r["ttft_vs_full"], r["kept"], yerr=[[r["kept"] - lo], [hi - r["kept"]]], fmt="o", capsize=3,
                    color=colour, mfc=colour if r["within"] else "none", label=r["label"])
        if r["label"] == picked["chosen"]:
            ax.plot(r["ttft_vs_full"], r["kept"], "o", ms=16, mfc="none", mec="black")
    ax.set_xlabel("mean TTFT / full prefill's")
    ax.set_ylabel("kept: full prefill's confident right answers kept")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title or f"k = {picked['k']}: kept against TTFT (rule {picked['rule']}, chosen: {picked['chosen']})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
