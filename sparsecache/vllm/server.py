"""`sparsecache serve STORE`: vLLM's OpenAI-compatible server, with retrieval and KV injection inside.

A client sends an ordinary chat (or completion) request; the server takes the last user
message as the question, retrieves the top-k chunks from the store (its FAISS index and
embedder), lays the prompt out exactly as `sparsecache query` does (the store's prefix, the
chunks, the question in the chat template) and names the chunks to `SparsecacheConnector`,
which injects their KV (blended with the question, by default) instead of prefilling them.
The answer carries the chunks it used in an extra `sparsecache` field (in the first event of
a stream).

Everything else is vLLM's own server, reused as it is: the engine (AsyncLLM), the FastAPI app
with its routes (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics), the
protocol models and their validation, streaming, the error shape, the bearer-token middleware
(`--api-key`) and the Prometheus metrics. The chat and completion handlers are wrapped after
vLLM builds the app (retrieval before, sources after); the prompt goes in through vLLM's public
request fields: a completion's `prompt` as token ids, a chat's as `kv_transfer_params
["prompt_token_ids"]`, which vLLM's renderer uses instead of templating the messages (its
decode-side token reuse). Every vLLM internal this touches is in `hooks.py`, with a test that
fails when one changes.

Per-request options go in the body's `sparsecache` object (OpenAI clients: `extra_body`):
`top_k`, `chunks` (ids instead of retrieval), `documents` (retrieve only among these document
ids), `method`, `recompute_ratio`, `prefill_under` (the cheap-context threshold, `query.cheap`).
They are namespaced because the body's own `top_k` is
vLLM's sampling parameter.

Versions: a nightly `encode-corpus` publishes a new version; a background thread looks for it
every --version-poll seconds, opens it and reads what requests need (index, chunk table), then
moves new requests onto it; no request waits on a listing of the store. The connector serves
each request's chunks from the one version the request was laid out for (or prefills them if
it is gone), so no answer mixes two versions.

Outages: every operation on an object store ends within --store-timeout seconds. A request
whose chunks this process has read before is answered from memory; one that needs the store
while it does not answer gets 503 with one line (which store, what failed, that the server keeps
retrying) within that bound, and while the store is known down, at once. A local store's damaged
chunk file gets 500 with one line naming it. /ready reports the store's state (503 while it
does not answer), /metrics counts store errors, and the poller's first successful listing
reopens the store to requests: no restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from http import HTTPStatus
from typing import TYPE_CHECKING

from ..errors import ConfigError, SparseCacheError, StoreCorrupt, StoreUnavailable
from ..query import cheap
from ..query.plan import plan
from ..query.config import (MISSED, QueryConfig, calibrated, chosen_budget, device_record, missed_target,
                            served_config)
from . import hooks
from .config import ServeConfig

if TYPE_CHECKING:  # the CLI imports this module for ServeConfig; torch and vLLM load when serving starts
    from .serving import RagRequest

MAX_TOP_K = 64
FIELD = "sparsecache"  # the request's options and the response's sources, in the body
GiB = 1 << 30
# On a CPU vLLM reserves --gpu-memory-utilization (0.92) of its NUMA node's memory by default, and
# refuses to start where less is free (one node may hold a fraction of the machine's memory). serve
# sizes the KV cache itself instead: enough for vLLM's own default of requests at the model's
# length, at most this share of what is free on that node, at least one request of full length.
KV_CACHE_SHARE = 0.5
CPU_MAX_NUM_SEQS = 128  # vLLM's default --max-num-seqs for its OpenAI server on a CPU


BLEND_OPTIONS = ("method", "recompute_ratio", "prefill_under", "ttft_budget", "gate_coverage")  # how a request blends
OPTIONS = ("top_k", "chunks", "documents", *BLEND_OPTIONS)


class Refused(Exception):
    """A request the server answers with an error status (one line, OpenAI's error shape)."""

    status, err_type, outcome = HTTPStatus.BAD_REQUEST, "BadRequestError", "bad_request"


class BadRequest(Refused, ValueError):
    """400: the request is malformed or names what the store does not hold."""


class StoreDown(Refused):
    """503: the store did not answer within --store-timeout; the server keeps retrying."""

    status, err_type, outcome = HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError", "store_unavailable"


class StoreDamaged(Refused):
    """500: the store answered with damaged or missing data (`sparsecache verify` lists it)."""

    status, err_type, outcome = HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError", "store_damaged"


def refusal(e: Exception, store: str, timeout_s: float) -> Refused | None:
    """The response for an error a request met reading the store, or None where it is none of
    the store's (a bug keeps its traceback)."""
    from ..store.backend import describe, unavailable_kind

    retrying = "the server keeps retrying and answers from the store once it does"
    if isinstance(e, StoreUnavailable):
        return StoreDown(f"{e}; {retrying}")
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return StoreDown(f"{store}: the store did not answer within {timeout_s:g} s; {retrying}")
    if isinstance(e, StoreCorrupt):
        return StoreDamaged(f"the store is damaged: {str(e).splitlines()[0]} (`sparsecache verify {store}` lists "
                            "all damage)")
    kind = unavailable_kind(e)
    if kind is not None:  # e.g. an obstore error from a read zarr made
        return StoreDown(f"{store}: object storage did not answer ({describe(e, kind, timeout_s)}); {retrying}")
    if isinstance(e, OSError):  # a local store's disk: an unreadable file, an I/O error
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return StoreDown(f"{store}: the store could not be read: {e.strerror or type(e).__name__}{where}; "
                         f"`sparsecache verify {store}` checks it")
    return None


class Rag:
    """Retrieval and layout for the server: one RagPrompts following the store's versions, the
    per-request options checked, and the server's own Prometheus metrics."""

    def __init__(self, cfg: ServeConfig):
        import torch
        from prometheus_client import REGISTRY, Counter, Histogram

        from .serving import RagPrompts

        self.cfg = cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # where vLLM runs: whose calibration applies
        self._calibrated: dict[int, QueryConfig | None] = {}
        self.prompts = RagPrompts(cfg.store, cfg.model, follow_s=cfg.version_poll, timeout_s=cfg.store_timeout)
        self.prompts.store.warm()  # the index files into the page cache (a thread) while vLLM starts
        self._lock = threading.Lock()  # one embedding and FAISS search at a time; each takes milliseconds
        self.prompts.retrieve("warm-up", 1)  # the embedder loads now, not in the first request
        self.requests = Counter("sparsecache_server_requests", "RAG requests by endpoint and outcome",
                                ["endpoint", "outcome"])
        self._collector = StoreCollector(self)
        REGISTRY.register(self._collector)
        self.retrieval = Histogram("sparsecache_server_retrieval_seconds", "retrieval and layout time per request",
                                   buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.chunks = Histogram("sparsecache_server_chunks_per_request", "chunks laid out per request",
                                buckets=(1, 2, 4, 8, 16, 32, 64))

    def close(self) -> None:
        """Stop following the store and take this server's metrics off the process's registry."""
        from prometheus_client import REGISTRY

        self.prompts.close()
        for m in (self.requests, self.retrieval, self.chunks, self._collector):
            REGISTRY.unregister(m)

    def options(self, body: dict | None) -> dict:
        """The request's `sparsecache` options, checked."""
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise BadRequest('"sparsecache" must be an object')
        unknown = sorted(set(body) - set(OPTIONS))
        if unknown:
            raise BadRequest(f'unknown "sparsecache" option(s) {", ".join(unknown)}; known: {", ".join(OPTIONS)}')
        top_k = body.get("top_k", self.cfg.top_k)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_TOP_K:
            raise BadRequest(f"top_k must be a whole number from 1 to {MAX_TOP_K}, got {top_k!r}")
        for key in ("chunks", "documents"):
            v = body.get(key)
            if v is not None and (not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v)):
                raise BadRequest(f"{key} must be a non-empty list of strings")
        try:  # the request's method and ratio, parsed once: `request` passes on the typed value
            given = {k: body[k] for k in BLEND_OPTIONS if k in body}
            base = self.cfg.blend if "method" in given else self.base()
            blend = served_config(given, base, "sparsecache")
        except ConfigError as e:
            raise BadRequest(str(e)) from None
        return {"top_k": top_k, "chunks": body.get("chunks"), "documents": body.get("documents"), "blend": blend}

    def base(self) -> QueryConfig:
        """What a request that names no method does: the server's --method where given, else the
        calibrated choice of the store version being served for this kind of device
        (`calibrate`, `served_calibration`), else the default."""
        if self.cfg.method is not None:
            return self.cfg.blend
        store = self.prompts.store
        if store.version not in self._calibrated:
            self._calibrated = {store.version: served_calibration(store.calibration(), self.device, self.cfg)}
        return self._calibrated[store.version] or self.cfg.blend

    @property
    def cutoff(self) -> float:
        """Seconds after which a request's retrieval and layout is answered 503 whatever holds it
        (a local disk that hangs): twice --store-timeout, which bounds each operation on an
        object store (a request makes few, and none once the store is known down)."""
        return 2 * self.cfg.store_timeout

    @property
    def store_url(self) -> str:
        return str(self.prompts.store.root)

    def ready(self) -> tuple[bool, dict]:
        """Whether the store answers (as the last reads and the poller's last listing found), and
        the state /ready reports."""
        poller, state = self.prompts.poller, self.prompts.store.backend.health.state()  # a server always follows
        up = state["reachable"] and not poller.unreachable
        return up, {"store": self.store_url, "version": self.prompts.store.version, "reachable": up,
                    "unreachable_since": state["since"],
                    "error": state["error"] or (poller.last_error if poller.unreachable else None),
                    "store_errors": state["errors"], "version_polls": poller.polls,
                    "version_poll_failures": poller.failures,
                    # a newer version the poller cannot open (damaged, say): the one before is served meanwhile
                    "new_version_error": None if poller.unreachable else poller.last_error}

    def request(self, question: str, opts: dict) -> RagRequest:
        t = time.perf_counter()
        with self._lock:
            try:
                req = self.prompts.request(question, opts.get("top_k", self.cfg.top_k), chunks=opts.get("chunks"),
                                           documents=opts.get("documents"))
            except Exception as e:
                refused = refusal(e, self.store_url, self.cfg.store_timeout)
                if refused is not None:
                    raise refused from None
                if isinstance(e, SparseCacheError):
                    raise BadRequest(str(e)) from None
                raise
        self.retrieval.observe(time.perf_counter() - t)
        self.chunks.observe(len(req.chunks))
        blend = opts.get("blend") or self.base()
        # one plan, as `query` makes it (`query.plan`): a cheap context is prefilled by vLLM, laid out as
        # text, and the connector, told to prefill every context, leaves it alone; else a budget's ratio
        # at this context's length is fixed here
        p = plan(blend, self.prompts.store, self.prompts.model_config, self.device, req.context_tokens)
        if p.prefill:
            req = req.as_text()
            req.params.update({"method": blend.method, "prefill_under": PREFILL_ALL})
            req.prefilled = True
            return req
        req.params.update({"method": p.blend.method, "recompute_ratio": p.blend.ratio})  # the ratio in effect: one salt
        if p.blend.prefill_under is not None:
            req.params["prefill_under"] = p.blend.prefill_under
        if p.blend.gate_coverage is not None:  # the confidence gate raises the ratio in the connector (and the salt)
            req.params["gate_coverage"] = p.blend.gate_coverage
        return req

    def sources(self, req: RagRequest) -> dict:
        """What a response says it used: the chunks in retrieval order (best first) and the version."""
        hits = req.chunks[::-1] if QueryConfig.order == "reverse" else req.chunks
        return {"chunks": [{"id": h["id"], "doc_id": h["doc_id"], "score": h["score"]} for h in hits],
                "version": req.params["version"], "method": "full" if req.prefilled else req.params["method"],
                "recompute_ratio": req.params.get("recompute_ratio")}


class StoreCollector:
    """/metrics: the store's reachability and this process's failed operations on it, read at
    each scrape from the backend's `Health` and the version poller."""

    def __init__(self, rag: Rag):
        self.rag = rag

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up, state = self.rag.ready()
        yield GaugeMetricFamily("sparsecache_server_store_reachable", "1 while the store answers, 0 while not",
                                value=int(up))
        errors = CounterMetricFamily("sparsecache_server_store_errors", "operations on the store that got no answer, "
                                     "by kind (timeout: none within --store-timeout; unreachable: refused, reset)",
                                     labels=["kind"])
        for kind in ("timeout", "unreachable"):
            errors.add_metric([kind], state["store_errors"].get(kind, 0))
        yield errors
        yield CounterMetricFamily("sparsecache_server_version_poll_failures", "looks for a new version that failed",
                                  value=state["version_poll_failures"])


PREFILL_ALL = cheap.PREFILL_ALL  # a cheap-context threshold no context reaches: vLLM prefills every request


def served_calibration(records, device: str, cfg: ServeConfig) -> QueryConfig | None:
    """A calibrated choice (`config.calibrated`) as the server can serve it: `full` as vLLM's
    own prefill of every request (the cheap-context path), a method the connector serves as it
    is (at `--recompute-ratio` where the server was given one, as `query` does); None where there
    is no choice for this device, or it is a method only `query` has."""
    chosen = calibrated(records, device)
    if chosen is None:
        return None
    record = device_record(records, device)
    if missed_target(record):  # said once per version served (`Rag.base` keeps the choice per version)
        logging.getLogger(__name__).warning("the store's calibrated choice for %s, %s: %s", device, record["label"],
                                            MISSED)
    if chosen.method == "full":
        return served_config({"prefill_under": PREFILL_ALL}, cfg.blend, "the store's calibration")
    ratio = cfg.recompute_ratio if cfg.recompute_ratio is not None else chosen.recompute_ratio  # a ratio given wins
    given = {"method": chosen.method, "recompute_ratio": ratio,
             "ttft_budget": chosen_budget(cfg.blend.ttft_budget, ratio, chosen)}
    try:
        return served_config(given, cfg.blend, "the store's calibration")
    except ConfigError:  # e.g. superposition, measured with `calibrate --candidates`: query's alone
        return None


def refuse_unrendered(request) -> None:
    """A chat request vLLM would template itself, ignoring our prompt (`hooks.use_prompt`): `echo`, and
    messages with other than text content. Refused (400) rather than answered without the chunks."""
    if getattr(request, "echo", False):
        raise BadRequest("echo is not supported: the prompt is the store's chunks and the question, not the messages")
    for m in request.messages:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            raise BadRequest("only text content is supported in messages")


def question_of(messages: list) -> str:
    """The last user message's text (string content, or the text parts of a list)."""
    for m in reversed(messages):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        if role != "user":
            continue
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str) or not content.strip():
            raise BadRequest("the last user message has no text: it is the question")
        return content
    raise BadRequest("no user message: the last user message is the question")


class RagHandler:
    """vLLM's chat or completion handler, with retrieval before it and the sources after it;
    everything else (attributes the app reads) is the wrapped handler's."""

    def __init__(self, inner, rag: Rag, endpoint: str):
        self._inner, self._rag, self._endpoint = inner, rag, endpoint

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def create_chat_completion(self, request, raw_request=None):
        return await self._serve(request, raw_request, self._inner.create_chat_completion)

    async def create_completion(self, request, raw_request=None):
        return await self._serve(request, raw_request, self._inner.create_completion)

    async def _serve(self, request, raw_request, call):
        rag, endpoint = self._rag, self._endpoint
        try:
            opts = rag.options((request.model_extra or {}).pop(FIELD, None))
            if endpoint == "chat":
                question = question_of(request.messages)
                refuse_unrendered(request)
            elif isinstance(request.prompt, str):
                question = request.prompt
            else:
                raise BadRequest("prompt must be one string: the question")
            try:  # a backstop: each store operation ends within the bound; this holds whatever the store does
                req = await asyncio.wait_for(asyncio.to_thread(rag.request, question, opts), rag.cutoff)
            except asyncio.TimeoutError as e:
                raise refusal(e, rag.store_url, rag.cutoff) from None
        except Refused as e:
            rag.requests.labels(endpoint, e.outcome).inc()
            return hooks.error_response(str(e), e.err_type, e.status)
        # the server's kv_transfer_params, never the client's; our prompt in place of the messages' template
        hooks.use_prompt(request, req.prompt_token_ids, req.kv_transfer_params, chat=endpoint == "chat")
        # prefix-cache blocks are reused only where they hold the same KV (RagRequest.cache_salt)
        request.cache_salt = req.cache_salt if not request.cache_salt else f"{request.cache_salt}|{req.cache_salt}"
        result = await call(request, raw_request)
        if hooks.is_error(result):
            rag.requests.labels(endpoint, "error").inc()
            return result
        rag.requests.labels(endpoint, "ok").inc()
        sources = rag.sources(req)
        if hasattr(result, "__aiter__"):
            return _with_sources(result, sources)
        setattr(result, FIELD, sources)  # the protocol models keep extra fields
        return result


async def _with_sources(stream, sources: dict):
    """A stream of server-sent events whose first data event also carries the sources."""
    first = True
    async for event in stream:
        if first and event.startswith("data: {"):
            body = json.loads(event[len("data: "):])
            body[FIELD] = sources
            event = f"data: {json.dumps(body)}\n\n"
            first = False
        yield event


def vllm_args(cfg: ServeConfig, store, model_config=None):
    """vLLM's own server arguments for `cfg` and the opened `store` (parsed by vLLM's parser, so
    every vLLM option in `cfg.vllm_args` works and its defaults stay vLLM's), with the KV cache
    sized by `kv_cache_bytes` on a CPU. Settings that cannot start raise ConfigError here, before
    any engine process exists."""
    import torch
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..model.gguf import for_recorded, model_dir

    connector = {"kv_connector": "SparsecacheConnector", "kv_connector_module_path": "sparsecache.vllm",
                 "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"store": str(store.root), "version_check_s": cfg.version_poll,
                                               "store_timeout_s": cfg.store_timeout,
                                               "method": cfg.blend.method, "recompute_ratio": cfg.recompute_ratio,
                                               "prefill_under": cfg.prefill_under}}
    on_gpu = torch.cuda.is_available()
    dtype = cfg.dtype
    if dtype == "auto" and not on_gpu:
        dtype = "float32"
    name = cfg.served_model_name or store.attrs["model"].get("name") or "default"
    path = model_dir(for_recorded(cfg.model, store.attrs["model"]))  # `default`: the store's own packaged model
    argv = ["--model", str(path), "--host", cfg.host, "--port", str(cfg.port), "--dtype", dtype,
            "--served-model-name", name, "--kv-transfer-config", json.dumps(connector)]
    if cfg.api_key:
        argv += ["--api-key", cfg.api_key]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    try:
        args = make_arg_parser(FlexibleArgumentParser(prog="sparsecache serve")).parse_args(argv + list(cfg.vllm_args))
        validate_parsed_serve_args(args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"vLLM's options: {str(e).splitlines()[0]}") from None
    positions = getattr(model_config, "max_position_embeddings", None)
    if args.max_model_len and positions and args.max_model_len > positions:
        raise ConfigError(f"--max-model-len {args.max_model_len} is more than the model's {positions} positions")
    given = {a.split("=", 1)[0].replace("_", "-") for a in cfg.vllm_args if a.startswith("--")}
    if cfg.kv_cache_gb is not None:
        args.kv_cache_memory_bytes = int(cfg.kv_cache_gb * GiB)
        if not on_gpu:
            node, free = cpu_memory()
            if args.kv_cache_memory_bytes > free:
                raise ConfigError(f"--kv-cache-gb {cfg.kv_cache_gb:g} is more than the {free / GiB:.1f} GiB free on "
                                  f"NUMA node {node}: give less, or free memory")
    elif not on_gpu and not given & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"} \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        model = store.attrs["model"]
        per_token = 2 * int(model["layers"]) * int(model["m"]) * (4 if args.dtype in ("float32", "float") else 2)
        node, free = cpu_memory()
        args.kv_cache_memory_bytes = kv_cache_bytes(per_token, args.max_model_len or positions or 4096,
                                                    args.max_num_seqs or CPU_MAX_NUM_SEQS, free, node)
    return args


def _import_notices_hidden():
    """vLLM logs notices while its server modules import (on a CPU: the warning "Triton is installed,
    but doesn't include CPU backend"): hidden meanwhile with vLLM's own `suppress_logging`, so that
    a start-up error is the command's only line. Errors pass; logging is as before afterwards."""
    import logging

    from vllm.logger import suppress_logging

    return suppress_logging(logging.WARNING)


def kv_cache_bytes(per_token: int, max_len: int, max_seqs: int, free: int, node: int = 0) -> int:
    """The KV cache `serve` reserves on a CPU: room for `max_seqs` requests of `max_len` tokens
    (`per_token` bytes each), at most KV_CACHE_SHARE of the `free` bytes on NUMA node `node`, and
    at least one request of `max_len` tokens (ConfigError where even that does not fit)."""
    one = per_token * max_len
    cap = int(KV_CACHE_SHARE * free)
    if one > cap:
        raise ConfigError(f"the KV cache needs {one / GiB:.2f} GiB for one request of {max_len} tokens, and "
                          f"{free / GiB:.2f} GiB is free on NUMA node {node} (serve takes at most "
                          f"{KV_CACHE_SHARE:.0%}): lower --max-model-len, free memory, or set --kv-cache-gb")
    return min(one * max_seqs, cap)


def cpu_memory() -> tuple[int, int]:
    """(NUMA node, bytes available on it) for the node vLLM's CPU worker allocates from: the node
    of the first CPU this process may run on, read as vLLM reads it (cgroup limits included)."""
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        node = get_allowed_cpu_list()[0].numa_node
        return node, int(get_memory_node_info(node).available_memory)
    except (ImportError, IndexError, OSError, KeyError, AttributeError):  # another vLLM, or no NUMA information
        import psutil

        return 0, int(psutil.virtual_memory().available)


def check_port(host: str, port: int) -> None:
    """ConfigError in one line if `host:port` cannot be listened on (taken, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --port or --host)") \
                from None


def add_ready_route(app, rag: Rag) -> None:
    """GET /ready: 200 while the store answers, 503 while it does not, with its state as JSON
    (vLLM's /health says whether the engine is up: a store outage must not get the process
    restarted, since requests held in memory are still answered)."""
    from fastapi.responses import JSONResponse

    @app.get("/ready")
    async def ready():
        up, state = rag.ready()
        return JSONResponse(state, status_code=200 if up else 503)


async def _run(cfg: ServeConfig, rag: Rag, args) -> None:
    """vLLM's own server, with our handlers installed between building the app and serving it."""

    def install(app, state, listen_address) -> None:
        if getattr(state, "openai_serving_chat", None) is None or getattr(state, "openai_serving_completion",
                                                                            None) is None:
            raise ConfigError(f"{args.model}: vLLM serves no chat or completion API for this model")
        state.openai_serving_chat = RagHandler(state.openai_serving_chat, rag, "chat")
        state.openai_serving_completion = RagHandler(state.openai_serving_completion, rag, "completion")
        add_ready_route(app, rag)
        print(f"sparsecache serve: {cfg.store} (version {rag.prompts.store.version}) on {listen_address}, "
              f"model {args.served_model_name[0]}", flush=True)

    await hooks.run_server(args, install)


def serve(cfg: ServeConfig) -> None:
    """Start the server and block until it is stopped (SIGINT/SIGTERM). What cannot start is
    found before vLLM's engine starts where it can be (ConfigError, one line)."""
    import uvloop

    with _import_notices_hidden():  # the modules the checks below import
        import vllm.entrypoints.launchers.cli_args  # noqa: F401

        from . import connector  # noqa: F401
    check_port(cfg.host, cfg.port)
    rag = Rag(cfg)  # the store opens and matches the model before anything heavy starts
    try:
        args = vllm_args(cfg, rag.prompts.store, rag.prompts.model_config)
        uvloop.run(_run(cfg, rag, args))
    except RuntimeError as e:
        if "initialization failed" not in str(e):
            raise
        raise ConfigError("vLLM's engine did not start; its log above says why") from None
    finally:
        rag.close()
