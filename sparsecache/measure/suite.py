"""The fidelity suite's generator: documents about fictional entities (made-up names, so the
model cannot know the answers from training), one document per chunk, and ordinary questions
about them in several phrasings, from pools split into `train` (what learned chunk wrappers
train on), `dev` and `test` (`bench fidelity` says what is scored on them).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError, TextError

SPLITS = ("dev", "test")
TRAIN = "train"  # what learned chunk wrappers train on (`learn-wrapper`): pools shared with neither split
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



def load_suite(out: str | Path) -> dict[int, list[Question]]:
    path = Path(out) / "questions.json"
    if not path.exists():
        raise TextError(f"{path} does not exist (make_suite writes it)")
    return {int(k): [Question(**q) for q in qs] for k, qs in json.loads(path.read_text()).items()}



def chunk_ids_by_doc(store) -> dict[str, str]:
    """doc id → its (single) chunk id in the store."""
    out = {}
    for c in store.chunks():
        if c.ordinal > 0:
            raise ConfigError(f"passkey documents must fit one chunk; {c.doc_id} has several")
        out[c.doc_id] = c.id
    return out

