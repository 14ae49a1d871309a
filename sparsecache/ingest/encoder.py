"""`encode_corpus`: the (nightly) job that brings a store up to date with a corpus.

Scan and hash every document first; encode only new or changed ones, in batches of whole
documents (model forward → Batch-OMP → append); record progress after every batch; then
build the index over the live chunks and publish a new version. A rerun after a crash picks
up at the last recorded batch, and because batches start at the same documents as they
would have, it writes the same codes an uninterrupted run would.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ..codec.coding import Codec
from ..codec.dictionary import Dictionary
from ..codec.learn import AdaptConfig
from ..codec.omp import EXACT, Screening
from ..dtypes import forward_dtype as resolve_forward_dtype
from ..errors import ConfigError
from ..kvstore.index import Embedder, FaissIndexer
from ..model.kvmodel import KVModel, chunk_context_ids, extract_kv, prefix_ids, use_soft_tokens
from ..stopwatch import Stopwatch
from ..store import StoreConfig, Writer
from ..store.layout import AFTER
from ..text.corpus import Chunk, Source, chunks, scan
from ..wrapper.apply import Wrapper, store_wrapping
from .after import After, plan_neighbours
from .batch import code_batch
from .config import EncodeOptions


@dataclass
class EncodeReport:
    store: str
    version: int
    published: bool
    documents: dict = field(default_factory=dict)  # new / changed / unchanged / deleted / resumed
    chunks: int = 0
    tokens: int = 0
    seconds: dict = field(default_factory=dict)  # per phase (wall time in this process)
    worker_seconds: dict = field(default_factory=dict)  # per phase, summed over distributed workers
    message: str = ""
    forward_dtype: str = ""  # what this process's forward ran in ("" where it ran none)

    @property
    def tokens_per_s(self) -> float:
        busy = sum(v for k, v in self.seconds.items() if k not in ("total", "load"))
        return self.tokens / busy if busy else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}


@dataclass
class Work:
    """What a run has to do, decided before any encoding."""

    sources: list[Source]  # new or changed documents, in id order
    deleted: list[str]
    counts: dict
    resume_open: dict | None  # a document a crashed run was in the middle of: {id, hash, first, count, ...}
    neighbours: dict = field(default_factory=dict)  # a neighbours store's: chunk id -> [(neighbour id, its tokens)]


@dataclass
class EncodeRun:
    """One `encode_corpus` call's work in progress, as the local loop and the Ray one share it: the
    options the CLI was given travel here whole (`options.device` resolved)."""

    writer: Writer  # holds the store's lock or lease
    work: Work
    model: KVModel
    config: StoreConfig
    options: EncodeOptions
    report: EncodeReport
    timer: Stopwatch  # seconds per phase

    @property
    def screening(self) -> Screening | None:
        """The CPU OMP's candidate screening: exact Batch-OMP with `exact_omp`, else the codec's default."""
        return EXACT if self.options.exact_omp else None


def encode_corpus(corpus: list[str] | tuple[str, ...], store, options: EncodeOptions = EncodeOptions()
                  ) -> EncodeReport:
    """Bring the store at `store` (a directory or an s3://, gs://, az:// URL) up to date with
    `corpus` as `options` say: the one call `encode-corpus` makes.

    Resolves what a store is built with (the store's own dictionary, wrapper and format for an
    existing store, else what `options` names, else the model's shipped defaults), loads the
    model only when there is something to encode and passes it through the model gate
    (`check.ensure_checked`: a model whose K/V would be stored wrongly is refused), then runs
    `encode_with`. The store is opened once."""
    from ..model.gguf import for_recorded
    from ..model.kvmodel import resolve_device
    from ..store import config_for, open_backend, store_exists
    from ..store.layout import root_attrs
    from ..wrapper.apply import wrapper_for

    backend = open_backend(store)
    # a re-index with no --model keeps the store's own packaged model, as a query of it does
    options = replace(options, model=for_recorded(options.model, root_attrs(backend)["model"])) \
        if store_exists(backend) else options
    wrapper = wrapper_for(backend, options.wrapper, options.model)
    config = config_for(backend, **options.store_fields(), wrapper=wrapper.digest() if wrapper else None)
    dictionary = dictionary_for(backend, options.dictionary, options.model)

    options = replace(options, device=str(resolve_device(options.device)))
    return encode_with(corpus, backend, dictionary, ModelLoader(options), config, options, wrapper=wrapper)


@dataclass(frozen=True)
class ModelLoader:
    """`options.model`, loaded on `options.device` and through the model gate (`check.ensure_checked`) when
    called: only where there is something to encode. Its fingerprint comes from the model's config alone,
    so an idle run and the compatibility check need no weights."""

    options: EncodeOptions

    def fingerprint(self) -> dict:
        from ..model.kvmodel import model_fingerprint

        return model_fingerprint(self.options.model)

    def __call__(self) -> KVModel:
        from ..model.check import ensure_checked
        from ..model.kvmodel import load_model, resolve_device

        device = resolve_device(self.options.device)
        if self.options.progress:
            tqdm.write(f"loading model {self.options.model} on {device}", file=sys.stderr)
        loaded = load_model(self.options.model, device=device)
        ensure_checked(loaded)  # once per model fingerprint
        return loaded


def dictionary_for(store, given: str | None = None, model_path: str = "default") -> Dictionary:
    """The dictionary an encode of `store` with `model_path` uses: `given` (a directory;
    "default" is the model's shipped one), or with none given the store's own copy where the
    store exists (a re-index keeps its dictionary), else the one shipped for the model."""
    from ..codec.dictionary import shipped_dictionary
    from ..model.kvmodel import DEFAULT, model_fingerprint
    from ..store import existing_dictionary

    if given in (None, "default"):
        given = (given is None and existing_dictionary(store)) or shipped_dictionary(
            None if model_path == DEFAULT else model_fingerprint(model_path))
    return Dictionary.load(given)


def encode_with(corpus: list[str] | tuple[str, ...], store, dictionary: Dictionary,
                model: KVModel | ModelLoader, config: StoreConfig = StoreConfig(),
                options: EncodeOptions = EncodeOptions(), *, embedder: Embedder | None = None,
                wrapper: Wrapper | None = None) -> EncodeReport:
    """Bring the store at `store` (a directory, an s3://, gs://, az:// URL or an open Backend)
    up to date with `corpus`, with the dictionary, model and config already chosen (what
    `encode_corpus` resolves); `options` says how this run goes (its store-format fields are
    `encode_corpus`'s to resolve into `config`, and are not read here). Returns what was done and
    how long it took.

    `model` may be a `ModelLoader`: it is only called when there is work, so an unchanged corpus is
    answered from the scan alone. The model (by its fingerprint), the dictionary and the store are checked
    against each other once, where the run starts (`_check_compatible`). `options.workers` > 0 or a
    `ray_address` encode on Ray actors (see `distributed`), each loading `options.model` (the default model or a
    directory every node can read). After publishing, versions beyond the newest `options.keep`
    are deleted (0 keeps them all).

    `options.adapt_steps` fits the dictionary to a sample of the corpus before a new store's first
    encode (`learn.adapt`); the store keeps the adapted copy, and a rerun that names the same
    starting dictionary reuses it. `options.exact_omp` codes with exact Batch-OMP instead of the CPU
    kernel's screening; it is not part of the store: codes from either are the same format.

    `wrapper` (a learned chunk wrapper, `wrapper/apply.py`; `config.wrapper` must be its digest) wraps
    every chunk of a new store as prefix | header | chunk | trailer: the header's K/V is kept
    once with the prefix's, the trailer's with each chunk's codes. An existing store keeps its own.
    `embedder`: one already loaded (default: `config.embedder`'s, loaded when needed).
    """
    from ..model.kvmodel import resolve_device

    device = resolve_device(options.device)
    options = replace(options, device=str(device))
    adapt = AdaptConfig(steps=options.adapt_steps) if options.adapt_steps else None
    progress = options.progress
    if config.wrapper and wrapper is not None and wrapper.digest() != config.wrapper:
        raise ConfigError(f"the wrapper given is {wrapper.digest()}, the config names {config.wrapper}")
    t_start = time.perf_counter()
    timer = Stopwatch(device, unit=1.0)
    with timer.step("scan"):
        sources = scan(corpus)
    load = _loader(model, timer)
    fingerprint = model.fingerprint()  # a loader's from the model's config: no weights loaded for it
    with Writer(store) as w:
        existing = w.initialised()  # a listing of the store's versions: once
        if existing and adapt is not None:
            dictionary = _stored_adaptation(w, dictionary)
        _check_compatible(w if existing else None, config, dictionary, fingerprint)
        if not existing:
            if adapt is not None:
                with timer.step("adapt"):
                    dictionary = _adapted(load(), sources, dictionary, adapt, device, progress)
            if config.wrapper and wrapper is None:
                raise ConfigError(f"a new store with wrapper {config.wrapper} needs the wrapper itself (--wrapper DIR)")
            _create(w, config, dictionary, load(), embedder or Embedder(config.embedder, device), wrapper)
        # a neighbours store never continues a document inside: its first chunks may have other neighbours now
        work = _work(w, sources, options.delete_missing, resume_open=config.encode_after != "neighbours")
        report = EncodeReport(str(store), w.base.version, False, work.counts)
        if not work.sources and not w.done and not work.deleted:
            report.message = (f"unchanged: {len(sources)} documents match version {w.base.version}; "
                              "nothing to encode, no new version")
        else:
            model = load()
            if config.encode_after == "neighbours":
                embedder = embedder or Embedder(config.embedder, device)
                with timer.step("neighbours"):
                    _plan_neighbours(w, work, sources, model, config, embedder)
            run = EncodeRun(w, work, model, config, options, report, timer)
            if options.workers or options.ray_address:
                from .distributed import encode_distributed

                encode_distributed(run)
            else:
                report.forward_dtype = resolve_forward_dtype(options.forward_dtype, options.device)
                _encode_work(run, Codec(dictionary, config.coef_dtype, device, config.index_coding, run.screening),
                             embedder or Embedder(config.embedder, device))
            _publish(w, work, options, report, timer)
    report.seconds = {**{k: round(v, 3) for k, v in timer.items()}, "total": round(time.perf_counter() - t_start, 3)}
    return report


def _check_compatible(existing: Writer | None, config: StoreConfig, dictionary: Dictionary,
                      fingerprint: dict) -> None:
    """The one check, where a run starts, that the model (by its fingerprint), the dictionary, the options
    and an existing store (its writer; None for a new store) agree: a wrong --dict, --model or store option
    is refused even when there is nothing to encode."""
    dictionary.check_model(fingerprint)
    if existing is not None:
        existing.check_compatible(config, dictionary, fingerprint)


def _adapted(model: KVModel, sources: list[Source], dictionary: Dictionary, acfg: AdaptConfig, device,
             progress: bool) -> Dictionary:
    """`dictionary` adapted on documents drawn at random (seeded) from `sources`, read until
    they hold about acfg.tokens tokens."""
    from ..codec.learn import adapt
    from ..text.documents import Document

    order = np.random.default_rng(acfg.seed).permutation(len(sources))
    docs, chars = [], 0
    for i in order:
        if chars >= 5 * acfg.tokens:  # ~4 characters per token, with room for short chunks
            break
        text = "".join(sources[i].blocks())
        docs.append(Document(sources[i].id, text))
        chars += len(text)
    return adapt(model, docs, dictionary, acfg, device, progress)


def _stored_adaptation(w: Writer, dictionary: Dictionary) -> Dictionary:
    """The store's adapted dictionary when it was adapted from `dictionary`, else `dictionary`
    (which `check_compatible` then judges)."""
    stored = Dictionary.load(w.dictionary_dir())
    return stored if stored.meta.get("adapt", {}).get("from") == dictionary.fingerprint() else dictionary


def _publish(w: Writer, work: Work, options: EncodeOptions, report: EncodeReport, timer: Stopwatch) -> None:
    """Index the live chunks and publish them as the next version; prune to `options.keep` versions."""
    deleted = set(work.deleted)
    with timer.step("index+publish"):
        note = ", ".join(f"{v} {k}" for k, v in work.counts.items() if v)
        m = w.publish({k: v for k, v in w.done.items() if k not in deleted}, deleted, FaissIndexer(options.index_kind),
                      note)
        if options.keep:
            w.prune(options.keep)
    report.version, report.published = m.version, True
    report.message = f"published version {m.version}: {m.n_documents} documents, {m.live_chunks} chunks ({note})"


def _loader(model: KVModel | ModelLoader, timer: Stopwatch) -> Callable[[], KVModel]:
    """A function returning the model, loading it (timed as "load") on its first call only."""
    if isinstance(model, KVModel):
        return lambda: model
    cache: list[KVModel] = []

    def load() -> KVModel:
        if not cache:
            with timer.step("load"):
                cache.append(model())
        return cache[0]

    return load


def _create(w: Writer, config: StoreConfig, dictionary: Dictionary, model: KVModel, embedder: Embedder,
            wrapper: Wrapper | None = None) -> None:
    """Lay out a new store for this model, dictionary and embedder (and wrapper: its header
    follows the prefix in the prefix group, its soft tokens beside them)."""
    ids = prefix_ids(model, config.prefix)
    soft = None
    if wrapper is not None:
        wrapper.check_model(model)
        soft = wrapper.table()
        use_soft_tokens(model, soft)
        ids = ids + wrapper.ids()[0]
    kv = extract_kv(model, [ids])[0] if ids else _empty_kv(model)
    w.create(config, dictionary, model.fingerprint(), ids, tuple(t.float().cpu().numpy() for t in kv), embedder.dim,
             FaissIndexer(), None if soft is None else soft.numpy())


def _plan_neighbours(w: Writer, work: Work, sources: list[Source], model: KVModel, config: StoreConfig,
                     embedder: Embedder) -> None:
    """A neighbours store's run (`after.plan_neighbours`): each chunk's neighbour among what the store will
    hold, and the held documents whose neighbours changed added to `work` to be encoded again."""
    leaving = {s.id for s in work.sources} | set(work.deleted)  # encoded in this run, or deleted by it
    held = {d: {"first": e["first"], "count": e["count"]} for d, e in {**dict(w.base.documents.items()), **w.done}.items()
            if d not in leaving}
    plan = plan_neighbours(w.group, held, work.sources, {s.id: s for s in sources}, model.tokenizer,
                           config.chunk_tokens, embedder, config.encode_after_chunks)
    work.neighbours = plan.neighbour
    if plan.refresh:
        work.sources = sorted(work.sources + plan.refresh, key=lambda s: s.id)
        work.counts["refreshed"] = len(plan.refresh)


def _work(w: Writer, sources: list[Source], delete_missing: bool, resume_open: bool = True) -> Work:
    """What to encode, given the last version and what a crashed run already wrote.

    A document a crashed run was in the middle of is continued first, whatever documents
    arrived since: its rows must stay one contiguous run, and anything encoded before it
    would be appended in the middle of that run."""
    done, open_doc = w.begin()
    base = w.base.documents
    at = base.find([s.id for s in sources])  # one vectorised lookup, not one per document
    held = {s.id: base.hashes[i].decode("utf-8") for s, i in zip(sources, at.tolist()) if i >= 0}
    held.update({k: d["hash"] for k, d in done.items()})  # what the store holds once the crashed run's work counts
    work = [s for s in sources if held.get(s.id) != s.hash]
    by_id = {s.id: s for s in work}
    if resume_open and open_doc and by_id.get(open_doc["id"], None) and by_id[open_doc["id"]].hash == open_doc["hash"]:
        w.rewind(open_doc["token_offset"] + open_doc["tokens"], open_doc["first"] + open_doc["count"])
        work = [by_id[open_doc["id"]]] + [s for s in work if s.id != open_doc["id"]]
    else:
        open_doc = None  # it changed or went away since (or is not to be resumed): its rows are dropped (reused)
    ids = {s.id for s in sources}
    deleted = sorted({d for d in (*base, *done) if d not in ids}) if delete_missing else []
    counts = {"new": sum(s.id not in held for s in work), "changed": sum(s.id in held for s in work),
              "unchanged": len(sources) - len(work), "deleted": len(deleted), "resumed": len(done)}
    return Work(work, deleted, counts, open_doc)


def _encode_work(run: EncodeRun, codec: Codec, embedder: Embedder) -> None:
    """Encode `run.work.sources` batch by batch, recording progress in the store after every batch."""
    w, work, model, timer, report = run.writer, run.work, run.model, run.timer, run.report
    batch_tokens, progress = run.options.batch_tokens, run.options.progress
    header, trailer = store_wrapping(w.backend, model)
    prefix = chunk_context_ids(model, run.config.prefix, run.config.anchor) + header
    after = _after(run, header, trailer)
    size = BarSize(work.sources)
    bar = tqdm(total=size.total(0), unit="tok", unit_scale=True, desc="encode", disable=not progress,
               dynamic_ncols=True)
    open_docs: dict[str, dict] = {}  # rows written per unfinished document
    skip = {}
    if work.resume_open:
        o = work.resume_open
        open_docs[o["id"]] = {k: o[k] for k in ("first", "count", "tokens", "token_offset")}
        skip[o["id"]] = o["count"]
    end = (w.finished_tokens, w.finished_chunks)  # extents after the last finished document
    hashes = {s.id: s.hash for s in work.sources}
    for batch, finished in _batches(work.sources, model.tokenizer, run.config.chunk_tokens, batch_tokens, skip, timer,
                                    after.saw):
        if batch:
            wrapped = [replace(c, token_ids=tuple(c.token_ids) + trailer) for c in batch] if trailer else batch
            _encode_batch(run, wrapped, open_docs, codec, embedder, prefix, bar, after)
            report.chunks += len(batch)
            report.tokens += sum(len(c.token_ids) for c in batch)
        done = {}
        for s in finished:
            d = open_docs.pop(s.id, None) or {"first": end[1], "count": 0, "tokens": 0, "token_offset": end[0]}
            done[s.id] = {**d, "hash": s.hash}
            end = (d["token_offset"] + d["tokens"], d["first"] + d["count"])
        size.finished(finished, sum(done[s.id]["tokens"] for s in finished))
        bar.total = max(bar.n, size.total(bar.n))
        with timer.step("commit"):  # fsync of the batch's files + pending.json
            w.commit(done, *end, [{"id": i, "hash": hashes[i], **d} for i, d in open_docs.items()])
        busy = sum(v for k, v in timer.items() if k != "load") or 1.0
        bar.set_postfix(docs=f"{len(w.done)}", chunks=report.chunks, tok_s=f"{report.tokens / busy:.0f}")
    bar.total = bar.n  # the estimate counted whole documents; chunking splits a few tokens differently
    bar.close()


class BarSize:
    """The encode bar's size in tokens without tokenising the corpus twice: the bytes of the documents
    still to chunk times the tokens per byte of the documents finished so far (TOKENS_PER_BYTE before any)."""

    TOKENS_PER_BYTE = 0.25  # English prose under a BPE tokenizer, about 4 bytes a token

    def __init__(self, work: list[Source]):
        self.left = sum(s.size for s in work)
        self.done_bytes = self.done_tokens = 0
        self.rate = self.TOKENS_PER_BYTE

    def finished(self, sources: list[Source], tokens: int) -> None:
        """`sources` were chunked in full, into `tokens` tokens."""
        n = sum(s.size for s in sources)
        self.left -= n
        self.done_bytes += n
        self.done_tokens += tokens
        if self.done_bytes and self.done_tokens:
            self.rate = self.done_tokens / self.done_bytes

    def total(self, counted: int) -> int:
        """The bar's total once `counted` tokens are on it."""
        return counted + round(max(self.left, 0) * self.rate)


def _empty_kv(model: KVModel) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros(model.n_layers, 0, model.m)
    return z, z.clone()


def _after(run: EncodeRun, header: list[int], trailer: tuple[int, ...]) -> After:
    """What each chunk of the run is encoded after (`after.py`; a neighbours store's, planned already)."""
    return After(run.config.encode_after, tuple(header), tuple(trailer), dict(run.work.neighbours),
                 run.config.encode_after_chunks)


def _batches(work: list[Source], tokenizer, chunk_tokens: int, batch_tokens: int, skip: dict[str, int],
             timer: Stopwatch, saw: Callable[[Chunk], None] = lambda c: None):
    """(chunks, sources finished since the last batch) pairs, a batch closing once it holds
    `batch_tokens`. The first `skip[id]` chunks of a document are already stored (resume); `saw` is
    told of every chunk, in order, those skipped too."""
    batch: list[Chunk] = []
    finished: list[Source] = []
    ntok = 0
    for src in work:
        it = chunks(src, tokenizer, chunk_tokens)
        while True:
            with timer.step("chunk"):
                c = next(it, None)
            if c is None:
                break
            saw(c)
            if c.ordinal < skip.get(src.id, 0):
                continue
            batch.append(c)
            ntok += len(c.token_ids)
            if ntok >= batch_tokens:
                yield batch, finished
                batch, finished, ntok = [], [], 0
        finished.append(src)
    if batch or finished:
        yield batch, finished


def _encode_batch(run: EncodeRun, batch: list[Chunk], open_docs: dict[str, dict], codec: Codec, embedder: Embedder,
                  prefix: list[int], bar, after: After) -> None:
    w, timer = run.writer, run.timer

    def step(name):  # the bar says what the batch is doing: a CPU batch takes ~1.5 min
        bar.set_description(f"encode ({name})")
        return timer.step(name)

    moved = 0.0  # the bar moves as OMP blocks finish, the rest at the end

    def on_tokens(n: float) -> None:
        nonlocal moved
        bar.update(n)
        moved += n

    read = [after.context(c) for c in batch] if after.active else None
    before = prefix if read is None else [prefix + r[0] for r in read]
    k_codes, v_codes = code_batch(run.model, codec, [list(c.token_ids) for c in batch], before,
                                  run.options.batch_tokens, step, on_tokens, run.report.forward_dtype)
    with step("embed"):
        emb = embedder.embed([c.text for c in batch])
    with step("write"):
        tokens = np.concatenate([np.asarray(c.token_ids, np.int32) for c in batch])
        row0, tok0 = w.chunks, w.tokens
        rows = [c.row() for c in batch] if read is None else [{**c.row(), AFTER: r[1]} for c, r in zip(batch, read)]
        w.append(rows, tokens, k_codes, v_codes, emb)
        for i, c in enumerate(batch):
            d = open_docs.setdefault(c.doc_id, {"first": row0 + i, "count": 0, "tokens": 0, "token_offset": tok0})
            d["count"] += 1
            d["tokens"] += len(c.token_ids)
            tok0 += len(c.token_ids)
    bar.update(len(tokens) - moved)
    bar.set_description("encode")
