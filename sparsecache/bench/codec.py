"""The codec's speed: Batch-OMP against scikit-learn's and its own formulations, and the
atom-index codings (`sparsecache bench omp`)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..codec.coding import GRAPH_MAX_DIM
from ..codec.dictionary import Dictionary
from ..codec.learn import initial_atoms
from ..codec.omp import batch_omp, batch_size_for, gemm_batch_size_for, gram, omp_block, omp_block_gemm, reconstruct


def _heldout_signals(kind: str, count: int, layers: int = 1) -> torch.Tensor:
    """Real pre-RoPE K or V signals [count, layers·192] of the default model on held-out text."""
    from ..codec.learn import collect_signals
    from ..model.kvmodel import default_prefix_ids, load_model
    from ..text.documents import builtin_documents

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
            omp_block(sub_torch[i : i + step] @ D_dev, G, sparsity)
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
    variants = {f"gemm-{dt}": (lambda b, dt=dt: omp_block_gemm(b, D, G, s, dt), gemm_batch_size_for(n))
                for dt in ("float32", "float16", "bfloat16")}
    if y.device.type == "cuda" and D.shape[0] <= GRAPH_MAX_DIM:  # the fp16 form replayed as a CUDA graph
        variants["gemm-float16-graph"] = (lambda b: batch_omp(b, D, s, G, graphed=True), gemm_batch_size_for(n))
    for bs in (batch_size_for(n, s), 1024):
        variants[f"batch-omp-B{bs}"] = (lambda b: omp_block(b @ D, G, s), bs)
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
