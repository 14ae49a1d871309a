"""The raw-KV baseline: each chunk's exact fp16 pre-RoPE K/V in its own `.safetensors` file
(a TurboRAG/LMCache-style store of uncompressed per-chunk KV), made on first use beside the
store. What the codec is measured against; `Session` (`--method raw`) and the vLLM connector
(`source: raw`) read it through `RawKV`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..durable import publish_file
from ..kvstore.view import KVStore
from ..model.cache import Context
from ..paths import cache_root
from ..stopwatch import Stopwatch
from .blend import DecodedChunks, stored_chunks


def default_raw_dir(store: KVStore) -> Path:
    """Where a store's raw-KV files go: beside a local store, in the user cache for a remote one."""
    root = store.backend.local_root
    if root is not None:
        return root.parent / (root.name + ".raw")
    return cache_root() / "raw" / hashlib.sha256(store.backend.url.encode()).hexdigest()[:16]


def raw_file(raw_dir: Path, chunk_id: str) -> Path:
    """The raw-KV file of one chunk."""
    return Path(raw_dir) / f"{chunk_id}.safetensors"


def read_raw(files: list[Path]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The fp16 pre-RoPE (keys, values) of raw-KV files, each [n_layers, T_chunk, m], and the bytes read."""
    from safetensors.torch import load

    blobs = [f.read_bytes() for f in files]
    return [(r["keys"], r["values"]) for r in map(load, blobs)], sum(map(len, blobs))


def raw_chunks(store: KVStore, ids: list[str], files: list[Path]) -> DecodedChunks:
    """The prefix and chunks `ids` with their exact fp16 K/V (on the host) from raw-KV `files`."""
    prefix, pk, pv = store.prefix()
    raw, nbytes = read_raw(files)
    return stored_chunks(store, prefix, (pk, pv), list(ids), store.tokens(ids), raw, nbytes)


def encoding_key(store: KVStore) -> str:
    """What a chunk's raw K/V depends on besides its tokens: the model (its fingerprint), the token
    ids it is computed after (the prefix, and a wrapped store's header) and the wrapper's soft
    tokens (its digest), hashed. Chunk ids hash a chunk's document and text only, so a store
    rebuilt at the same path with another wrapper, prefix or model has the same ids: its raw files
    go under another key instead of reusing KV computed for the old encoding."""
    import json

    material = json.dumps([store.attrs.get("model"), store.encoded_after(), store.config.wrapper], sort_keys=True,
                          default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


class RawKV:
    """The raw-KV files of one store, in `root` (default: `default_raw_dir`), under the store's
    `encoding_key`."""

    def __init__(self, store: KVStore, root: str | Path | None = None):
        self.root = (Path(root) if root else default_raw_dir(store)) / encoding_key(store)

    def files(self, ids: list[str]) -> list[Path]:
        return [raw_file(self.root, c) for c in ids]

    def missing(self, ids: list[str]) -> list[str]:
        """The chunk ids with no raw-KV file yet."""
        return [c for c, f in zip(ids, self.files(ids)) if not f.exists()]

    def make(self, store: KVStore, ids: list[str], model) -> list[Path]:
        """The files of chunks `ids`, computing (after the shared prefix, and a wrapped store's
        header) those not there yet with `model`."""
        from safetensors.torch import save_file

        from ..model.kvmodel import extract_kv

        prefix = store.encoded_after()
        files = self.files(ids)
        for f, toks in zip(files, store.tokens(ids)):
            if not f.exists():  # a reader (the vLLM connector, another query) sees the whole file or none
                k, v = extract_kv(model, [toks], prefix)[0]
                raw = {"keys": k.half().cpu().contiguous(), "values": v.half().cpu().contiguous()}
                publish_file(f, lambda tmp: save_file(raw, str(tmp)), replace=False)
        return files

    def chunks(self, store: KVStore, ids: list[str]) -> DecodedChunks:
        """The chunks `ids` from their existing files (on the host)."""
        return raw_chunks(store, ids, self.files(ids))

    def context(self, store: KVStore, ids: list[str], model, device, watch: Stopwatch) -> tuple[Context, int]:
        """(Context, bytes read): the chunks' exact K/V (made on first use) assembled at their
        positions on `device`, like decoded codes."""
        self.make(store, ids, model)
        with watch.step("read"):
            chunks = self.chunks(store, ids)
        with watch.step("transfer"):
            chunks = chunks.to(device)
        with watch.step("reconstruct"):
            ctx = chunks.assemble(model)
        return ctx, chunks.nbytes
