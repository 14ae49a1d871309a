"""`Session`: a store, its model and embedder loaded once, answering questions (`sparsecache query`).

One query: retrieve → read codes → transfer → reconstruct (decode + RoPE) → select →
recompute → question prefill → first token, each step timed (CUDA-synchronised), then
greedy generation. The same object answers many queries, so latency is steady-state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import OPENMP_SPINS
from ..errors import ConfigError, VersionGone
from ..kvstore.view import KVStore
from ..model.cache import truncate
from ..model.generate import forced_logprobs, greedy_continue, question_ids, top1_agreement
from ..model.gguf import for_recorded
from ..model.kvmodel import KVModel, kv_values, load_model, query_dtype, use_soft_tokens
from ..stopwatch import Stopwatch
from ..store.versions import READ_ATTEMPTS
from . import methods
from .budget import Costs
from .config import DTYPE, MAX_NEW_TOKENS, MISSED, TOP_K, QueryConfig, calibrated, device_record, missed_target
from .context import QueryContext, Reuse
from .methods.cacheclip import Selectors
from .overlap import Rates
from .plan import Plan, check_question, costs_of, plan, prefill_under
from .raw import RawKV

STEPS = ("retrieve", "read", "transfer", "reconstruct", "select", "recompute", "prefill", "first_token")


@dataclass
class Answer:
    answer: str
    chunks: list[dict]  # id, doc_id, ordinal, score
    timings_ms: dict  # every step of STEPS, "ttft" (their sum) and "generate"
    recomputed_tokens: int
    bytes_read: int
    context_tokens: int
    method: str
    context_ids: list[str] = field(default_factory=list)  # chunk ids in context order (prefix first)
    logits: torch.Tensor | None = field(default=None, repr=False)  # next-token logits after the question
    tokens: list[int] = field(default_factory=list, repr=False)  # the answer's token ids
    agreement: float | None = None  # with `reference=`: top-1 agreement along the reference answer
    # with `logprobs=True`: float32 log-probabilities [len(tokens), vocab] of each step of the answer
    # (`logprobs`) and, with `reference=`, of each step along the reference, teacher-forced
    logprobs: torch.Tensor | None = field(default=None, repr=False)
    reference_logprobs: torch.Tensor | None = field(default=None, repr=False)
    # the cheap-context threshold (tokens) when the context was under it and so prefilled (`cheap.py`)
    prefilled_under: int | None = None
    recompute_ratio: float | None = None  # the share of chunk tokens a scorer recomputed (its own, given or budgeted)
    config: QueryConfig | None = field(default=None, repr=False)  # the config asked for, its method named
    escalated: bool = False  # the confidence gate (`gate_margin`) prefilled it after the blend: its TTFT counts both

    def to_dict(self) -> dict:
        return {"answer": self.answer, "chunks": self.chunks, "context_ids": self.context_ids,
                "timings_ms": self.timings_ms, "recomputed_tokens": self.recomputed_tokens,
                "bytes_read": self.bytes_read, "context_tokens": self.context_tokens, "method": self.method,
                "recompute_ratio": self.recompute_ratio,
                **({"prefilled_under": self.prefilled_under} if self.prefilled_under else {}),
                **({"escalated": True} if self.escalated else {})}


def _at_a_live_version(method):
    """Run a Session read so that what it returns was read from one intact version: if the
    version was deleted meanwhile (a compact, or a writer's --keep, beside a long query),
    nothing read from it is trusted and the read is done again at the newest version (a
    session given a KVStore pinned to one version raises VersionGone instead)."""
    @functools.wraps(method)
    def read(self, *args, **kwargs):
        for _ in range(READ_ATTEMPTS):
            try:
                out = method(self, *args, **kwargs)
            except Exception:  # whatever a vanished generation makes zarr raise (KeyError, ...)
                if self.store.published():
                    raise  # not explained by a deletion: the error stands
            else:
                if self.store.published():
                    return out
            if not self.follows_latest:
                raise VersionGone(f"{self.store.backend}: version {self.store.version} was deleted while it was read")
            self.store = self.store.latest()
            self.rereads += 1
        raise VersionGone(f"{self.store.backend}: {READ_ATTEMPTS} versions in a row were deleted while being read")
    return read


_FROM_STORE = object()  # `Session.costs` not set: derived from the store at each query


class Session:
    """Keeps the store, model, codec and embedder loaded across queries. Opened by path, it
    follows the store's newest version whenever the one it read is deleted."""

    def __init__(self, store: str | Path | KVStore, model: str | KVModel = "default", device: str = "cpu",
                 raw_dir: str | Path | None = None, dtype: str = DTYPE, warm_retrieval: bool = False,
                 graphs: bool = False):
        """`warm_retrieval`: load the embedder and retrieve once as part of the set-up, so the first
        retrieval does not pay the embedder's loading and first call (~150-200 ms on 2 CPU cores):
        for a session that will retrieve soon, as a CLI query does. (Not in a thread beside the
        model's loading: transformers' `from_pretrained` is not safe in two threads at once.)
        `graphs`: the fixed passes on a static workspace, as CUDA graphs on a GPU (`model.graphs.enable`:
        the model's, so every session over it from then on)."""
        self.follows_latest = not isinstance(store, KVStore)
        self.rereads = 0  # reads done again at a newer version because the one read was deleted
        self.store = store if isinstance(store, KVStore) else KVStore.open(store)
        self.device = torch.device(device)
        self._embedder = None
        # `dtype` (model.query_dtype) applies to a model loaded here; a KVModel given keeps its own
        if not isinstance(model, KVModel):  # `default`: the store's own packaged model
            model = load_model(for_recorded(model, self.store.attrs.get("model")), device=self.device,
                               dtype=query_dtype(dtype, self.device))
        self.model = model
        self.store.check_model(self.model.fingerprint())
        use_soft_tokens(self.model, self.store.soft())
        if graphs:
            from ..model.graphs import enable

            enable(self.model)
        if self.device.type == "cpu":
            # set-up, like loading the model, not a query's TTFT: the decode's kernels, and its memory for
            # TOP_K full chunks (a first decode into fresh memory was ~2x slower, #82 item 3)
            tokens = self.store.layout().chunk_tokens([self.store.config.chunk_tokens] * TOP_K)
            self.store.codec().warm_up(tokens * kv_values(self.model.config))
            if OPENMP_SPINS:
                warnings.warn("torch was imported before sparsecache, so its OpenMP workers spin between "
                              "operations: on a CPU shared with other work a query can be several times slower. "
                              "Import sparsecache first, or set OMP_WAIT_POLICY=PASSIVE before Python starts.",
                              stacklevel=2)
        self.raw = RawKV(self.store, raw_dir)
        if warm_retrieval:  # the embedder loaded and run once, the index read and searched once
            search_hits(self.store, self.embedder, "warm-up", TOP_K)
        self.selectors = Selectors(self.model, wrapped=self.store.header() is not None)
        self.rates = Rates()  # measured by every query; cake's split comes from them
        self._costs = _FROM_STORE  # `costs`: tests may set it

    @property
    def costs(self) -> Costs | None:
        """What --ttft-budget predicts with (`budget.py`): `calibrate`'s refit on this kind of device where
        the store's live version has one, else the device kind's measured constants for this model (None
        where none are). Read at each query from the session's current version, as `default_config` is."""
        if self._costs is not _FROM_STORE:
            return self._costs
        return costs_of(self.store, self.model.config, self.device.type)

    @costs.setter
    def costs(self, costs: Costs | None):
        self._costs = costs

    @property
    def embedder(self):
        if self._embedder is None:
            from ..kvstore.index import Embedder

            self._embedder = Embedder(self.store.config.embedder, self.device)
        return self._embedder

    @_at_a_live_version
    def retrieve(self, question: str, top_k: int) -> list[dict]:
        return search_hits(self.store, self.embedder, question, top_k)

    def compare(self, question: str, answer: Answer, config: QueryConfig | None = None,
                max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
        """How `answer` (this session's answer to `question`) compares with full prefill of the
        same chunks: full prefill's answer and TTFT, whether the texts are the same, and the share of
        full prefill's tokens this context predicts when fed them (agreement that survives one
        different word). A method that kept every chunk is compared in its own order; one that
        dropped chunks (superposition) with full prefill of every retrieved chunk in the query's
        order, what answering without sparsecache would read. The answer's own config is compared
        unless `config` names another."""
        cfg = answer.config if config is None and answer.config is not None else self.configured(config)
        retrieved = [c["id"] for c in answer.chunks]
        kept_all = sorted(answer.context_ids) == sorted(retrieved)
        ref = self.query(question, cfg, method="full", reorder="none", order="given" if kept_all else cfg.order,
                         cake_split=None, selector_model=None, selector_layers=None, paths=None,
                         chunks=answer.context_ids if kept_all else retrieved, max_new_tokens=max_new_tokens)
        forced = self.query(question, cfg, chunks=retrieved, reference=ref.tokens, max_new_tokens=1)
        return {"answer": ref.answer, "ttft_ms": ref.timings_ms["ttft"], "same_answer": ref.answer == answer.answer,
                "token_agreement": forced.agreement, "tokens": len(ref.tokens), "context_tokens": ref.context_tokens}

    @_at_a_live_version
    def query(self, question: str, config: QueryConfig | None = None, *, top_k: int = TOP_K,
              chunks: list[str] | None = None, max_new_tokens: int = MAX_NEW_TOKENS, answer_prefix: str = "",
              reference: list[int] | None = None, logprobs: bool = False, **changes) -> Answer:
        """Answer `question` from the top_k retrieved chunks (or the given chunk ids), fused as
        `config` says; keyword `changes` override its fields (`method="none"`, `order="reverse"`).
        With `reference` (another answer's token ids), `agreement` also says how many of the
        reference's tokens this context would predict, teacher-forced (then the answer is
        generated from the same cache, the reference's tokens dropped from it again). With
        `logprobs`, the answer carries the distributions behind its tokens (and the reference's)."""
        check_question(question)
        if top_k < 1:
            raise ConfigError("--top-k must be at least 1")
        if config is None:  # the store's measured choice, unless these changes name a method
            config = QueryConfig() if "method" in changes else self.default_config()
        asked = self.configured(dataclasses.replace(config, **changes))
        watch = Stopwatch(self.device)
        with watch.step("retrieve"):
            # not the method `retrieve`: this query already checks its version once
            hits = search_hits(self.store, self.embedder, question, top_k) if chunks is None else \
                given_hits(self.store, chunks)
        ids = [h["id"] for h in hits]
        if not ids:
            raise ConfigError("nothing to answer from: the store returned no chunks" if chunks is None
                              else "--chunks is empty")
        if asked.order == "reverse":
            ids = ids[::-1]
        q_ids = question_ids(self.model, question, answer_prefix)
        p = self.plan(asked, ids)
        self._warn_if_too_long(p.context_tokens + len(q_ids) + max_new_tokens)
        cfg = p.config
        out = cfg.spec.prefilled(self.context(), ids, q_ids, cfg, watch)
        # the confidence gate (never on `full`: QueryConfig refuses it there)
        escalated = cfg.gate_margin is not None and margin(out.logits) < cfg.gate_margin
        if escalated:  # the confidence gate: the blended context is unsure of its first token; prefill instead
            out = methods.get("full").prefilled(self.context(), out.context_ids, q_ids, QueryConfig("full"), watch)
        with watch.step("first_token"):
            first = int(out.logits.argmax())
        timings = {s: round(watch.get(s, 0.0), 3) for s in STEPS}
        timings["ttft"] = round(sum(timings.values()), 3)
        position = out.context_tokens + len(q_ids)
        agreement = forced = None
        steps = [out.logits.float()] if logprobs else None
        with watch.step("generate"):
            if reference is not None:
                forced = forced_logprobs(out.logits, out.cache, position, reference, self.model)
                agreement = top1_agreement(forced, reference) / len(reference) if reference else 0.0
                truncate(out.cache, position)
            tokens = greedy_continue(first, out.cache, position, self.model, max_new_tokens, steps=steps)
        timings["generate"] = round(watch["generate"], 3)
        text = self.model.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        own = torch.stack(steps[: len(tokens)]).log_softmax(-1).cpu() if logprobs and tokens else None
        return Answer(answer=text, chunks=hits, timings_ms=timings, recomputed_tokens=out.recomputed,
                      bytes_read=out.bytes_read, context_tokens=out.context_tokens, method=cfg.method,
                      context_ids=out.context_ids, logits=out.logits, tokens=tokens, agreement=agreement,
                      logprobs=own, reference_logprobs=forced.cpu() if logprobs and forced is not None else None,
                      prefilled_under=p.prefilled_under, recompute_ratio=p.recompute_ratio, config=asked,
                      escalated=escalated)

    def plan(self, config: QueryConfig, ids: list[str]) -> Plan:
        """What a context of the chunks `ids` gets under `config` (its method named): `plan.plan` with this
        session's store, model, device and `costs`."""
        n = self.store.layout().context_tokens(self.store.chunk(c).token_length for c in ids)
        return plan(config, self.store, self.model.config, self.device.type, n, self.costs, len(ids))

    def default_config(self) -> QueryConfig:
        """What a query does when it names no method: the configuration `sparsecache calibrate`
        measured for this store version on this kind of device (`config.calibrated`), else
        QueryConfig's defaults. A choice measured only on another kind of device is not used (a
        warning says so, once per version)."""
        records = self.store.calibration()
        chosen, record = calibrated(records, self.device.type), device_record(records, self.device.type)
        if self._warned_at != self.store.version:
            if chosen is None and records:
                self._warned_at = self.store.version
                warnings.warn(f"{self.store.backend}: calibrated on {', '.join(sorted(records))}, not on "
                              f"{self.device.type}; using the default ({QueryConfig().method}). Run `sparsecache "
                              f"calibrate --device {self.device.type}` to measure this device's choice.", stacklevel=3)
            elif chosen is not None and missed_target(record):
                self._warned_at = self.store.version
                warnings.warn(f"{self.store.backend}: the calibrated choice for {self.device.type}, "
                              f"{record['label']}: {MISSED}", stacklevel=3)
        return chosen or QueryConfig()

    _warned_at: int | None = None

    def configured(self, config: QueryConfig | None = None) -> QueryConfig:
        """`config` with its method named: None is `default_config`; a config whose method is None
        takes `default_config`'s method and, unless it sets one, its ratio (`QueryConfig.over`)."""
        if config is None:
            return self.default_config()
        return config if config.method is not None else config.over(self.default_config())

    def prefill_under(self, config: QueryConfig | None = None) -> int:
        """The context tokens under which `config`'s queries prefill instead of reading the store
        (`plan.prefill_under` with this session's TTFT cost model)."""
        return prefill_under(self.configured(config), self.model.config, self.device.type, self.costs)

    def _warn_if_too_long(self, total: int) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and total > limit:
            warnings.warn(f"{total} tokens exceed the model's {limit} positions; expect worse answers "
                          "(use fewer or shorter chunks)", stacklevel=3)

    def raw_files(self, ids: list[str]) -> list[Path]:
        """One fp16 .safetensors of exact pre-RoPE keys/values per chunk in `raw_dir`, computed
        (after the shared prefix) for those not there yet (`raw.RawKV.make`)."""
        return self.raw.make(self.store, ids, self.model)

    @property
    def raw_dir(self) -> Path:
        return self.raw.root

    def context(self) -> QueryContext:
        """What a query method is handed: this session's model, device, store version, rates,
        selector models and raw-KV files."""
        return QueryContext(self.model, self.device, self.store, self.rates, self.selectors, self.raw, self._reuse)

    _reuse: Reuse | None = None

    @contextlib.contextmanager
    def reusing(self):
        """Inside the block, queries over the same chunks share the decoded chunks, and those of
        the same question the scorers' scores (`context.Reuse`): many configurations of one
        context cost one decode. Their timings are then not TTFTs."""
        self._reuse = Reuse()
        try:
            yield self
        finally:
            self._reuse = None


def margin(logits: torch.Tensor) -> float:
    """How far (nats) the likeliest next token leads the runner-up: the confidence gate's signal."""
    top = logits.float().log_softmax(-1).topk(2).values
    return float(top[0] - top[1])


def search_hits(store: KVStore, embedder, question: str, top_k: int, documents: list[str] | None = None) -> list[dict]:
    """The top_k chunks for `question` (id, doc_id, ordinal, score), best first; with
    `documents`, only among those documents' chunks."""
    q = embedder.embed([question])[0]
    return [_hit(c, round(s, 4)) for c, s in store.search(q, top_k, documents)]


def given_hits(store: KVStore, ids: list[str]) -> list[dict]:
    """Chunks named by id instead of retrieved, in `retrieve`'s shape (no score); an unknown
    id is a StoreError."""
    return [_hit(store.chunk(c), None) for c in ids]


def _hit(c, score: float | None) -> dict:
    return {"id": c.id, "doc_id": c.doc_id, "ordinal": c.ordinal, "score": score}


def ask(store: str | Path | KVStore, question: str, config: QueryConfig | None = None, *, model: str = "default",
        device: str = "cpu", dtype: str = DTYPE, top_k: int = TOP_K, chunks: list[str] | None = None,
        max_new_tokens: int = MAX_NEW_TOKENS, compare: bool = False, graphs: bool = False
        ) -> tuple[Answer, dict | None]:
    """One question, as `sparsecache query` asks it: a Session over `store` and its answer under
    `config` (None, or a config whose method is None: the store's measured choice,
    `Session.configured`) from the `top_k` retrieved chunks (or the given `chunks`), and with
    `compare` how it compares with full prefill of the same chunks (`Session.compare`; None without);
    `graphs`: `Session`'s."""
    check_question(question)  # before the model loads
    session = Session(store, model, device, dtype=dtype, warm_retrieval=chunks is None, graphs=graphs)
    answer = session.query(question, config, top_k=top_k, chunks=chunks, max_new_tokens=max_new_tokens)
    if not compare:
        return answer, None
    return answer, session.compare(question, answer, max_new_tokens=max_new_tokens)
