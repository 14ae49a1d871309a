"""The generated question suites' runs: `bench fidelity` and `bench ruler` over a suite encoded
once into a workdir (plain, and wrapped beside it), each a dict of plain numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..codec.dictionary import Dictionary
from ..durable import write_atomic
from ..errors import ConfigError
from ..measure.cloze import CLOZE_CHUNK_TOKENS, CLOZE_CORPUS
from ..measure.machine import cpu_model
from ..measure.suite import ENTITIES, FILLER_SENTENCES
from .fidelity import FORMATS


@dataclass(frozen=True)
class Shard:
    """One of `count` disjoint shards of a fidelity suite's questions: those whose index is `index` modulo
    `count`, answered question by question (full prefill, then every method, before the next question),
    so that a run cut short (a GPU lease running out) leaves complete rows for a prefix of its questions.
    Shards run as parallel processes over one workdir; each writes results-I-of-N.json, continued only with
    `resume`; `seeds`: result files whose rows for the shard's questions count as done. A later run without
    a shard merges every shard's rows into results.json and reports them."""

    index: int
    count: int
    resume: bool = False
    seeds: tuple[str, ...] = field(default=())

    @classmethod
    def parse(cls, text: str, resume: bool = False, seeds=()) -> "Shard":
        """"I/N" (0 <= I < N)."""
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise ConfigError(f"--shard must be I/N, got {text!r}") from None
        if not 0 <= i < n:
            raise ConfigError(f"--shard I/N needs 0 <= I < N, got {text!r}")
        return cls(i, n, resume, tuple(str(s) for s in seeds))

    def results(self, work: Path) -> Path:
        return work / f"results-{self.index}-of-{self.count}.json"

    def questions(self, qs: list) -> list:
        return qs[self.index::self.count]


def bench_ruler(workdir, tasks, trials: int = 20, k: int = 8, tokens_per_chunk: int = 200, methods=None,
                device="cpu", model_path: str = "default", dictionary: str | None = None,
                wrapper: str | None = None) -> dict:
    """Accuracy (± Wilson 95%), recall and mean TTFT of every method on every task of the
    RULER-style suite (`ruler.py`), same trials, default store configuration; the model's
    shipped dictionary unless `dictionary` names one.

    The suite and its store are made once per workdir (the store encodes incrementally, so a
    killed encode resumes); every finished (task, method) cell is saved to results.json at
    once, and a rerun skips the cells already there. With `wrapper`, methods ending in `@wrapped`
    answer from the suite encoded with it (`wrapped_session`)."""
    from pathlib import Path

    from ..query.spec import METHODS
    from .ruler import check_suite, check_wrapped, load_suite, make_suite, run_suite

    check_suite(tasks, k)
    check_wrapped(methods or METHODS, wrapper, refuse_unused=True)
    work = Path(workdir)
    settings = {"tasks": list(tasks), "trials": trials, "k": k, "tokens_per_chunk": tokens_per_chunk,
                **_model_settings(model_path, dictionary)}
    session = _suite_session(work, settings, lambda model: make_suite(model.tokenizer, work, tasks, trials, k,
                                                                      tokens_per_chunk), device)
    wrapped = wrapped_session(work, session, wrapper, device) if wrapper else None
    rows = run_suite(session, load_suite(work), methods or METHODS, work / "results.json", wrapped)
    return {"device": str(device), "cpu": cpu_model(), **settings,
            **({"wrapper": wrapped.store.config.wrapper} if wrapped else {}), "rows": rows}


def bench_fidelity(workdir, ks=(4, 8), questions: int = 100, methods=None, device="cpu", limit: int | None = None,
                   model_path: str = "default", dictionary: str | None = None, split: str | None = None,
                   wrapper: str | None = None, filler: int = FILLER_SENTENCES, entities: int = ENTITIES,
                   format: str = "entities", corpus: str = CLOZE_CORPUS, chunk_tokens: int = CLOZE_CHUNK_TOKENS,
                   confident_only: bool = False, two_chunk: str | None = None, shard: Shard | None = None) -> dict:
    """Accuracy, accuracy relative to full prefill's, agreement with its answers and mean TTFT
    of every method on the fidelity suite (`fidelity.py`): ordinary questions about generated
    documents, k chunks; `split` (dev or test) draws them from that split's pools (None: the
    suite as it was before splits).

    Made once per workdir like `bench_ruler` (suite, store); every answer is saved to
    results.json as it is made, and a rerun resumes there. With `wrapper` (a `learn-wrapper`
    directory or 'shipped') the suite is also encoded with it (store-wrapped), which methods
    ending in `@wrapped` answer from. `filler` sentences per document set the context's length:
    fewer, shorter contexts (#69: measure where full prefill is reliable for the model); more
    `entities` hold more questions. `format` "cloze" asks instead for spans blanked out of the
    sentences of `corpus` (`cloze.py`), encoded in chunks of `chunk_tokens`, with retrieval's
    chunks as each question's context. With `shard`, only that shard's questions, question by question
    (`Shard`); without, every shard's rows found in the workdir join results.json first."""
    import json
    from pathlib import Path

    from ..measure.suite import check_suite, load_suite, make_suite, save_suite
    from ..query.spec import parse_methods
    from .fidelity import CONTEXTS, by_context_length, retrieved, run_fidelity, table
    from .ruler import check_wrapped

    if format not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "entities":
        check_suite(ks, questions, entities, split)
    check_wrapped(methods or {}, wrapper, refuse_unused=True)
    work = Path(workdir)
    settings = {"ks": list(ks), "questions": questions, **({"split": split} if split else {}),
                **({"filler": filler} if filler != FILLER_SENTENCES else {}),
                **({"entities": entities} if entities != ENTITIES else {}), **_model_settings(model_path, dictionary)}
    if format == "cloze":
        settings = {**settings, "format": "cloze", "corpus": corpus, "chunk_tokens": chunk_tokens}
    elif format == "records":
        settings = {**settings, "format": "records"}
    else:  # #69: the distractors are what retrieval over the whole pool returns (look-alikes included); a
        # two-chunk question's chunks placed among them (#79) unless asked otherwise or a workdir was made without
        made = work / "suite.json"
        saved = json.loads(made.read_text()).get("contexts") if made.exists() else None
        if two_chunk is not None and two_chunk not in CONTEXTS:
            raise ConfigError(f"--two-chunk must be one of {', '.join(CONTEXTS)}, got {two_chunk!r}")
        settings = {**settings, "contexts": CONTEXTS[two_chunk] if two_chunk else (saved or CONTEXTS["placed"])}
    made = work / "suite.json"
    if made.exists():  # a suite made for more ks answers a subset of them
        saved = json.loads(made.read_text())
        if (saved.get("questions") == questions and set(ks) <= set(saved.get("ks", ()))
                and all(saved.get(key) == settings.get(key) for key in (set(saved) | set(settings)) - {"ks", "questions"})):
            settings = saved
    if format == "entities":
        session = _suite_session(work, settings, lambda model: make_suite(work, ks, questions, entities, filler,
                                                                          split=split), device)
        made = load_suite(work)
        if any(q.chunks is None for qs in made.values() for q in qs):  # contexts drawn at random until retrieved
            save_suite(work, retrieved(session, made, settings["contexts"] == CONTEXTS["placed"]))
    else:  # asked by retrieval over the suite's store, so the questions are made after it
        if format == "cloze":
            from ..measure.cloze import make_cloze
            from ..store import StoreConfig

            session = _suite_session(work, settings, lambda model: None, device, corpus=[corpus],
                                     config=StoreConfig(chunk_tokens=chunk_tokens))
            ask = lambda: make_cloze(session, ks, questions, split or "dev")  # noqa: E731
        else:
            from .records import make_records, records_suite

            def make(model):
                write_atomic(work / "facts.json", json.dumps(make_records(work, questions, entities, split or "dev")))

            session = _suite_session(work, settings, make, device)
            ask = lambda: records_suite(session, json.loads((work / "facts.json").read_text()), ks)  # noqa: E731
        if not (work / "questions.json").exists():
            save_suite(work, ask())
    pick = shard.questions if shard is not None else (lambda qs: qs)
    suite = {k: pick(qs)[:limit] for k, qs in load_suite(work).items() if k in ks}
    results = work / "results.json" if shard is None else _shard_results(work, shard, suite)
    if shard is None:
        _merge_shards(work, results)
    wrapped = _wrapped_waiting(work, session, wrapper, device, [corpus] if format == "cloze" else None) \
        if wrapper else None
    methods = methods or parse_methods(FIDELITY_METHODS)
    if shard is None:
        rows = run_fidelity(session, suite, methods, results, wrapped=wrapped, confident_only=confident_only)
    else:  # question by question: a run cut short leaves complete rows
        for k, qs in suite.items():
            for q in qs:
                run_fidelity(session, {k: [q]}, methods, results, wrapped=wrapped, confident_only=confident_only)
        rows = _rows(results)
    asked = [r for r in rows if (r["k"], r["question"]) in {(k, q.id) for k, qs in suite.items() for q in qs}]
    return {"device": str(device), "cpu": cpu_model(), "ks": list(ks), "questions": questions, "limit": limit,
            "split": split, **({"shard": f"{shard.index}/{shard.count}"} if shard else {}),
            **({"wrapper": wrapped.store.config.wrapper} if wrapped else {}),
            "rows": table(asked), "full_by_context_length": [b for k in ks for b in by_context_length(asked, k)]}


def _shard_results(work: Path, shard: Shard, suite: dict) -> Path:
    """The shard's results file: refused where it exists and `shard.resume` is not set; seeded with the rows
    `shard.seeds` hold for the shard's questions (so the merge stays small)."""
    import json

    path = shard.results(work)
    if path.exists() and not shard.resume:
        raise ConfigError(f"{path} exists: --resume continues it (or remove it to start the shard again)")
    ids = {q.id for qs in suite.values() for q in qs}
    done = _rows(path)
    rows = _keyed(r for f in shard.seeds for r in _rows(Path(f)) if r["question"] in ids) | _keyed(done)
    if len(rows) > len(done) or not path.exists():
        write_atomic(path, json.dumps({"rows": list(rows.values())}))
    return path


def _merge_shards(work, results) -> None:
    """Every shard's rows (results-I-of-N.json) joined into `results` (a row already there stays)."""
    import json

    files = sorted(work.glob("results-*-of-*.json"))
    if files:
        rows = _keyed(r for f in files for r in _rows(f)) | _keyed(_rows(results))
        write_atomic(results, json.dumps({"rows": list(rows.values())}))


def _rows(path: Path) -> list[dict]:
    """A results file's rows ([] where there is none)."""
    import json

    return json.loads(path.read_text())["rows"] if path.exists() else []


def _keyed(rows) -> dict:
    """Rows by (k, label, question), a later row for the same key replacing an earlier one."""
    return {(r["k"], r["label"], r["question"]): r for r in rows}


def _wrapped_waiting(work, session, wrapper: str, device, corpus, waits: int = 720):
    """`wrapped_session`, waiting while another process (a shard started beside this one) holds the wrapped
    store's writer lock to bring it up to date: up to `waits` x 5 s (an hour)."""
    import time

    from ..errors import StoreLocked

    for _ in range(waits):
        try:
            return wrapped_session(work, session, wrapper, device, corpus=corpus)
        except StoreLocked as e:
            print(f"waiting: {e}", flush=True)
            time.sleep(5)
    raise ConfigError(f"{work / 'store-wrapped'} stayed locked for {waits * 5} s")


def _model_settings(model_path: str, dictionary: str | None) -> dict:
    """What a suite's settings record of its model and dictionary (nothing for the defaults, so
    suites made before these options stay valid)."""
    return {**({"model": str(model_path)} if model_path != "default" else {}),
            **({"dictionary": str(dictionary)} if dictionary else {})}


def _suite_session(work, settings: dict, make, device, corpus=None, config=None):
    """A Session over a generated suite's store in `work`: the suite made once (`make(model)`
    writes its corpus.jsonl), refused if `work` holds one made with other settings; the store
    encoded incrementally, so a killed encode resumes. The model and dictionary are the
    settings' (`_model_settings`): the default model, the model's shipped dictionary."""
    import json

    from ..codec.dictionary import shipped_dictionary
    from ..ingest.config import EncodeOptions
    from ..ingest.encoder import encode_with
    from ..model.kvmodel import load_model
    from ..query.session import Session
    from ..store import StoreConfig, config_for

    made = work / "suite.json"
    if made.exists() and json.loads(made.read_text()) != settings:
        raise ConfigError(f"{work} holds a suite made with {made.read_text().strip()}; use another --workdir")
    model = load_model(settings.get("model", "default"), device=device)
    dictionary = settings.get("dictionary") or shipped_dictionary(model.fingerprint())
    if not made.exists():
        make(model)
        write_atomic(made, json.dumps(settings))
    if config is None:  # a store encoded with `encode-corpus --encode-after` into the workdir is measured as it is
        own = config_for(work / "store")
        config = StoreConfig(encode_after=own.encode_after, encode_after_chunks=own.encode_after_chunks)
    encode_with(corpus or [str(work / "corpus.jsonl")], work / "store", Dictionary.load(dictionary), model,
                config, EncodeOptions(device=device))
    return Session(work / "store", model, device)


def wrapped_session(work, session, wrapper: str, device, embedder=None, corpus=None):
    """A Session over the suite in `work` encoded with the learned wrapper `wrapper` (a directory
    or 'shipped') into work/store-wrapped, beside `session`'s plain store, with its model,
    dictionary and settings; incremental like the plain store (another wrapper there is refused). An
    existing wrapped store keeps what its chunks were encoded after (`StoreConfig.encode_after`)."""
    from dataclasses import replace

    from ..ingest.config import EncodeOptions
    from ..ingest.encoder import encode_with
    from ..query.session import Session
    from ..store import config_for
    from ..wrapper.apply import load_wrapper

    w = load_wrapper(wrapper, session.model.fingerprint())
    # what its chunks were encoded after is the store's own: one encoded with `encode-corpus --encode-after`
    # into the workdir is measured as it is
    own = config_for(work / "store-wrapped")
    encode_with(corpus or [str(work / "corpus.jsonl")], work / "store-wrapped", session.store.dictionary,
                session.model, replace(session.store.config, wrapper=w.digest(), encode_after=own.encode_after,
                                       encode_after_chunks=own.encode_after_chunks),
                EncodeOptions(device=device, progress=False), embedder=embedder, wrapper=w)
    return Session(work / "store-wrapped", session.model, device)


# The decomposition: exact per-chunk KV, codes, then recomputation at growing ratios, with and
# without reordering, and the other scorers at the default ratio.
FIDELITY_METHODS = ("raw,none,infoflow:0.15,infoflow:0.3,infoflow:0.5,infoflow:1.0,infoflow:0.15+reorder,"
                    "infoflow:0.3+reorder,a3:0.15,cacheblend:0.15")


