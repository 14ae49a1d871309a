"""SparsecacheConnector: vLLM serves RAG prompts with chunk KV decoded from a sparsecache store.

Load it out of tree (vLLM is not in the default install: `bash scripts/setup.sh vllm` adds it):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "SparsecacheConnector",
        "kv_connector_module_path": "sparsecache.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "corpus.store"}}'

A request opts in with `kv_transfer_params={"sparsecache": {"chunks": [ids...]}}` and a
prompt laid out as the store's prefix, those chunks' tokens, then anything else (the
question); `sparsecache.vllm.serving.RagPrompts` builds both.

Scheduler side: the prompt's leading tokens are checked token for token against the store
(prefix + the named chunks' token ids, at the version the request names, as RagPrompts does,
else the latest; a version deleted since is prefilled). Only an exact match
is claimed as externally computed; any mismatch, unknown chunk, unreadable store or
malformed parameter claims nothing, so vLLM prefills as usual, and logs one line.

Worker side, blending (the default, `sparsecache query`'s `infoflow` at its ratio): inside
`start_load_kv`, before the step's forward, the chunks are decoded and placed at their
global positions, the question (the prompt's tokens after the context) runs through vLLM's
own layers to score them, the selected tokens are recomputed through every layer attending
to the whole context, and the blended K/V of every context token are written into vLLM's
paged cache; vLLM then prefills the question. Scoring, selection and recomputation are
`sparsecache.query.blend`'s, run on vLLM's loaded layers and weights (`stack.py`; the model comes
from this package's vLLM plugin, `plugin.py`). Where the model cannot be driven (no plugin,
pipeline or tensor parallelism), the worker says so once at start-up and serves `none`.

Worker side, `method: none`: the chunks' codes are read once per request, decoded on vLLM's
device (all chunks of a request in one batched gather per layer group), keys rotated to
the global positions where they land, and written as they are.

A store encoded with a learned wrapper is served the same way: each chunk is laid out as
`header chunk trailer`, the soft tokens given as placeholder ids (`RagPrompts` does it), the
header's exact K/V placed before every chunk, and recomputation embeds a soft token it picks
from the store's own soft-token table (the prefix cache's salt names the wrapper).

A cheap context (`query.cheap`: too few chunk tokens to be worth reading) is left to vLLM's own
prefill, which is full prefill where the prompt is text. A wrapped store's context is text only
when laid out without its soft tokens (`RagRequest.as_text`, what `serve` sends for a cheap
context); laid out with them, the placeholder ids are not text, so it is read from the store.

Both write through the attention backend's own cache-update op and the request's slots, so
the layout is always the backend's (CPU, FlashAttention, Triton alike). A load or blend that
fails after the scheduler claimed it is reported through `get_block_ids_with_load_errors`,
and with `kv_load_failure_policy: "recompute"` vLLM recomputes those blocks: wrong KV is
never used.

`kv_connector_extra_config` (a request may override every field but store, raw_dir and
device in its `kv_transfer_params["sparsecache"]`):
    store            path or URL of the store (required)
    method           "infoflow" (default), "a3", "cacheblend", "cacheclip" or "none"
    recompute_ratio  fraction of chunk tokens recomputed (default: what ttft_budget buys, else the method's own:
                     infoflow 0.1, others 0.25)
    ttft_budget      with no recompute_ratio, the ratio whose predicted TTFT is this fraction of full prefill's
                     at the request's context length (default 0.5; `query.budget`: the store's `calibrate` refit
                     for the engine's device kind, else the constants measured for the device kind: a CPU's,
                     an H100's from 1.4B parameters; where there are none, the method's own ratio)
    group_window, group_min, score_layer, selector_layers, first_layer
                     as `sparsecache query`'s options of those names (first_layer "tokens", the default,
                     runs vLLM's own layer 0 on the tokens: where blending is off for the model, layer 0
                     comes from the codes) (QueryConfig's defaults;
                     cacheclip's selector is vLLM's model truncated to selector_layers)
    version_check_s  seconds between looks for a new store version, in a background thread
                     (default 1; 0: on every request, in the scheduler's thread)
    store_timeout_s  the most one operation on an object store may take (default: serve's
                     --store-timeout). A read that fails or times out is prefilled by vLLM
                     instead (counted in store_errors); while the store is known down, at once.
    source           "codes" (default) or "raw": exact fp16 KV files per chunk (the TurboRAG-
                     style baseline that `sparsecache query --method raw` makes), for testing
                     and comparison
    raw_dir          where the raw files are (default: beside the store, as `query` puts them)
    device           decode device (default: vLLM's)
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from ..codec import numba_pool
from ..errors import ConfigError, ModelError, SparseCacheError, StoreCorrupt
from ..kvstore.view import KVStore
from ..model.cache import recompute_many
from ..model.kvmodel import Rope, config_fingerprint
from ..query.blend import decode_chunks, restore_first_layer
from ..query.config import QueryConfig, served_config
from ..query.methods.base import choose_many
from ..query.methods.full import text_ids
from ..query.plan import plan
from ..query.raw import RawKV, read_raw
from ..stopwatch import Stopwatch
from ..store import VersionPoller, open_backend
from ..store.backend import unavailable_kind
from ..wrapper.apply import placeholder_id
from .config import ServeConfig
from .plugin import loaded_model
from .serving import PARAMS_KEY, context_ids
from .stack import UnsupportedModel, VLLMStack

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
COUNTERS = ("requests", "chunks", "tokens", "recomputed", "fallbacks", "prefilled_cheap", "load_errors",
            "store_errors")
KEEP_OPEN = 3  # store versions kept open (each holds its prefix KV and dictionary); older ones reopen on demand


def _starts(prompt: list[int], context: list[int]) -> bool:
    """Whether `prompt` is `context` and then at least one token (the question)."""
    return len(prompt) > len(context) and prompt[: len(context)] == context


@dataclass
class LoadSpec:
    """One request's load: tokens [start, end) of its prompt into its blocks."""

    req_id: str
    chunks: list[str]
    version: int
    source: str  # "codes" or "raw"
    start: int  # tokens vLLM already holds (its own prefix cache)
    end: int  # tokens claimed
    blend: QueryConfig = field(default_factory=QueryConfig)
    question: list[int] = field(default_factory=list)  # the prompt's tokens after the context
    cheap_context: bool = False  # under the cheap-context threshold: left to vLLM's prefill (`query.cheap`)
    block_ids: list[int] = field(default_factory=list)


@dataclass
class SparsecacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class SparsecacheStats(KVConnectorStats):
    """Counters since the last report: requests served, chunks, tokens injected, tokens
    recomputed by blending, decode and blend time, fallbacks (requests prefilled as usual)
    and load errors (blocks vLLM had to recompute)."""

    def __post_init__(self):
        for k in (*COUNTERS, "decode_ms", "blend_ms"):
            self.data.setdefault(k, 0)

    def reset(self):
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class SparsecachePromMetrics(KVConnectorPromMetrics):
    """`vllm:sparsecache_<counter>_total` on vLLM's /metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in (("requests", "requests served from the store"),
                          ("chunks", "chunks whose KV was injected"),
                          ("tokens", "prompt tokens whose KV was injected"),
                          ("recomputed", "injected tokens recomputed by blending"),
                          ("fallbacks", "requests naming chunks that were prefilled instead"),
                          ("prefilled_cheap", "requests whose few chunk tokens cost less to prefill than to load"),
                          ("load_errors", "blocks whose load failed and were recomputed"),
                          ("store_errors", "reads of the store that got no answer (their requests were prefilled)"),
                          ("decode_ms", "milliseconds spent reading, decoding, blending and writing KV"),
                          ("blend_ms", "milliseconds of those spent scoring and recomputing")):
            metric = self._counter_cls(name=f"vllm:sparsecache_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {e: metric.labels(*v) for e, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, per_engine in self._counters.items():
            if transfer_stats_data.get(name):
                per_engine[engine_idx].inc(transfer_stats_data[name])


class SparsecacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("store"):
            raise ConfigError('SparsecacheConnector needs kv_connector_extra_config={"store": PATH_OR_URL}')
        self.where = str(extra["store"])
        self.source = extra.get("source", "codes")
        if self.source not in ("codes", "raw"):
            raise ConfigError(f'SparsecacheConnector: source must be "codes" or "raw", got {self.source!r}')
        self.raw_dir = extra.get("raw_dir")
        for gone in ("recompute_tail", "layerwise"):  # removed: blending does their job (BENCHMARKS.md)
            if gone in extra:
                raise ConfigError(f"SparsecacheConnector: {gone} was removed; blending (method, recompute_ratio) "
                                 "recomputes the tokens the question needs instead")
        self.blend = served_config(extra, where="kv_connector_extra_config")  # parsed once, typed from here on
        self.block_size = vllm_config.cache_config.block_size
        self.dtype = vllm_config.model_config.dtype
        self.placeholder = placeholder_id(vllm_config.model_config.hf_config)  # for a wrapper's soft tokens
        # the cheap-context rule's inputs: the model's compute parameters and the engine's device
        self._model_config = vllm_config.model_config.hf_config  # --ttft-budget's cost model scales by its sizes
        self._device_type = vllm_config.device_config.device_type or "cpu"
        self._stores: dict[int, KVStore] = {}
        self._stores_lock = threading.Lock()  # the poller's thread opens versions too
        # a nightly re-index is followed within version_check_s seconds of publishing
        every = extra.get("version_check_s", ServeConfig.version_poll)
        if isinstance(every, bool) or not isinstance(every, (int, float)) or every < 0:
            raise ConfigError(f"version_check_s must be seconds >= 0, got {every!r}")
        timeout = extra.get("store_timeout_s", ServeConfig.store_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"store_timeout_s must be seconds > 0, got {timeout!r}")
        self._backend = open_backend(self.where, float(timeout))
        # the scheduler follows versions (and opens each new one off the engine's loop); the worker
        # only needs the store back after an outage, so it polls only while the store is down
        scheduler = role == KVConnectorRole.SCHEDULER
        self._latest = VersionPoller(self._backend, float(every), ready=self._store if scheduler else None,
                                     follow=scheduler, name=f"sparsecache-{role.name.lower()}-versions")
        # a missing or unreadable store, or one of another model, stops the engine here, not per request
        self._store().check_model(config_fingerprint(vllm_config.model_config.hf_config,
                                                     f"the model vLLM serves ({vllm_config.model_config.model})"))
        if self._store().config.linked:  # its trailers must be recomputed in every query: not done here yet
            raise ConfigError("this store was encoded with a linked wrapper, whose trailers every query recomputes; "
                              "the vLLM connector does not yet: serve it with `sparsecache serve`")
        # scheduler side
        self._plans: dict[str, LoadSpec] = {}
        self._to_load: dict[str, LoadSpec] = {}
        self._stats = SparsecacheStats()  # both sides report: fallbacks here, loads on the worker
        # worker side
        if role == KVConnectorRole.WORKER:
            self.rope = Rope.for_config(vllm_config.model_config.hf_config)
            self.device = torch.device(extra["device"]) if extra.get("device") else None
            self._layer_names: list[str] = []
            self._failed_blocks: set[int] = set()
            self.stack = self._stack(vllm_config)

    # ------------------------------------------------------------------ scheduler side

    def _store(self, version: int | None = None) -> KVStore:
        """The store at `version` (default: the latest published), opened once per version (what
        never changes, its dictionary and prefix, carried over from the newest one open)."""
        if version is None:
            version = self._latest()
        with self._stores_lock:
            store = self._stores.get(version)
        if store is None:
            with self._stores_lock:
                newest = self._stores[max(self._stores)] if self._stores else None
            store = (newest.at(version) if newest is not None else KVStore.open(self._backend, version))
            store.prepare(search=False)
            with self._stores_lock:
                store = self._stores.setdefault(version, store)
                for old in sorted(self._stores)[:-KEEP_OPEN]:  # a server outlives many nightly versions
                    del self._stores[old]
        return store

    def _store_error(self, e: Exception) -> None:
        if unavailable_kind(e) is not None:
            self._stats.data["store_errors"] += 1

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        self._plans.pop(request.request_id, None)
        if params is None:
            return 0, False
        try:
            spec = self._plan(request, params)
        except (SparseCacheError, KeyError, TypeError, ValueError, OSError) as e:
            spec = None
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._store_error(e)
        else:
            reason = "the prompt does not start with the store's prefix and those chunks' tokens"
        if spec is None:
            logger.warning("sparsecache: request %s is prefilled instead (%s)", request.request_id, reason)
            self._stats.data["fallbacks"] += 1
            return 0, False
        if spec.cheap_context:  # a few chunk tokens: vLLM prefills them (`query.cheap`)
            self._stats.data["prefilled_cheap"] += 1
            return 0, False
        spec.start = num_computed_tokens
        self._plans[request.request_id] = spec
        return max(0, spec.end - num_computed_tokens), False

    def _plan(self, request: "Request", params: dict) -> LoadSpec | None:
        chunks = params["chunks"]
        if not isinstance(chunks, list) or not chunks or not all(isinstance(c, str) for c in chunks):
            raise ConfigError('"chunks" must be a non-empty list of chunk ids')
        version = params.get("version")  # the version the prompt was laid out from: served from it while it exists
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ConfigError(f'"version" must be a version number, got {version!r}')
        store = self._store(version)
        expected = context_ids(store, chunks, self.placeholder)
        prompt = list(request.prompt_token_ids or [])
        # one plan, as `query` makes it (`query.plan`): cheap where the request's chunk tokens are under the
        # cheap-context threshold; else the method with a time budget's ratio at this context's length
        p = plan(served_config(params, self.blend, "kv_transfer_params"), store, self._model_config,
                 self._device_type, len(expected))
        cheap_context = p.prefill
        if not _starts(prompt, expected):
            # a wrapped store's cheap context laid out as text (`RagRequest.as_text`): vLLM's prefill is full prefill
            wrapped_as_text = store.header() is not None and _starts(prompt, text_ids(store, chunks))
            return LoadSpec(request.request_id, list(chunks), store.version, "codes", 0, 0, p.blend,
                            cheap_context=True) if cheap_context and wrapped_as_text else None
        if cheap_context and store.header() is not None:
            # laid out with soft tokens, whose placeholder ids vLLM would prefill as text: read from the store
            cheap_context = False
        source = params.get("source", self.source)
        if source not in ("codes", "raw"):
            raise ConfigError(f'"source" must be "codes" or "raw", got {source!r}')
        if source == "raw":
            missing = self._raw(store).missing(chunks)
            if missing:
                raise SparseCacheError(f"no raw KV file for chunk(s) {', '.join(missing)}")
        blend = p.blend
        # the whole context is claimed, blended or as stored; vLLM prefills the question
        return LoadSpec(request.request_id, list(chunks), store.version, source, 0, len(expected), blend,
                        prompt[len(expected):] if blend.recomputes else [], cheap_context=cheap_context)

    def _raw(self, store: KVStore) -> RawKV:
        return RawKV(store, self.raw_dir)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        spec = self._plans.pop(request.request_id, None)
        if spec is not None and num_external_tokens > 0:
            self._to_load[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SparsecacheMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._to_load:
                spec = self._to_load.pop(req.req_id)
                spec.block_ids = list(req.block_ids[0])
                meta.loads.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: all its blocks are new
            if req_id in self._to_load and req_id in cached.resumed_req_ids and cached.new_block_ids[i]:
                spec = self._to_load.pop(req_id)
                spec.block_ids = list(cached.new_block_ids[i][0])
                meta.loads.append(spec)
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = sorted(kv_caches, key=extract_layer_index)
        layers = int(self._store().attrs["model"]["layers"])
        if len(names) != layers:
            raise ModelError(f"SparsecacheConnector: vLLM has {len(names)} attention layers, the store {layers}")
        self._layer_names = names
        L = self._store().dictionary.config.layers_per_signal  # fixed for the store's life
        self._layer_groups = [(lo, min(len(names), lo + L)) for lo in range(0, len(names), L)]
        if self.device is None:
            self.device = next(iter(kv_caches.values())).device

    def _stack(self, vllm_config) -> VLLMStack | None:
        """vLLM's loaded model as blending's stack, or None (then blending requests are served
        as `none`, said once here)."""
        model = loaded_model(vllm_config.model_config)
        try:
            if model is None:
                raise UnsupportedModel("sparsecache's vllm.general_plugins entry point did not see the model load "
                                       "(reinstall sparsecache; if VLLM_PLUGINS is set, it must name sparsecache)")
            return VLLMStack(model, vllm_config)
        except UnsupportedModel as e:
            logger.warning("sparsecache: blending is off, requests are served with method none (%s)", e)
            return None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SparsecacheMetadata)
        if not meta.loads:
            return
        layers = [forward_context.no_compile_layers[n] for n in self._layer_names]
        # everything is written before the step's forward starts (blending runs vLLM's own layers)
        blended = [s for s in meta.loads if s.blend.recomputes and self.stack is not None]
        plain = [s for s in meta.loads if s not in blended]
        threads = torch.get_num_threads()
        self._timed(lambda: self._blend(blended, layers))
        self._timed(lambda: self._load_plain(plain, layers))
        # vLLM's CPU attention aborts the engine when the OpenMP thread count differs from the one
        # its metadata was planned with (what numba's pool start did: `numba_pool`): never leave
        # this step's forward another count than it had
        if numba_pool.put_back(threads):
            logger.warning("sparsecache: loading changed the OpenMP thread count; put back to %d", threads)

    def _timed(self, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self._stats.data["decode_ms"] += 1e3 * (time.perf_counter() - t0)

    def _load_plain(self, loads: list[LoadSpec], layers: list) -> None:
        """Read, decode and write every request's KV as stored, layer group by layer group."""
        plans = []
        for spec in loads:
            try:
                plans.append((spec, self._source(spec)))
            except (SparseCacheError, KeyError, ValueError, OSError, RuntimeError) as e:
                self._fail(spec, e)
        for lo, hi in self._layer_groups:
            for spec, groups in plans:
                if spec.block_ids and not self._failed(spec):
                    try:
                        k, v = groups(lo, hi)
                        k = self.rope.rotate_(k.float().contiguous(), torch.arange(k.shape[1], device=k.device), lo)
                        self._write(spec, self._heads(k), self._heads(v), layers[lo:hi])
                    except (SparseCacheError, ValueError, OSError, RuntimeError) as e:
                        self._fail(spec, e)
        for spec, _ in plans:
            if not self._failed(spec):
                self._served(spec)

    def _served(self, spec: LoadSpec, recomputed: int = 0) -> None:
        self._stats.data["requests"] += 1
        self._stats.data["chunks"] += len(spec.chunks)
        self._stats.data["tokens"] += spec.end - spec.start
        self._stats.data["recomputed"] += recomputed

    def _blend(self, specs: list[LoadSpec], layers: list) -> None:
        """`sparsecache query`'s fusion of the step's blending requests, on vLLM's layers: decode
        each one's chunks and place them at their positions, let each question's attention choose
        its tokens and recompute them through every layer, then write each whole context. The
        requests share each run through the layers (`methods.base.choose_many`, `model.cache.recompute_many`),
        each attending over its own context. A request that fails falls back as a failed load does
        (nothing of it written, its blocks reported, vLLM recomputes them); if the shared runs
        fail, each request is blended again alone, so one request cannot fail the others."""
        ready = []
        for spec in specs:
            try:
                ready.append((spec, self._context(spec)))
            except Exception as e:  # noqa: BLE001 -- whatever failed, wrong KV must not reach the model
                self._fail(spec, e)
        if not ready:
            return
        ctxs = [ctx for _, ctx in ready]
        try:
            t0 = time.perf_counter()
            positions = choose_many(ctxs, [s.question for s, _ in ready], [s.blend for s, _ in ready], self.stack)
            recompute_many(ctxs, positions, self.stack)
            self._stats.data["blend_ms"] += 1e3 * (time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            if len(ready) == 1:
                return self._fail(ready[0][0], e)
            logger.warning("sparsecache: blending %d requests together failed (%s: %s); each is blended alone",
                           len(ready), type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            for spec, _ in ready:
                self._blend([spec], layers)
            return
        for (spec, ctx), chosen in zip(ready, positions):
            cache = ctx.cache.layers  # post-RoPE (1, H, S, D) per layer
            try:
                self._write(spec, [c.keys[0].transpose(0, 1) for c in cache],
                            [c.values[0].transpose(0, 1) for c in cache], layers)
            except Exception as e:  # noqa: BLE001
                self._fail(spec, e)
            else:
                self._served(spec, int(chosen.numel()))

    def _context(self, spec: LoadSpec):
        """The request's prefix and chunks decoded into a model.cache.Context at their positions."""
        store = self._store(spec.version)
        self.stack.soft = store.soft()  # a wrapped store's soft tokens, where recomputation (and layer 0) picks them
        if spec.source == "raw":
            chunks = self._raw(store).chunks(store, spec.chunks).to(self.device)
        else:
            first = self.stack if spec.blend.first_layer == "tokens" else None
            chunks = decode_chunks(store, spec.chunks, self.device, Stopwatch(self.device), first)
        ctx = chunks.assemble(self.stack)
        if ctx.length != spec.end:
            raise StoreCorrupt(f"{ctx.length} context tokens decoded, {spec.end} claimed")
        return ctx

    def _source(self, spec: LoadSpec):
        """A function (lo, hi) → pre-RoPE (keys, values) [hi-lo, end, m] of the request's tokens
        [0, end) on the decode device. Reads everything it needs now (one read per request)."""
        store = self._store(spec.version)
        _, pk, pv = store.prefix()
        header = store.header()  # a wrapped store's: its exact K/V goes in front of every chunk
        dev = self.device

        def context(x: torch.Tensor, prefix: torch.Tensor, head: torch.Tensor | None, lengths: list[int]):
            """Layers' prefix, then each chunk (of x, the chunks' tokens concatenated) after the header."""
            pieces = x.split(lengths, 1) if head is not None else [x]
            head = [head.to(dev, x.dtype)] if head is not None else []
            return torch.cat([prefix.to(dev, x.dtype)] + [t for p in pieces for t in (*head, p)], 1)[:, : spec.end]

        if spec.source == "raw":
            raw, _ = read_raw(self._raw(store).files(spec.chunks))
            lengths = [rk.shape[1] for rk, _ in raw]
            k = context(torch.cat([rk.float() for rk, _ in raw], 1).to(dev), pk, header and header[1], lengths)
            v = context(torch.cat([rv.float() for _, rv in raw], 1).to(dev), pv, header and header[2], lengths)
            return lambda lo, hi: (k[lo:hi], v[lo:hi])
        codes = store.read_codes(spec.chunks)
        codec = store.codec()
        L = store.dictionary.config.layers_per_signal
        # layer 0 from the tokens (`blend.restore_first_layer`), through vLLM's own layer where blending has it
        first = self.stack if spec.blend.first_layer == "tokens" and self.stack is not None else None

        def group(lo: int, hi: int):
            g = slice(lo // L, -(-hi // L))
            k = codec.decode((codes.k.indices[g], codes.k.coefficients[g]), "k", dev, g)[: hi - lo]
            v = codec.decode((codes.v.indices[g], codes.v.coefficients[g]), "v", dev, g)[: hi - lo]
            if lo == 0 and first is not None:
                first.soft = store.soft()  # a wrapped store's trailer tokens are soft
                restore_first_layer([(k, v)], torch.from_numpy(codes.tokens), first)
            return (context(k, pk[lo:hi], header and header[1][lo:hi], codes.lengths),
                    context(v, pv[lo:hi], header and header[2][lo:hi], codes.lengths))

        return group

    def _heads(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[n, T, m] → n tensors [T, H, D]."""
        return list(x.unflatten(-1, (self.rope.n_kv_heads, self.rope.head_dim)))

    @torch.inference_mode()
    def _write(self, spec: LoadSpec, keys: list[torch.Tensor], values: list[torch.Tensor], layers: list) -> None:
        """Write tokens [start, end) of each layer's post-RoPE keys and values [≥ end, H, D]
        through the backend's own cache update (its layout, whatever it is)."""
        slots = self._slots(spec, keys[0].device)
        for k, v, layer in zip(keys, values, layers):
            k = k[spec.start: spec.end].to(self.dtype).contiguous()
            v = v[spec.start: spec.end].to(self.dtype).contiguous()
            layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)

    def _slots(self, spec: LoadSpec, device) -> torch.Tensor:
        t = torch.arange(spec.start, spec.end)
        blocks = torch.tensor(spec.block_ids, dtype=torch.long)
        if len(spec.block_ids) * self.block_size < spec.end:
            raise ValueError(f"request {spec.req_id}: {len(spec.block_ids)} blocks for {spec.end} tokens")
        return (blocks[t // self.block_size] * self.block_size + t % self.block_size).to(device)

    def _fail(self, spec: LoadSpec, e: Exception) -> None:
        self._store_error(e)
        logger.warning("sparsecache: loading request %s failed, vLLM recomputes it (%s: %s)", spec.req_id,
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        first, last = spec.start // self.block_size, math.ceil(spec.end / self.block_size)
        failed = set(spec.block_ids[first:last])
        self._failed_blocks |= failed
        self._stats.data["load_errors"] += len(failed)
        spec.block_ids = []  # nothing more is written for it

    def _failed(self, spec: LoadSpec) -> bool:
        return not spec.block_ids

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # everything was written in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: the store is written by `sparsecache encode-corpus`, never by serving

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, SparsecacheStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return SparsecacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return SparsecachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
