"""The store's speed: decode of retrieved chunks, encode throughput, and reading codes against
raw fp16 KV warm and cold (`sparsecache bench decode`, `bench store`, `bench encode`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..codec.dictionary import Dictionary
from ..durable import write_atomic
from ..measure.machine import copy_rate, drop_page_cache, gemm_rate, median_time


def bench_decode(store_path, n_chunks: int = 32, device="cpu", repeats: int = 20) -> dict:
    """Decoding `n_chunks` full chunks of a store on `device` with the codes already there, in
    signals/s and K/V bytes written per second (fp32 [layers, T, m]), beside a device-to-device
    copy of the same bytes (the memory-bandwidth yardstick). On a CPU also the decode every
    other device runs (torch unpack + `embedding_bag` over fp32 atoms), the CPU's path before
    its kernel, timed alternately with it, and the two results' largest relative difference."""
    from ..kvstore.view import KVStore

    store = KVStore.open(store_path)
    ids = [c.id for c in sorted(store.chunks(), key=lambda c: -c.token_length)[:n_chunks]]
    codes = store.read_codes(ids)
    codec = store.codec()
    dev = torch.device(device)
    on_dev = {kind: tuple(torch.as_tensor(a).to(dev) for a in (c.indices, c.coefficients))
              for kind, c in (("k", codes.k), ("v", codes.v))}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def decode(kernel: bool = True):
        codec.cpu_kernel = kernel
        try:
            out = [codec.decode(on_dev[kind], kind, dev) for kind in ("k", "v")]
        finally:
            codec.cpu_kernel = True
        sync()
        return out

    k, v = decode()
    out_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    signals = 2 * codes.k.indices.shape[0] * codes.k.indices.shape[1]
    result = {"device": str(dev), "chunks": len(ids), "tokens": int(sum(codes.lengths)), "signals": signals,
              "kv_bytes": out_bytes, "code_bytes": int(codes.nbytes)}
    if dev.type == "cpu":
        k0, v0 = decode(False)
        result["max_rel_diff_vs_embedding_bag"] = max(float((a - b).abs().max() / b.abs().max())
                                                      for a, b in ((k, k0), (v, v0)))
        times = {"kernel": [], "embedding_bag": []}
        for _ in range(max(3, repeats // 4)):  # alternating, so both see the same machine
            for name, kernel in (("kernel", True), ("embedding_bag", False)):
                t = time.perf_counter()
                decode(kernel)
                times[name].append(time.perf_counter() - t)
        seconds = float(np.median(times["kernel"]))
        result["embedding_bag_ms"] = 1e3 * float(np.median(times["embedding_bag"]))
        result["speedup_vs_embedding_bag"] = result["embedding_bag_ms"] / (1e3 * seconds)
    else:
        seconds = median_time(decode, repeats)
    return {**result, "decode_ms": 1e3 * seconds, "signals_per_s": signals / seconds,
            "kv_bytes_per_s": out_bytes / seconds, "copy_bytes_per_s": copy_rate(dev, out_bytes, repeats),
            "gemm_flops_per_s": gemm_rate(dev)}


def bench_corpus(out, min_tokens: int = 20_000) -> list:
    """The longest Python documentation topics as .txt files, about `min_tokens` tokens in all."""
    from pathlib import Path
    from pydoc_data.topics import topics

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chars = 0
    for name, text in sorted(topics.items(), key=lambda kv: -len(kv[1])):
        if chars > min_tokens * 4:  # ~4 characters per token in this text
            break
        (out / f"{name}.txt").write_text(text)
        chars += len(text)
    return sorted(out.iterdir())


def bench_store(workdir, n_chunks: int = 32, repeats: int = 5, device="cpu", min_tokens: int = 20_000) -> dict:
    """Encode throughput and its breakdown, then reading `n_chunks` full chunks: the store's
    codes vs the same chunks' exact fp16 KV as one .safetensors file per chunk, warm and cold.

    Reuses `workdir/store` if a previous run built it (the encode figures are then its own).
    """
    import json
    from pathlib import Path

    from safetensors.torch import load

    from ..codec.dictionary import default_dictionary
    from ..ingest.config import EncodeOptions
    from ..ingest.encoder import encode_with
    from ..kvstore.view import KVStore
    from ..model.kvmodel import load_model
    from ..query.session import Session
    from ..store import StoreConfig

    work = Path(workdir)
    store_path = work / "store"
    model = load_model(device=device)
    d = Dictionary.load(default_dictionary())
    report_file = work / "encode.json"
    if not report_file.exists():
        bench_corpus(work / "corpus", min_tokens)
        r = encode_with([str(work / "corpus")], store_path, d, model, StoreConfig(), EncodeOptions(device=device))
        write_atomic(report_file, json.dumps(r.to_dict()))
    encode = json.loads(report_file.read_text())
    store = KVStore.open(store_path)
    full = sorted((c for c in store.chunks() if c.token_length >= 480), key=lambda c: c.id)[:n_chunks]
    ids = [c.id for c in full]

    raw_files = Session(store, model, device, raw_dir=work / "raw").raw_files(ids)
    data_dir = store_path / "data" / store.manifest.generation

    def read_codes():
        return store.read_codes(ids)

    def read_raw():  # read the bytes and deserialise: load_file would mmap lazily and read nothing yet
        return [load(f.read_bytes()) for f in raw_files]

    codes = read_codes()
    code_files = _touched_files(store, ids)
    result = {
        "device": str(device),
        "chunks": len(ids),
        "tokens": int(sum(c.token_length for c in full)),
        "encode": encode,
        "codes_bytes": int(codes.nbytes),
        "codes_files_touched": len(code_files),
        "raw_bytes": int(sum(f.stat().st_size for f in raw_files)),
        "raw_files_touched": len(raw_files),
        "read_codes_warm_ms": 1e3 * median_time(read_codes, repeats),
        "read_raw_warm_ms": 1e3 * median_time(read_raw, repeats),
        "read_codes_cold_ms": 1e3 * median_time(read_codes, repeats, lambda: drop_page_cache([data_dir])),
        "read_raw_cold_ms": 1e3 * median_time(read_raw, repeats, lambda: drop_page_cache(raw_files)),
        "decode_cpu_ms": 1e3 * median_time(lambda: (store.codec().decode(codes.k, "k", "cpu"),
                                                      store.codec().decode(codes.v, "v", "cpu")), repeats),
        "layouts": _layouts(store, ids, repeats, work / "layouts"),
        "cold_method": "posix_fadvise(POSIX_FADV_DONTNEED) on every file before each read",
    }
    result["codes_vs_raw_bytes"] = result["raw_bytes"] / result["codes_bytes"]
    return result


def bench_encode(workdir, corpus=("builtin:heldout",), device="cpu") -> dict:
    """`encode_corpus` of the same corpus into two fresh stores, one after the other in this
    run: exact Batch-OMP (the kernel before screening) and the default screening. Reports each
    run's tokens/s and phases and how the two stores' codes compare: the same chunks, and the
    decoded K/V error of each against the exact KV of a sample of chunks."""
    import shutil
    from pathlib import Path

    from ..ingest.config import EncodeOptions
    from ..codec.dictionary import default_dictionary
    from ..codec.omp import EXACT, Screening
    from ..ingest.encoder import encode_with
    from ..kvstore.view import KVStore
    from ..model.kvmodel import extract_kv, load_model
    from ..store import StoreConfig

    work = Path(workdir)
    model = load_model(device=device)
    d = Dictionary.load(default_dictionary())
    runs = {}
    # exact Batch-OMP against the CPU kernel's default screening
    for name, screening in (("exact", EXACT), ("screened", Screening.default_for(d.keys.shape[0], d.config.atoms))):
        shutil.rmtree(work / name, ignore_errors=True)
        r = encode_with(list(corpus), work / name, d, model, StoreConfig(),
                        EncodeOptions(device=device, exact_omp=name == "exact"))
        runs[name] = {**r.to_dict(), "screening": {"candidates": screening.candidates, "refresh": screening.refresh}}
    stores = {name: KVStore.open(work / name) for name in runs}
    chunks = {name: {(c.doc_id, c.ordinal): c.id for c in st.chunks()} for name, st in stores.items()}
    same = chunks["exact"].keys() == chunks["screened"].keys() and all(
        stores["exact"].tokens([chunks["exact"][key]]) == stores["screened"].tokens([chunks["screened"][key]])
        for key in chunks["exact"])
    sample = sorted(chunks["exact"])[:: max(1, len(chunks["exact"]) // 8)][:8]
    err = {name: {"k": [0.0, 0.0], "v": [0.0, 0.0]} for name in runs}
    prefix = stores["exact"].prefix()[0]
    for key in sample:
        (k, v), = extract_kv(model, stores["exact"].tokens([chunks["exact"][key]]), prefix)
        for name, st in stores.items():
            (kh, vh), = st.load_kv([chunks[name][key]])
            for kind, x, xh in (("k", k, kh), ("v", v, vh)):
                err[name][kind][0] += float((xh.float() - x.float()).square().sum())
                err[name][kind][1] += float(x.float().square().sum())
    nmse = {name: {kind: a / b for kind, (a, b) in e.items()} for name, e in err.items()}
    return {"device": str(device), "corpus": list(corpus), "runs": runs, "same_chunks": same,
            "nmse_sampled_chunks": nmse, "sampled_chunks": len(sample),
            "speedup": runs["screened"]["tokens_per_s"] / runs["exact"]["tokens_per_s"]}


def _touched_files(store, ids) -> set:
    from ..store import CODE_ARRAYS

    out = set()
    for a, b in store.spans(ids):
        for name in (*CODE_ARRAYS, "tokens"):
            arr = store.array(name)
            step = arr.chunks[0] if name == "tokens" else arr.chunks[1]
            out |= {(name, i) for i in range(a // step, (b - 1) // step + 1)}
    return out


def _layouts(store, ids, repeats: int, out) -> list[dict]:
    """The same codes rewritten with other Zarr chunk lengths / compressors: read time and disk/theory."""
    import shutil

    import zarr

    from ..store import CODE_ARRAYS, LocalBackend, compressors, plain_chunks, read_spans_direct, read_zarr

    m = store.manifest
    spans = store.spans(ids)
    rows = []
    for zt, comp, shard in ((128, "none", None), (256, "none", None), (512, "none", None), (256, "zstd", None),
                            (64, "none", 4096)):
        shutil.rmtree(out, ignore_errors=True)
        g = zarr.open_group(str(out), mode="w")
        theory = 0
        for name in CODE_ARRAYS:
            src = store.group[name][:, : m.tokens]
            theory += src.nbytes
            chunks = (src.shape[0], zt, src.shape[2])
            shards = None if shard is None else (src.shape[0], shard, src.shape[2])
            g.create_array(name, shape=src.shape, dtype=src.dtype, chunks=chunks, shards=shards,
                           compressors=compressors(comp))[:] = src
        arrays = {n: zarr.open_array(str(out / n), mode="r") for n in CODE_ARRAYS}

        def read():
            read_zarr([(arrays[n]._async_array, (slice(None), slice(a, b))) for n in CODE_ARRAYS for a, b in spans])

        def read_direct():
            for n in CODE_ARRAYS:
                read_spans_direct(arrays[n], LocalBackend(out), n, spans, 1)

        direct = all(plain_chunks(a) for a in arrays.values())
        rows.append({"zarr_chunk_tokens": zt, "shard_tokens": shard, "compressor": comp,
                     "disk_vs_theoretical": LocalBackend(out).size("") / theory,
                     "files": sum(1 for f in out.rglob("*") if f.is_file() and f.name != "zarr.json"),
                     "read_zarr_warm_ms": 1e3 * median_time(read, repeats),
                     "read_direct_warm_ms": 1e3 * median_time(read_direct, repeats) if direct else None})
    shutil.rmtree(out, ignore_errors=True)
    return rows
