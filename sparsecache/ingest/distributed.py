"""Encoding on a Ray cluster: the driver plans and publishes, Ray Data actors encode regions.

The driver (inside `encode_corpus`, holding the store's lock or lease) tokenises the documents
to encode, cuts them into regions of about `batch_tokens` tokens, and gives each region a
token range that starts on a Zarr chunk boundary and chunk-table rows of its own. It sizes
the arrays, writes every region's table rows, and records the whole allocation in
`pending.json` before any worker starts. Each actor (model, dictionary and embedder loaded
once) runs the forward pass and Batch-OMP of a region and writes its tokens and codes
straight into the store's arrays: no two regions share a Zarr chunk, and no worker resizes
an array, so concurrent writers cannot lose each other's bytes. The embeddings come back to
the driver, which writes them and records the region's documents as done as regions finish.
Only the driver publishes.

After a crash (driver or cluster), the rerun keeps the documents recorded as done and
allocates new space past everything the crashed run allocated: a zombie worker of the dead
run can only ever write where nothing live will be. The space is reclaimed by `compact`.
A region whose worker dies is retried `RETRIES` times (Ray restarts the actor); after that
the job fails naming the region's documents, and the store stays at its last version.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..codec.omp import Screening
from ..dtypes import FORWARD_DTYPE
from ..dtypes import forward_dtype as resolve_forward_dtype
from ..errors import SparseCacheError
from ..failpoints import kill_worker, start_failure
from ..text.corpus import chunks

RETRIES = 2  # restarts of a dead actor, and retries of its region, before the job fails
STARTUP_ATTEMPTS = 3  # tries at an actor's start-up (loading model, dictionary, embedder) while it fails transiently
ROUND_TOKENS = 32_000_000  # tokens the driver plans at a time (~1 GB of token ids in its memory)


log = logging.getLogger(__name__)


class EncodeFailed(SparseCacheError):
    """A distributed encode gave up (a document kept killing its worker, or the cluster failed)."""


@dataclass
class Region:
    """Chunks of whole documents that one worker encodes into [token_start, token_end) and rows
    [row_start, row_start + len(chunks))."""

    id: int
    token_start: int
    row_start: int
    chunks: list[dict]  # a chunk-table row (corpus.Chunk.row) and its token_ids

    @property
    def tokens(self) -> int:
        return sum(len(c["token_ids"]) for c in self.chunks)

    @property
    def doc_ids(self) -> list[str]:
        return list(dict.fromkeys(c["doc_id"] for c in self.chunks))


def plan_regions(docs: list[tuple[str, list]], token_start: int, row_start: int, align: int,
                 region_tokens: int, first_id: int = 0) -> list[Region]:
    """Cut (doc id, [(chunk, what it reads)]) pairs into regions of whole documents of about
    `region_tokens` tokens, each starting at a multiple of `align` tokens (so no two share a Zarr
    chunk). What a chunk reads (`_rounds`: {} or its `before` token ids and `after` ids) travels
    with it to the worker."""
    regions: list[Region] = []
    current: list[dict] = []
    tok, row, size = token_start, row_start, 0

    def close():
        nonlocal tok, row, current, size
        start = -(-tok // align) * align
        regions.append(Region(first_id + len(regions), start, row, current))
        tok, row, current, size = start + size, row + len(current), [], 0

    for _, doc_chunks in docs:
        current += [{**c.row(), "token_ids": list(c.token_ids), **read} for c, read in doc_chunks]
        size += sum(len(c.token_ids) for c, _ in doc_chunks)
        if size >= region_tokens:
            close()
    if current:
        close()
    return regions


class RegionEncoder:
    """A Ray Data actor: model, codec and embedder loaded once; encodes one region per call."""

    def __init__(self, store: str, generation: str, model: str, device: str, batch_tokens: int, prefix: list[int],
                 screening: dict | None, forward_dtype: str = FORWARD_DTYPE):
        os.environ.pop("SPARSECACHE_PAUSE_AT", None)  # the driver's failpoints are not the workers'
        # Ray restarts a crashed actor but not one whose __init__ raised, and Ray Data fails
        # the job on the first such actor: what another attempt can cure is retried here.
        with_retries(lambda: self._load(store, generation, model, device,
                                                 screening and Screening(**screening)), STARTUP_ATTEMPTS,
                     "actor start-up")
        self.batch_tokens, self.prefix = batch_tokens, prefix
        self.forward_dtype = resolve_forward_dtype(forward_dtype, device)  # this machine's CPU decides "auto"

    def _load(self, store: str, generation: str, model: str, device: str, screening: Screening | None) -> None:
        from ..codec.coding import Codec
        from ..kvstore.index import Embedder
        from ..kvstore.view import KVStore
        from ..model.kvmodel import load_model, use_soft_tokens
        from ..store.layout import open_group

        start_failure()
        s = KVStore.open(store)
        self.backend, self.config = s.backend, s.config
        self.model = load_model(model, device=device)
        use_soft_tokens(self.model, s.soft())  # a wrapped store: its soft tokens, as the driver's model reads them
        self.codec = Codec(s.dictionary, s.config.coef_dtype, device, s.config.index_coding, screening)
        self.embedder = Embedder(s.config.embedder, device)
        self.group = open_group(self.backend, f"data/{generation}", mode="r+")

    def __call__(self, batch: dict) -> dict:
        out = {"region": [], "embeddings": [], "seconds": []}
        for raw in batch["region"]:
            region = Region(**json.loads(raw))
            out["region"].append(region.id)
            emb, secs = self.encode(region)
            out["embeddings"].append(emb.astype(np.float32).tobytes())
            out["seconds"].append(json.dumps(secs))
        return out

    def encode(self, region: Region) -> tuple[np.ndarray, dict]:
        """Write the region's tokens and codes into the store; returns its embeddings [n, dim]
        and the seconds of each phase."""
        import zarr

        from ..stopwatch import Stopwatch
        from ..store.writer import write_codes
        from .batch import code_batch

        attempt = self._attempt(region)
        kill_worker(region.doc_ids, attempt)
        watch = Stopwatch(self.model.device, unit=1.0)
        tok = region.token_start
        with zarr.config.set({"array.write_empty_chunks": True}):
            for part in _parts(region.chunks, self.batch_tokens):
                before = [self.prefix + c["before"] for c in part] if "before" in part[0] else self.prefix
                k, v = code_batch(self.model, self.codec, [c["token_ids"] for c in part], before,
                                  self.batch_tokens, watch.step, forward_dtype=self.forward_dtype)
                with watch.step("write"):
                    tokens = np.concatenate([np.asarray(c["token_ids"], np.int32) for c in part])
                    write_codes(self.group, tok, tokens, k, v, grow=False)
                tok += len(tokens)
        with watch.step("write"):
            self.backend.sync()  # this worker's files durable before the driver records the region done
        with watch.step("embed"):
            emb = self.embedder.embed([c["text"] for c in region.chunks])
        return emb, dict(watch)

    def _attempt(self, region: Region) -> int:
        """Leave a marker that this region was started (the driver names a region that keeps
        killing its worker from these); returns which attempt this is."""
        prefix = f"work/region-{region.id:06d}"
        self.backend.put(f"{prefix}/{uuid.uuid4().hex}", json.dumps({"docs": region.doc_ids}).encode())
        return len(self.backend.list(prefix))


def transient(error: BaseException) -> bool:
    """Whether another attempt may succeed: an I/O or network error anywhere in the chain of
    causes (a file raced away, an object store's hiccup), not a refusal (permissions,
    credentials, a wrong path) nor sparsecache's own verdict on its input."""
    try:
        from obstore.exceptions import GenericError, JoinError
        retryable: tuple = (OSError, GenericError, JoinError)
    except ImportError:
        retryable = (OSError,)
    refusal = (PermissionError, IsADirectoryError, NotADirectoryError)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, retryable) and not isinstance(error, refusal):
            return True
        error = error.__cause__ or error.__context__
    return False


def with_retries(fn, attempts: int, what: str, backoff_s: float = 1.0):
    """fn(), retried up to `attempts` times in all while it fails `transient`ly; each failure
    logged in one line with its cause. The last failure, or any other error, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if attempt == attempts or not transient(e):
                raise
            wait = backoff_s * 2 ** (attempt - 1) * (1 + random.random())
            log.warning("%s failed (attempt %d of %d: %s: %s); retrying in %.1f s", what, attempt, attempts,
                        type(e).__name__, (str(e).splitlines() or [""])[0][:200], wait)
            time.sleep(wait)


def _parts(chunk_list: list[dict], batch_tokens: int):
    """Consecutive runs of chunks of about `batch_tokens` tokens (the forward's batch)."""
    part, n = [], 0
    for c in chunk_list:
        part.append(c)
        n += len(c["token_ids"])
        if n >= batch_tokens:
            yield part
            part, n = [], 0
    if part:
        yield part


def encode_distributed(run) -> None:
    """Encode `run.work.sources` (an `encoder.EncodeRun`) on the Ray actors its options name (`workers` actors
    on a Ray started here, or the cluster at `ray_address`), into the store `run.writer` writes (see the
    module docstring). Each actor loads `options.model` (the default model or a directory every node can
    read), the store's own dictionary copy and its embedder.

    Works in rounds of about ROUND_TOKENS tokens, so the driver holds one round's token ids
    at a time however large the corpus is."""
    from tqdm.auto import tqdm

    from ..model.kvmodel import chunk_context_ids
    from ..wrapper.apply import store_wrapping
    from .after import After

    w, timer, config, options = run.writer, run.timer, run.config, run.options
    hashes = {s.id: s.hash for s in run.work.sources}
    header, trailer = store_wrapping(w.backend, run.model)  # wrapped: chunks after the header, trailers appended
    after = After(config.encode_after, tuple(header), tuple(trailer), dict(run.work.neighbours),
                  config.encode_after_chunks)
    actor = {"model": options.model, "device": options.device, "batch_tokens": options.batch_tokens,
             "prefix": chunk_context_ids(run.model, config.prefix, config.anchor) + header,
             "screening": run.screening and asdict(run.screening),
             "forward_dtype": options.forward_dtype}  # each actor's arguments (it resolves "auto" on its machine)
    n = _start_ray(options.workers, options.ray_address, options.device, timer)
    bar = tqdm(total=0, unit="tok", unit_scale=True, desc="encode", disable=not options.progress, dynamic_ncols=True)
    next_id = 0
    try:
        for docs in _rounds(run.work.sources, run.model.tokenizer, config.chunk_tokens, timer, trailer, after):
            start = max(w.tokens, w.finished_tokens), max(w.chunks, w.finished_chunks)
            size = _region_tokens(docs, options.batch_tokens, n)
            regions = plan_regions(docs, *start, config.zarr_chunk_tokens, size, next_id)
            next_id += len(regions)
            if not regions:
                continue
            bar.total += sum(r.tokens for r in regions)
            with timer.step("write"):
                end = _allocate(w, regions)
            w.backend.delete_tree("work")
            w.commit({}, *end, extra={"allocated_by": "distributed"})
            _encode_round(run, regions, end, hashes, actor, n, bar)
            w.rewind(*end)
    finally:
        bar.close()
    w.backend.delete_tree("work")


def _region_tokens(docs, batch_tokens: int, actors: int) -> int:
    """Tokens per region: a batch, or less where a round is small, so that every actor gets
    about four regions (a region holds whole documents, so it may still be larger)."""
    total = sum(len(c.token_ids) for _, doc_chunks in docs for c, _ in doc_chunks)
    return max(1, min(batch_tokens, total // (4 * actors)))


def _rounds(work, tokenizer, chunk_tokens: int, timer, trailer: tuple[int, ...] = (), after=None):
    """[(doc id, [(chunk, what it reads)])] lists of about ROUND_TOKENS tokens of whole documents,
    `trailer` (a wrapped store's) appended to every chunk's token ids; what a chunk reads is {} or,
    in a store encoded after other chunks (`after.After`), its `before` token ids and `after` ids."""
    from ..store.layout import AFTER

    docs, n = [], 0
    for s in work:
        doc_chunks = []
        with timer.step("chunk"):
            for c in chunks(s, tokenizer, chunk_tokens):
                read = {}
                if after is not None and after.active:
                    after.saw(c)
                    before, ids = after.context(c)
                    read = {"before": before, AFTER: ids}
                doc_chunks.append((replace(c, token_ids=tuple(c.token_ids) + trailer) if trailer else c, read))
        docs.append((s.id, doc_chunks))
        n += sum(len(c.token_ids) for c, _ in doc_chunks)
        if n >= ROUND_TOKENS:
            yield docs
            docs, n = [], 0
    if docs:
        yield docs


def _encode_round(run, regions, end, hashes, actor: dict, n, bar) -> None:
    """Run one round's regions on the actor pool; record each region's documents as it finishes."""
    w, report, timer = run.writer, run.report, run.timer
    by_id = {r.id: r for r in regions}
    def own() -> float:  # the driver's own writes and commits
        return timer["write"] + timer["commit"]

    t0, before = time.perf_counter(), own()
    try:
        for rid, emb, secs in _results(w, regions, actor, n):
            region = by_id[rid]
            with timer.step("write"):
                w.write_embeddings(region.row_start, np.frombuffer(emb, np.float32).reshape(len(region.chunks), -1))
            for k, v in json.loads(secs).items():
                report.worker_seconds[k] = report.worker_seconds.get(k, 0.0) + v
            with timer.step("commit"):
                w.commit(_documents(region, hashes), *end)
            report.chunks += len(region.chunks)
            report.tokens += region.tokens
            bar.update(region.tokens)
    except Exception as e:
        raise EncodeFailed(_failure(w, by_id, e)) from e
    finally:  # the wait for the workers: the round's wall time less the driver's own writes and commits
        timer["encode (ray)"] += time.perf_counter() - t0 - (own() - before)


def _allocate(w, regions: list[Region]) -> tuple[int, int]:
    """Size the arrays for every region and write their chunk-table rows; returns the extents."""
    end_tok = regions[-1].token_start + regions[-1].tokens
    end_row = regions[-1].row_start + len(regions[-1].chunks)
    for r in regions:
        rows = [{k: v for k, v in c.items() if k not in ("token_ids", "before")} for c in r.chunks]
        w.write_rows(r.row_start, r.token_start, rows, None)
    w.size_arrays(end_tok, end_row)
    return end_tok, end_row


def _documents(region: Region, hashes: dict[str, str]) -> dict[str, dict]:
    """The manifest entries of the documents in a finished region."""
    out: dict[str, dict] = {}
    tok, row = region.token_start, region.row_start
    for c in region.chunks:
        d = out.setdefault(c["doc_id"], {"first": row, "count": 0, "tokens": 0, "token_offset": tok,
                                         "hash": hashes[c["doc_id"]]})
        d["count"] += 1
        d["tokens"] += len(c["token_ids"])
        tok, row = tok + len(c["token_ids"]), row + 1
    return out


def _start_ray(workers: int, ray_address: str | None, device, timer) -> int:
    """Connect to (or start) the Ray cluster; returns how many actors to run."""
    try:
        import ray
    except ImportError:
        raise EncodeFailed("--workers/--ray-address need the ray extra: pip install 'sparsecache[ray]'") from None
    gpu = str(device).startswith("cuda")
    with timer.step("ray start"):
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, logging_level="warning")
            else:
                ray.init(num_cpus=max(workers, 1) + 1, num_gpus=1 if gpu else 0, include_dashboard=False,
                         log_to_driver=False, logging_level="warning")
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours moves by tokens; Ray's would print every 10 s
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    return workers or (int(ray.cluster_resources().get("GPU", 1)) if gpu else 2)


def _results(w, regions, actor: dict, n):
    """Yield (region id, embeddings bytes, seconds JSON) as regions finish on n Ray actors,
    each made with `actor` (RegionEncoder's arguments beyond the store's)."""
    import ray

    gpu = actor["device"].startswith("cuda")
    ds = ray.data.from_items([{"region": json.dumps(asdict(r))} for r in regions], override_num_blocks=len(regions))
    with warnings.catch_warnings():
        # Ray 2.60 has no named parameter for restarts yet; without them a document that
        # kills its worker is retried forever (Ray's default for a Data actor pool)
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        ds = ds.map_batches(
            RegionEncoder, batch_size=1,
            fn_constructor_kwargs={"store": str(w.backend.url), "generation": w.base.generation, **actor},
            compute=ray.data.ActorPoolStrategy(size=n), num_gpus=1 if gpu else 0, num_cpus=1,
            max_restarts=RETRIES, max_task_retries=RETRIES, runtime_env=_worker_env())
    for batch in ds.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=0):
        for rid, emb, secs in zip(batch["region"], batch["embeddings"], batch["seconds"]):
            yield int(rid), bytes(emb), str(secs)


def _worker_env() -> dict | None:
    """The test-only worker failpoints travel to the actors explicitly: Ray's workers inherit
    the environment of the process that started the cluster, not the driver's current one."""
    env = {k: os.environ[k] for k in ("SPARSECACHE_KILL_WORKER", "SPARSECACHE_FAIL_START") if os.environ.get(k)}
    return {"env_vars": env} if env else None


def _failure(w, by_id: dict[int, Region], error: Exception) -> str:
    """One line naming the documents of regions whose worker died RETRIES + 1 times, if any."""
    counts = {}
    for key in w.backend.list("work"):
        rid = int(key.split("/")[1].split("-")[1])
        counts[rid] = counts.get(rid, 0) + 1
    dead = [rid for rid, n in counts.items() if n > RETRIES]
    if dead:
        docs = sorted({d for rid in dead for d in by_id[rid].doc_ids})
        return (f"document(s) {', '.join(docs)} killed their worker {RETRIES + 1} times; nothing was published "
                f"(the store stays at version {w.base.version}; finished documents are kept for the rerun)")
    started = "" if "creation task" not in str(error) else "an actor could not start: "
    return f"distributed encode failed: {started}{_cause_line(error)[:300]}; nothing was published"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed)\b")


def _cause_line(error: BaseException) -> str:
    """The line that says what went wrong: Ray puts a worker's traceback inside its error's
    text, whose last 'SomeError: message' line is the cause; else the first line."""
    lines = [_ANSI.sub("", line).strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if _ERROR_LINE.match(line)]
    return causes[-1] if causes else (lines[0] if lines else type(error).__name__)
