"""A small RULER-style task suite over k retrieved chunks, for comparing fusion methods.

Every task is generated with a seed from held-out text (Python's documentation, which no
shipped dictionary was learned on), and every trial is k chunks of ~200 tokens whose
needle chunks are spread among shared filler chunks. The tasks, after "RULER: What's the
Real Context Size of Your Long-Context Language Models?":

- `single`: one 6-digit number for a named key, in one chunk; asks for it.
- `multikey`: three keys in three chunks; asks for one of them (the others distract).
- `multivalue`: one key with three numbers in three chunks; asks for all of them.
- `vartrack`: a chain of `VAR X = VAR Y` assignments (3-5 hops from a number) spread over
  three chunks, with a distractor chain; asks for every variable that holds the number.
- `cwe`: common-words extraction: four chunks are numbered word lists in which three words
  recur; asks for the three most common.

A trial is correct when every expected string is in the answer; `recall` is the mean
fraction found (RULER's own score for the multi-answer tasks). Filler chunks are shared by
all trials and tasks, so only needle chunks are encoded per trial (encoding on 2 CPU cores
runs at ~70 tokens/s).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError, TextError
from ..measure.stats import wilson
from ..measure.suite import chunk_ids_by_doc
from ..query.spec import WRAPPED
from .passkey import ANSWER_PREFIX, KEYS, NEEDLE, QUESTION, filler_passages, insert_sentence

TASKS = ("single", "multikey", "multivalue", "vartrack", "cwe")


@dataclass(frozen=True)
class Trial:
    task: str
    chunk_docs: list[str]  # document ids of the k chunks, in retrieval order
    question: str
    answer_prefix: str
    expected: list[str]  # every one must appear in the answer
    max_new_tokens: int

    def found(self, answer: str) -> list[bool]:
        words = set(re.findall(r"[A-Za-z0-9]+", answer.lower()))
        return [e.lower() in words for e in self.expected]


def check_wrapped(methods: dict[str, dict], wrapped, refuse_unused: bool = False) -> None:
    """ConfigError where a method needs the wrapped store and `wrapped` (a wrapper or its
    session) is None: asked before anything loads, and again where the sessions are chosen.
    With `refuse_unused` (a bench's own options), also where a wrapper is given and no method
    would read the store encoded with it (minutes of encoding for nothing)."""
    uses = any(cfg.get("store") == WRAPPED for cfg in methods.values())
    if wrapped is None and uses:
        raise ConfigError(f"@{WRAPPED} methods need a wrapped store (--wrapper)")
    if refuse_unused and wrapped is not None and not uses:
        raise ConfigError(f"--wrapper encodes the suite a second time for methods ending in @{WRAPPED}, and no "
                          f"method given does: add one (none@{WRAPPED}) or drop --wrapper")


def sessions(session, wrapped, methods: dict[str, dict]) -> dict:
    """Which session answers a method (its `store`: None, the plain store, or WRAPPED)."""
    check_wrapped(methods, wrapped)
    return {None: session, WRAPPED: wrapped}


def query_settings(cfg: dict) -> dict:
    """`Session.query`'s settings in a method's configuration (not which store or context); the
    cheap-context rule off (`prefill_under=0`) unless the configuration sets it, so what a
    benchmark measures is the method it names."""
    return {"prefill_under": 0, **{key: value for key, value in cfg.items() if key not in ("context", "store")}}


# ---------------------------------------------------------------- tasks


class _Builder:
    """Shared filler, a supply of spare filler for needle chunks, and the corpus being written."""

    def __init__(self, tokenizer, k: int, tokens_per_chunk: int, rng: random.Random):
        n_shared = max(2 * k, 16)
        pieces = filler_passages(tokenizer, tokens_per_chunk, None)
        if len(pieces) < n_shared + 3:
            raise TextError(f"not enough held-out text for {n_shared + 3} chunks of {tokens_per_chunk} tokens")
        self.docs = {f"filler-{i:03d}": t for i, t in enumerate(pieces[:n_shared])}
        self.shared = list(self.docs)
        # Needle chunks are the other pieces with a needle inserted. There are fewer pieces
        # than needles (held-out text is ~22K tokens), so trials reuse them in turn: a trial's
        # needles still sit in different texts, none of them a filler of its context.
        self.spare = itertools.cycle(pieces[n_shared:])
        self.k, self.rng = k, rng
        self.vocabulary = _vocabulary(tokenizer, pieces)

    def needle_doc(self, name: str, sentences: list[str]) -> str:
        text = next(self.spare)
        for s in sentences:
            text = insert_sentence(text, s, self.rng)
        self.docs[name] = text
        return name

    def context(self, needles: list[str]) -> list[str]:
        """k document ids: the needles at random ranks among shared filler."""
        slots = self.rng.sample(range(self.k), len(needles))
        others = iter(self.rng.sample(self.shared, self.k - len(needles)))
        needle = iter(needles)
        return [next(needle) if i in slots else next(others) for i in range(self.k)]


def _vocabulary(tokenizer, texts: list[str]) -> list[str]:
    """Real words (from Python's documentation) of 5-9 letters that are one token and that no
    filler text contains, so a list word's count in a context is its count in the lists."""
    from ..text.documents import builtin_documents

    seen = {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}
    words = {w for d in builtin_documents("all") for w in re.findall(r"\b[a-z]{5,9}\b", d.text)} - seen
    return sorted(w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1)


def _number(rng) -> str:
    return str(rng.randint(100000, 999999))


def _single(b: _Builder, t: int, keys: int = 1) -> Trial:
    rng = b.rng
    names = rng.sample(KEYS, keys)
    values = [_number(rng) for _ in names]
    needles = [b.needle_doc(f"single{keys}-{t:03d}-{j}", [NEEDLE.format(key=n, value=v)])
               for j, (n, v) in enumerate(zip(names, values))]
    ask = rng.randrange(keys)
    return Trial("single" if keys == 1 else "multikey", b.context(needles),
                 QUESTION.format(key=names[ask]), ANSWER_PREFIX.format(key=names[ask]), [values[ask]], 12)


def _multivalue(b: _Builder, t: int, values: int = 3) -> Trial:
    rng = b.rng
    key = rng.choice(KEYS)
    vals = [_number(rng) for _ in range(values)]
    needles = [b.needle_doc(f"multivalue-{t:03d}-{j}", [NEEDLE.format(key=key, value=v)]) for j, v in enumerate(vals)]
    return Trial("multivalue", b.context(needles),
                 f"What are all the special magic numbers for {key} mentioned in the provided text?",
                 f"The special magic numbers for {key} mentioned in the provided text are", vals, 24)


def _vartrack(b: _Builder, t: int, chunks: int = 3) -> Trial:
    rng = b.rng
    hops = rng.choice((3, 4, 5))
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(hops + 1 + 3)]
    chain, distractor = names[: hops + 1], names[hops + 1:]
    value, other = _number(rng), _number(rng)

    def statements(vars_, v):
        return [f"VAR {vars_[0]} = {v}."] + [f"VAR {y} = VAR {x}." for x, y in zip(vars_, vars_[1:])]

    # the chain in order across the chunks (one block of consecutive statements per chunk)
    main, dist = statements(chain, value), statements(distractor, other)
    cuts = sorted(rng.sample(range(1, len(main)), chunks - 1))
    groups = [main[a:b] for a, b in zip([0, *cuts], [*cuts, len(main)])]
    needles = [b.needle_doc(f"vartrack-{t:03d}-{j}", [" " + " ".join(g) + " ", " " + dist[j] + " "])
               for j, g in enumerate(groups)]
    return Trial("vartrack", b.context(needles),
                 f"Find all variables that are assigned the value {value} in the text above.",
                 f"According to the chain of variable assignments in the text above, {len(chain)} variables are "
                 f"assigned the value {value}, they are: VAR", chain, 40)


def _cwe(b: _Builder, t: int, chunks: int = 4, common: int = 3, repeats: int = 3, rare: int = 24) -> Trial:
    rng = b.rng
    words = rng.sample(b.vocabulary, common + chunks * rare)
    top, rest = words[:common], words[common:]
    needles = []
    for j in range(chunks):
        items = top * repeats + rest[j * rare : (j + 1) * rare]
        rng.shuffle(items)
        b.docs[name := f"cwe-{t:03d}-{j}"] = "Here is a numbered list of words:\n" + "\n".join(
            f"{i + 1}. {w}" for i, w in enumerate(items)) + "\n"
        needles.append(name)
    return Trial("cwe", b.context(needles),
                 f"What are the {common} most common words in the numbered lists above?",
                 f"Answer: The top {common} words that appear most often in the lists are:", top, 20)


_MAKERS = {"single": _single, "multikey": lambda b, t: _single(b, t, keys=3), "multivalue": _multivalue,
           "vartrack": _vartrack, "cwe": _cwe}


def check_suite(tasks, k: int) -> None:
    """Refuses unknown tasks and a k the tasks cannot be spread over (before any model loads)."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(sorted(unknown))}; choose from {', '.join(TASKS)}")
    if k < 4:
        raise ConfigError("k must be >= 4: the cwe task spreads its lists over four chunks")


def make_suite(tokenizer, out: str | Path, tasks=TASKS, trials: int = 20, k: int = 8, tokens_per_chunk: int = 200,
               seed: int = 0) -> list[Trial]:
    """Write `out`/corpus.jsonl (shared filler + every trial's needle chunks) and
    `out`/trials.json; returns the trials, task by task."""
    check_suite(tasks, k)
    rng = random.Random(seed)
    b = _Builder(tokenizer, k, tokens_per_chunk, rng)
    result = [_MAKERS[task](b, t) for task in tasks for t in range(trials)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as f:
        for doc, text in b.docs.items():
            f.write(json.dumps({"id": doc, "text": text}) + "\n")
    (out / "trials.json").write_text(json.dumps([asdict(r) for r in result], indent=1))
    return result


def load_suite(out: str | Path) -> list[Trial]:
    path = Path(out) / "trials.json"
    if not path.exists():
        raise TextError(f"{path} does not exist (make_suite writes it)")
    return [Trial(**t) for t in json.loads(path.read_text())]


# ---------------------------------------------------------------- running


def run_cell(session, ids: dict[str, str], trials: list[Trial], label: str, cfg: dict) -> dict:
    """Accuracy (± Wilson 95%), recall and mean TTFT of one method on one task's trials
    (`ids`: document id → chunk id in the session's store)."""
    correct, recall, ttft, answers = 0, 0.0, [], []
    for t in trials:
        a = session.query(t.question, chunks=[ids[d] for d in t.chunk_docs], max_new_tokens=t.max_new_tokens,
                          answer_prefix=t.answer_prefix, **query_settings(cfg))
        found = t.found(a.answer)
        correct += all(found)
        recall += sum(found) / len(found)
        ttft.append(a.timings_ms["ttft"])
        answers.append(a.answer)
    n = len(trials)
    return {"task": trials[0].task, "label": label, **cfg, "trials": n, "accuracy": correct / n,
            "interval95": wilson(correct, n), "recall": round(recall / n, 4),
            "ttft_ms": round(sum(ttft) / n, 1), "answers": answers[:3]}


def run_suite(session, trials: list[Trial], methods: dict[str, dict], results: Path | None = None,
              wrapped=None) -> list[dict]:
    """Every method on every task's trials (`@wrapped` ones from the session `wrapped`). With
    `results`, each finished cell is saved at once and cells already there are kept, so an
    interrupted run resumes where it stopped."""
    rows = json.loads(results.read_text())["rows"] if results is not None and results.exists() else []
    done = {(r["task"], r["label"]) for r in rows}
    by_store = sessions(session, wrapped, methods)
    ids = {key: chunk_ids_by_doc(s.store) for key, s in by_store.items() if s is not None}
    by_task: dict[str, list[Trial]] = {}
    for t in trials:
        by_task.setdefault(t.task, []).append(t)
    for task, group in by_task.items():
        for label, cfg in methods.items():
            if (task, label) in done:
                continue
            rows.append(run_cell(by_store[cfg.get("store")], ids[cfg.get("store")], group, label, cfg))
            r = rows[-1]
            print(f"{task:>10} {label:>16}  accuracy {r['accuracy']:.2f} {r['interval95']}  recall {r['recall']:.2f}"
                  f"  ttft {r['ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
            if results is not None:
                write_atomic(results, json.dumps({"rows": rows}, indent=1))
    # in task and method order, whichever cells a resumed run had already
    labels = list(methods)
    return sorted(rows, key=lambda r: (TASKS.index(r["task"]) if r["task"] in TASKS else len(TASKS),
                                       labels.index(r["label"]) if r["label"] in labels else len(labels)))


def plot_suite(rows: list[dict], out) -> None:
    """Accuracy (Wilson 95% bars) against mean TTFT, one panel per task, one point per method;
    hollow markers are recall where a task asks for several answers."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 4.2), squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in rows if r["task"] == task):
            lo, hi = r["interval95"]
            ax.errorbar(r["ttft_ms"], r["accuracy"], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt="o",
                        color=colours[r["label"]], label=r["label"], capsize=3)
            if r["recall"] != r["accuracy"]:
                ax.plot(r["ttft_ms"], r["recall"], "o", mfc="none", color=colours[r["label"]])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{task} ({rows[0]['trials']} trials)")
        ax.set_xlabel("mean TTFT (ms, log)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (hollow: recall)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
