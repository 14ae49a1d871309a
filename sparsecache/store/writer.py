"""The one writer of a store: lays it out, appends codes past the latest version, records
progress for a crashed run to resume from, builds the index and publishes new versions.

Writers only append past the latest manifest's extents; every array write replaces a whole
chunk object atomically (zarr's LocalStore and object stores alike), and chunks that hold
published data are rewritten with the same bytes. So a reader that pinned version N keeps
reading exactly N's data while N+1 is written, and a crash at any point leaves the latest
published version intact.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict

import numpy as np

from ..codec.codes import Codes
from ..durable import is_temporary
from ..errors import ConfigError, DictionaryMismatch, StoreError
from ..failpoints import failpoint
from ..model.fingerprint import check_same_model
from .backend import Backend, open_backend
from .calibration import FOLDER as CALIBRATION
from .calibration import read_calibration, write_calibration
from .layout import (ATTR, CODE_ARRAYS, FORMAT_VERSION, MARKER, TABLE_INT, DictionaryCopy, Indexer,
                     StoreConfig, compressors, config_attrs, create_generation, legacy_strings, now, open_group, put, root_attrs,
                     store_config, text_columns, write_strings)
from .versions import Manifest, manifest_key, publish, read_manifest, versions, writer_lock

PENDING = "pending.json"
INDEX_MERGE_RATIO = 2  # merge the newest index segment into the one before while that one holds at most 2x its rows
INDEX_MAX_SEGMENTS = 16  # past this the newest merge regardless of INDEX_SEGMENT_ROWS
INDEX_SEGMENT_ROWS = 2_000_000  # rows per index segment at most: building one holds ~1.5 GB of float16
# vectors, and a publish never rebuilds the corpus's index (10M chunks: five segments searched together)
INDEX_LIVE_SHARE = 0.5  # a segment with fewer of its rows live than this share is rebuilt over the live ones


def ours(backend: Backend) -> bool:
    """Whether a writer may create and delete inside the store's root: it is missing or empty
    (a `.lock` aside), carries the marker, or is a store made before the marker existed."""
    names = {n for n in backend.children("") if not is_temporary(n)} - {".lock", "lease.json"}
    if not names or MARKER in names:
        return True
    try:
        return "zarr.json" in names and bool(versions(backend)) and bool(root_attrs(backend))
    except StoreError:
        return False


def write_codes(group, tok0: int, tokens: np.ndarray, k: Codes, v: Codes, grow: bool = True) -> None:
    """Tokens [T] and codes [G, T, ·] at token position tok0 of a generation's arrays.

    `grow=False` (a distributed worker's region): the driver sized the arrays beforehand, and
    resizing here would race with the other workers over the arrays' metadata."""
    write = put if grow else _assign
    write(group["tokens"], tokens.astype(np.int32), tok0, axis=0)
    for name, data in zip(CODE_ARRAYS, (k.indices, k.coefficients, v.indices, v.coefficients)):
        write(group[name], data, tok0, axis=1)
        failpoint("append")  # a crash here leaves a torn batch: some arrays written, some not


def _assign(arr, data: np.ndarray, at: int, axis: int) -> None:
    sel = [slice(None)] * arr.ndim
    sel[axis] = slice(at, at + data.shape[axis])
    arr[tuple(sel)] = data


class Writer:
    """The one writer of a store (a path or an s3://, gs://, az:// URL).

    Use as a context manager; it holds the store's lock (or lease). Progress between versions
    is kept in `pending.json` after every `commit`, so a crashed run resumes instead of redoing work.
    """

    def __init__(self, where):
        self.backend = open_backend(where)
        self.lock = writer_lock(self.backend)

    @property
    def root(self):
        return self.backend.local_root or self.backend.url

    def __enter__(self):
        self.backend.check_root()
        self._refuse_foreign()  # before the lock: nothing is written into a directory that is not ours
        self.lock.acquire()
        try:
            self._refuse_foreign()  # and under it: a writer that held it has finished creating the store
        except StoreError:
            self.lock.release()
            raise
        if not self.backend.exists(MARKER):  # before anything else is created in it
            self.backend.put(MARKER, json.dumps({"created": now(), "format": FORMAT_VERSION}).encode())
        import zarr

        # every chunk is written even when it equals the fill value, so a missing file always means damage
        self._zarr_config = zarr.config.set({"array.write_empty_chunks": True})
        self._zarr_config.__enter__()
        if self.lock.stale:
            s = self.lock.stale
            warnings.warn(f"{self.backend}: took over a stale lock left by pid {s.get('pid')} on {s.get('host')} "
                          f"(since {s.get('since')}); resuming its work", stacklevel=2)
        return self

    def __exit__(self, *exc):
        self._zarr_config.__exit__(*exc)
        self.lock.release()

    def _refuse_foreign(self) -> None:
        if not ours(self.backend):
            raise StoreError(f"{self.backend} is not a sparsecache store: a non-empty directory sparsecache "
                             f"did not create (no {MARKER}); refusing to write into it")

    def sync(self) -> None:
        """Make everything written since the last sync durable (see `durable`)."""
        self.backend.sync()
        failpoint("sync")

    # -- creation

    def initialised(self) -> bool:
        return bool(versions(self.backend))

    def create(self, config: StoreConfig, dictionary: DictionaryCopy, model_fp: dict, prefix_ids: list[int],
               prefix_kv: tuple[np.ndarray, np.ndarray], embed_dim: int, indexer: Indexer,
               soft: np.ndarray | None = None) -> None:
        """Lay out a new store and publish an empty version 1 (overwrites a half-created one:
        `__enter__` has checked that this is a store sparsecache created). `prefix_kv` is the
        shared prefix's (keys, values) [n_layers, P, m]; with a wrapper, `prefix_ids` ends with
        the header's soft token ids (< 0) and `soft` holds the soft tokens [H + T, hidden]."""
        b = self.backend
        for sub in ("data", "prefix", "dictionary", "manifests", "meta", "index", CALIBRATION):
            b.delete_tree(sub)
        b.delete(PENDING)
        failpoint("create")
        root = open_group(b, mode="a")  # not "w": that would delete the held .lock
        prefix = root.create_group("prefix")
        k, v = prefix_kv
        for name, data in (("token_ids", np.asarray(prefix_ids, np.int32)), ("keys", np.asarray(k, np.float32)),
                           ("values", np.asarray(v, np.float32))):
            prefix.create_array(name, data=data, compressors=compressors("none"))
        if soft is not None:
            prefix.create_array("soft", data=np.asarray(soft, np.float32), compressors=compressors("none"))
        self._save_dictionary(dictionary)
        failpoint("create")
        create_generation(b, "g000001", config, dictionary.config, dictionary.model["layers"], embed_dim)
        fmt, fields = config_attrs(config)
        root.attrs[ATTR] = {"format": fmt, "config": fields, "model": model_fp,
                            "dictionary": dictionary.fingerprint(), "dictionary_config": asdict(dictionary.config),
                            "embed_dim": embed_dim, "created": now()}
        failpoint("create")
        m = Manifest(1, "g000001", created=now(), note="created", _backend=b)
        self.write_documents(m, {}, (), None)
        self.write_index(m, open_group(b, f"data/{m.generation}"), indexer, None)
        self.sync()
        publish(b, m)  # an empty version with an (empty) index: every version can be searched

    def _save_dictionary(self, dictionary: DictionaryCopy) -> None:
        import tempfile

        if self.backend.local_root is not None:
            dictionary.save(self.backend.local_root / "dictionary")
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.backend.put_dir(dictionary.save(tmp), "dictionary")

    def attrs(self) -> dict:
        return root_attrs(self.backend)

    def dictionary_dir(self):
        """A local directory holding the dictionary copy this (initialised) store decodes with."""
        return self.backend.fetch_dir("dictionary")

    def check_compatible(self, config: StoreConfig, dictionary: DictionaryCopy, model_fp: dict | None) -> None:
        """Refuse to append codes that would not mean the same as the ones already stored
        (`model_fp` None: check all but the model, which need not be loaded for that)."""
        a = self.attrs()
        if a["dictionary"] != dictionary.fingerprint():
            raise DictionaryMismatch(f"{self.backend} was encoded with dictionary {a['dictionary']}; "
                                     f"the one given is {dictionary.fingerprint()} (use the same --dict or a new store)")
        if model_fp:
            check_same_model(model_fp, a["model"], str(self.backend))
        stored = store_config(a)
        for key in ("chunk_tokens", "prefix", "coef_dtype", "index_coding", "embedder", "anchor", "wrapper",
                    "encode_after", "encode_after_chunks"):
            if getattr(stored, key) != getattr(config, key):
                raise ConfigError(f"{self.backend} was built with {key}={getattr(stored, key)!r}; "
                                  f"got {getattr(config, key)!r} (use a new store to change it)")

    # -- appending

    def begin(self) -> tuple[dict[str, dict], dict | None]:
        """Start appending after the latest version.

        Returns the documents a crashed run already finished, and the one it was in the
        middle of (or None); appending continues after the finished ones until `rewind`.
        """
        self.write_into(read_manifest(self.backend), None)
        self.tokens, self.chunks = self.base.tokens, self.base.chunks
        self.done: dict[str, dict] = {}
        open_doc = None
        pending = self.pending()
        if pending and pending["base"] == self.base.version and pending["generation"] == self.base.generation:
            self.tokens, self.chunks, self.done = pending["tokens"], pending["chunks"], pending["documents"]
            open_doc = (pending.get("open") or [None])[0]
        self.finished_tokens, self.finished_chunks = self.tokens, self.chunks
        return dict(self.done), open_doc

    def write_into(self, base: Manifest, generation: str | None) -> None:
        """Append into `generation` (default: `base`'s own) on top of version `base`."""
        self.base = base
        self.group = open_group(self.backend, f"data/{generation or base.generation}", mode="r+")
        self.legacy = legacy_strings(self.group)
        self.text_columns = text_columns(self.group)
        self._text_end: dict[str, tuple[int, int]] = {}  # column → (next row, its first byte)

    def pending(self) -> dict | None:
        """The progress a crashed run recorded since the last version, or None."""
        try:
            return json.loads(self.backend.get(PENDING))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            return None  # a torn write cannot happen (atomic put), but never trust it blindly

    def append(self, chunk_rows: list[dict], tokens: np.ndarray, k: Codes, v: Codes, embeddings: np.ndarray) -> int:
        """Append chunks (table rows), their tokens [T], codes [G, T, ·] and embeddings [n, dim].

        Returns the first new chunk row. Nothing is visible to readers until `publish`.
        """
        self.lock.check()  # a writer whose lease was taken must not write where the new one appends
        row0, tok0 = self.chunks, self.tokens
        self.write_codes(tok0, tokens, k, v)
        self.write_rows(row0, tok0, chunk_rows, embeddings)
        self.chunks, self.tokens = row0 + len(chunk_rows), tok0 + len(tokens)
        return row0

    def write_codes(self, tok0: int, tokens: np.ndarray, k: Codes, v: Codes) -> None:
        write_codes(self.group, tok0, tokens, k, v)

    def write_rows(self, row0: int, tok0: int, chunk_rows: list[dict], embeddings: np.ndarray | None) -> None:
        """Chunk-table rows from row0 (their tokens start at tok0), and their embeddings [n, dim]."""
        offsets = tok0 + np.concatenate([[0], np.cumsum([r["token_length"] for r in chunk_rows])[:-1]])
        # where each text column's bytes end after the rows this writer wrote last: saves a read
        # per column per batch; any other row0 (a rewind, a resumed run) reads it from the array
        known, ends = self._text_end, {}
        for col in self.text_columns:
            start = known[col][1] if col in known and known[col][0] == row0 else None
            ends[col] = (row0 + len(chunk_rows), write_strings(self.group, col, [r.get(col, "") for r in chunk_rows], row0,
                                                              self.legacy, start))
        self._text_end = ends
        for col, dtype in TABLE_INT.items():
            vals = offsets if col == "token_offset" else [r[col] for r in chunk_rows]
            put(self.group[col], np.asarray(vals, dtype=dtype), row0, axis=0)
        failpoint("append")
        if embeddings is not None:
            self.write_embeddings(row0, embeddings)

    def write_embeddings(self, row0: int, embeddings: np.ndarray) -> None:
        """Embeddings [n, dim] of rows row0.. (rows may be written in any order)."""
        arr = self.group["embeddings"]
        if arr.shape[0] < row0 + len(embeddings):
            put(arr, embeddings.astype(np.float32), row0, axis=0)
        else:
            _assign(arr, embeddings.astype(np.float32), row0, axis=0)

    def size_arrays(self, tokens: int, rows: int) -> None:
        """Resize the token-axis arrays and the embeddings to these extents (before workers write)."""
        for name in ("tokens", *CODE_ARRAYS):
            arr, axis = self.group[name], 0 if name == "tokens" else 1
            shape = list(arr.shape)
            shape[axis] = tokens
            arr.resize(tuple(shape))
        emb = self.group["embeddings"]
        emb.resize((rows, emb.shape[1]))

    def commit(self, documents: dict[str, dict], tokens: int, chunks: int, open_docs: list[dict] = (),
               extra: dict | None = None) -> None:
        """Record finished documents (the extents they end at) and any document still being
        written (its rows so far), so a crashed run resumes at this batch instead of redoing it."""
        if tokens < self.finished_tokens or chunks < self.finished_chunks:
            raise StoreError(f"{self.backend}: extents would move backwards ({self.finished_tokens} → {tokens} "
                             f"tokens, {self.finished_chunks} → {chunks} chunks); refusing to record them")
        self.lock.check()
        self.done.update(documents)
        self.finished_tokens, self.finished_chunks = tokens, chunks
        state = {"base": self.base.version, "generation": self.base.generation, "tokens": tokens,
                 "chunks": chunks, "documents": self.done, "open": list(open_docs), **(extra or {})}
        self.sync()  # pending.json must never record rows whose bytes could still be lost
        self.backend.put(PENDING, json.dumps(state).encode())
        failpoint("commit")

    def rewind(self, tokens: int, chunks: int) -> None:
        """Continue appending at these extents (drops rows of a document that was not finished)."""
        self.tokens, self.chunks = tokens, chunks

    # -- publishing

    def publish(self, changed: Mapping[str, dict], deleted: Iterable[str], indexer: Indexer,
                note: str = "") -> Manifest:
        """Publish a new version: the latest one with the documents `deleted` removed and the
        `changed` ones (new or re-encoded: {id: {hash, first, count, tokens, token_offset}}) put
        in; the index of the live chunks updated first."""
        m = Manifest(self.base.version + 1, self.base.generation, self.tokens, self.chunks, created=now(), note=note,
                     _backend=self.backend)
        self.write_documents(m, changed, deleted, self.base)
        self.write_index(m, self.group, indexer, self.base)
        failpoint("index")
        self.publish_manifest(m)
        return m

    def write_documents(self, m: Manifest, changed: Mapping[str, dict], deleted: Iterable[str],
                        base: Manifest | None) -> None:
        """Write `m`'s document table and live-row bitmap (`doctable`): on top of `base` (same
        generation, segmented) a segment of what changed, else `changed` as the whole table.

        The set algebra is `doctable.updated`'s."""
        from .doctable import appended, updated, write_live

        u = updated(changed, deleted, m.chunks, base if base is not None and base.generation == m.generation else None)
        m.segments = appended(self.backend, u.refs, u.segment)
        m.live = write_live(self.backend, u.live)
        m.n_documents, m.live_chunks, m.live_tokens = u.n_documents, int(u.live.sum()), u.live_tokens
        m.hold_live_rows(np.flatnonzero(u.live).astype(np.int64))

    def publish_manifest(self, m: Manifest, calibration: dict | None = None) -> None:
        """Make `m` the latest version: sync, create its manifest (never overwriting), drop pending.
        Its calibration (`calibration`) is `calibration` where given, else the base version's
        carried forward (or none), written before the manifest."""
        self.lock.check()
        write_calibration(self.backend, m.version,
                          calibration if calibration is not None else read_calibration(self.backend, self.base.version))
        self.sync()
        self.lock.check()
        publish(self.backend, m)
        failpoint("publish")
        self.backend.delete(PENDING)

    def publish_calibration(self, devices: dict, note: str) -> Manifest:
        """Publish the latest version again as a new one with `devices` as its calibration
        ({device kind: record}): the same documents, chunks and index, a new manifest. A crashed
        encode's progress (`pending.json`) stays resumable: it moves onto the new version, whose
        extents are the ones it was recorded on."""
        import dataclasses

        base = read_manifest(self.backend)
        self.base = base
        m = dataclasses.replace(base, version=base.version + 1, created=now(), note=note)
        pending = self.pending()
        self.lock.check()
        write_calibration(self.backend, m.version, devices)
        failpoint("calibrate")
        self.sync()
        self.lock.check()
        publish(self.backend, m)
        failpoint("publish")
        if pending and pending.get("base") == base.version and pending.get("generation") == base.generation:
            self.backend.put(PENDING, json.dumps({**pending, "base": m.version}).encode())
        return m

    def write_index(self, m: Manifest, group, indexer: Indexer, base: Manifest | None) -> None:
        """Index `m`'s live rows as segments. On top of `base` (same generation, segmented): one
        new segment over the rows appended since, merged with the segments before it while the
        newest of those holds at most INDEX_MERGE_RATIO times its live rows and the result stays
        within INDEX_SEGMENT_ROWS; a segment whose rows are mostly no longer live is rebuilt over
        the live ones. Else segments over every live row. Rows a segment holds that `m` no longer
        has live are filtered at search time by the live bitmap, so a deletion rewrites no index
        until it is most of a segment."""
        live = m.live_rows()

        def live_in(lo: int, hi: int) -> np.ndarray:
            return live[np.searchsorted(live, lo): np.searchsorted(live, hi)]

        same = base is not None and base.generation == m.generation and bool(base.index_segments)
        refs = list(base.index_segments) if same else []
        lo = base.chunks if same else 0
        while refs and (len(refs) >= INDEX_MAX_SEGMENTS or (
                len(live_in(refs[-1]["lo"], refs[-1]["hi"])) <= INDEX_MERGE_RATIO * len(live_in(lo, m.chunks))
                and len(live_in(refs[-1]["lo"], m.chunks)) <= INDEX_SEGMENT_ROWS)):
            lo = refs.pop()["lo"]
        kept = []
        for r in refs:
            rows = live_in(r["lo"], r["hi"])
            if len(rows) >= INDEX_LIVE_SHARE * r["rows"]:
                kept.append(r)
            elif len(rows):  # mostly deleted or replaced: its search would visit mostly dead rows
                kept.append(self._index_segment(m, group, indexer, rows, r["lo"], r["hi"]))
        rows = live_in(lo, m.chunks)
        for at in range(0, len(rows), INDEX_SEGMENT_ROWS):
            part = rows[at: at + INDEX_SEGMENT_ROWS]
            hi = int(rows[at + INDEX_SEGMENT_ROWS]) if at + INDEX_SEGMENT_ROWS < len(rows) else m.chunks
            kept.append(self._index_segment(m, group, indexer, part, lo if at == 0 else int(part[0]), hi))
        m.index_segments, m.index = kept, None
        m.index_kind = max(kept, key=lambda r: r["rows"])["kind"] if kept else None

    def _index_segment(self, m: Manifest, group, indexer: Indexer, rows: np.ndarray, lo: int, hi: int) -> dict:
        """One index segment over `rows` (live, ascending), covering rows [lo, hi)."""
        emb = group["embeddings"]
        first = int(rows[0])

        def read(pos: np.ndarray) -> np.ndarray:  # a contiguous block of rows, then the live ones in it
            r = rows[pos]
            if not len(r):
                return np.zeros((0, emb.shape[1]), np.float32)
            return emb[int(r[0]): int(r[-1]) + 1][r - r[0]]

        key = f"index/v{m.version:06d}-{first:012d}.faiss"
        if hasattr(indexer, "write"):  # built into a file: an index of any size, never all in memory
            kind = self.backend.put_built(key, lambda path: indexer.write(read, rows, emb.shape[1], path))
        else:
            data, kind = indexer.build(read(np.arange(len(rows))), rows)
            self.backend.put(key, data)
        return {"key": key, "lo": int(lo), "hi": int(hi), "rows": int(len(rows)), "kind": kind}

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` versions, and the generations, indexes and document-table
        pieces none of them uses."""
        vs = versions(self.backend)
        drop, kept = vs[:-keep], [read_manifest(self.backend, v) for v in vs[-keep:]]
        for v in drop:
            self.backend.delete(manifest_key(v))
            failpoint("prune")
            write_calibration(self.backend, v, {})  # after its manifest: a reader never sees a version without it
        used_gen = {m.generation for m in kept}
        used_idx = {r["key"] for m in kept for r in m.index_pieces()}
        used_meta = {r["key"] for m in kept for r in m.segments} | {m.live for m in kept if m.live}
        for g in self.backend.children("data"):
            if g != "zarr.json" and g not in used_gen:
                self.backend.delete_tree(f"data/{g}")
        for f in self.backend.children("index"):
            if f"index/{f}" not in used_idx:
                self.backend.delete(f"index/{f}")
        for kind in ("segments", "live"):
            for f in self.backend.children(f"meta/{kind}"):
                if f"meta/{kind}/{f}" not in used_meta and not is_temporary(f) and f != "zarr.json":
                    self.backend.delete_tree(f"meta/{kind}/{f}")
        return drop
