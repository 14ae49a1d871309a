"""Where the CPU encode's OMP time goes (#82 item 3), phase by phase, on the default model's real K/V.

    python scripts/experiments/omp_cpu_phases.py --tokens 2048 --json omp-phases.json

The fused kernel (`codec/_omp_cpu.py`) is one compiled loop per signal, so its phases cannot be
timed from inside. Instead each phase is replayed alone over the same signals, with the atoms the
kernel chose (its own compiled helpers, in the same parallel blocks): the initial correlations
α⁰ = Dᵀy (a GEMM), the G-row copies of the support (s rows of n floats per signal: memory), the
Cholesky updates and solves, the screenings (exact α of every atom and a quickselect, at the
refresh schedule's minimum), and the screened correlation updates and argmax over M candidates; then
the storage coding (sorting, Elias–Fano packing, fp8). Their sum beside the kernel's own time says
how much each phase weighs and what is left (branches, the extra screenings a signal needs). The
machine's GEMM rate and copy bandwidth are measured beside, for the bound.
"""

from __future__ import annotations

import argparse
import json
import time

import sparsecache  # noqa: F401  (before torch: it sets torch's OpenMP threads to wait passively)
import numba
import numpy as np
import torch

from sparsecache.codec._omp_cpu import cholesky_append, cholesky_solve, gather, next_atom, omp_codes, screen
from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import Dictionary, shipped_dictionary
from sparsecache.codec.omp import PIVOT_TOL, gram
from sparsecache.codec.signals import to_signals
from sparsecache.measure.machine import copy_rate, cpu_model, gemm_rate
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.codec.bitpack import pack_sorted_rows
from sparsecache.text.documents import builtin_documents


@numba.njit(parallel=True, fastmath=True, nogil=True)
def _copies(idx, G, n_blocks):
    N, s = idx.shape
    per = (N + n_blocks - 1) // n_blocks
    total = 0.0
    for blk in numba.prange(n_blocks):
        Gs = np.empty((s, G.shape[1]), np.float32)
        for b in range(blk * per, min(N, (blk + 1) * per)):
            for k in range(s):
                Gs[k, :] = G[idx[b, k], :]
        total += Gs[0, 0]
    return total


@numba.njit(parallel=True, fastmath=True, nogil=True)
def _cholesky(alpha0, G, idx, n_blocks, pivot_tol):
    N, s = idx.shape
    per = (N + n_blocks - 1) // n_blocks
    total = 0.0
    for blk in numba.prange(n_blocks):
        L = np.zeros((s, s), np.float64)
        w = np.zeros(s, np.float64)
        x = np.zeros(s, np.float64)
        wf = np.zeros(s, np.float64)
        live = np.zeros(s, np.bool_)
        row = np.empty(G.shape[1], np.float32)
        for b in range(blk * per, min(N, (blk + 1) * per)):
            for k in range(s):
                j = idx[b, k]
                for t in range(k + 1):  # the entries of G's row the factor reads (the support's)
                    row[idx[b, t]] = G[j, idx[b, t]]
                cholesky_append(L, w, row, idx[b], k, j, live, pivot_tol)
                cholesky_solve(L, alpha0[b], idx[b], k + 1, x, wf, live)
        total += x[0]
    return total


@numba.njit(parallel=True, fastmath=True, nogil=True)
def _screens(alpha0, G, idx, M, refresh, n_blocks):
    N, n = alpha0.shape
    s = idx.shape[1]
    per = (N + n_blocks - 1) // n_blocks
    total = 0.0
    for blk in numba.prange(n_blocks):
        Gs = np.zeros((s, n), np.float32)  # the arithmetic is the same whatever the rows hold
        xs = np.full(s, np.float32(0.01))
        cand = np.arange(M)
        aC = np.empty(M, np.float32)
        chosen = np.zeros(n, np.bool_)
        alpha = np.empty(n, np.float32)
        scratch = np.empty(n, np.float32)
        buf = np.empty(n, np.float32)
        for b in range(blk * per, min(N, (blk + 1) * per)):
            for k in range(0, s, refresh):
                j, thr = screen(alpha0[b], k, Gs, xs, M, cand, aC, chosen, alpha, scratch, buf)
                total += thr
    return total


@numba.njit(parallel=True, fastmath=True, nogil=True)
def _screened_steps(alpha0, G, idx, M, n_blocks):
    N, n = alpha0.shape
    s = idx.shape[1]
    per = (N + n_blocks - 1) // n_blocks
    total = 0.0
    for blk in numba.prange(n_blocks):
        Gs = np.zeros((s, n), np.float32)
        GsC = np.zeros((s, M), np.float32)
        xs = np.full(s, np.float32(0.01))
        cand = np.arange(M) * (n // M)
        aC = np.empty(M, np.float32)
        chosen = np.zeros(n, np.bool_)
        acc = np.empty(M, np.float32)
        for b in range(blk * per, min(N, (blk + 1) * per)):
            for t in range(M):
                aC[t] = alpha0[b, cand[t]]
            for k in range(s - 1):
                gather(Gs, cand, GsC, k, k + 1)
                c, best = next_atom(aC, GsC, xs, cand, chosen, k + 1, acc)
                total += best
    return total


def timed(fn, repeats=3):
    fn()  # compile, warm
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def heldout_problems(tokens: int):
    """The default codec and, for "k" and "v", (signals y, atoms D, Gram matrix G as numpy) of the
    default model's K/V of `tokens` held-out tokens, scaled as the encoder scales them."""
    model = load_model("default")
    d = Dictionary.load(shipped_dictionary(model.fingerprint()))
    codec = Codec(d, "float8")
    docs = builtin_documents("heldout")  # Python's documentation, the part no dictionary was learned on
    ids = model.tokenizer("\n\n".join(x.text for x in docs[:80]), add_special_tokens=False)["input_ids"][:tokens]
    out = {}
    for kind, kv in zip("kv", extract_kv(model, [ids], default_prefix_ids(model))[0]):
        kv = kv.float()
        if codec._scales[kind] is not None:
            kv = kv * codec.scales_on(kind, torch.device("cpu"))
        y = to_signals(kv, d.config.layers_per_signal).reshape(-1, d.config.layers_per_signal * model.m).contiguous()
        D = codec._atoms[kind].float()
        out[kind] = y, D, gram(D).contiguous().numpy()
    return codec, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text whose K/V is coded")
    ap.add_argument("--kind", default="k", choices=("k", "v"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    codec, problems = heldout_problems(a.tokens)
    y, D, G = problems[a.kind]
    s, n = codec.config.sparsity, D.shape[1]
    scr = codec.screening
    threads = torch.get_num_threads()
    alpha0 = (y @ D).contiguous()
    a0 = alpha0.numpy()
    idx = np.empty((y.shape[0], s), np.int64)
    coef = np.empty((y.shape[0], s), np.float32)

    def kernel(m=scr.candidates, refresh=scr.refresh):
        omp_codes(a0, G, s, idx, coef, threads, PIVOT_TOL, m, refresh)

    out = {"cpu": cpu_model(), "threads": threads, "signals": int(y.shape[0]), "dim": int(y.shape[1]), "atoms": n,
           "sparsity": s, "screening": {"candidates": scr.candidates, "refresh": scr.refresh}, "seconds": {}}
    sec = out["seconds"]
    sec["alpha0_gemm"] = timed(lambda: y @ D)
    sec["kernel_screened"] = timed(kernel)
    chosen = idx.copy()
    sec["kernel_exact"] = timed(lambda: kernel(0, scr.refresh), repeats=1)
    M = scr.candidates or n
    sec["phase_row_copies"] = timed(lambda: _copies(chosen, G, threads))
    sec["phase_cholesky"] = timed(lambda: _cholesky(a0, G, chosen, threads, PIVOT_TOL))
    sec["phase_screenings_min"] = timed(lambda: _screens(a0, G, chosen, M, scr.refresh, threads))
    sec["phase_screened_steps"] = timed(lambda: _screened_steps(a0, G, chosen, M, threads))
    idx_t, coef_t = torch.from_numpy(chosen), torch.from_numpy(coef)

    def storage():  # what `Codec.encode` does after OMP
        i, order = idx_t.sort(dim=1)
        pack_sorted_rows(i.numpy(), n)
        codec._stored(coef_t.gather(1, order))

    sec["storage_coding"] = timed(storage)
    phases = sum(v for k_, v in sec.items() if k_.startswith("phase_"))
    sec["kernel_unexplained"] = sec["kernel_screened"] - phases
    flops = gemm_rate("cpu")
    out["gemm_flops_per_s"] = flops
    out["copy_bytes_per_s"] = copy_rate("cpu")
    out["bound_alpha0_s"] = 2 * y.shape[0] * y.shape[1] * n / flops
    out["bound_row_copies_s"] = y.shape[0] * s * n * 4 * 2 / out["copy_bytes_per_s"]
    out["signals_per_s"] = y.shape[0] / (sec["alpha0_gemm"] + sec["kernel_screened"])
    total = sec["alpha0_gemm"] + sec["kernel_screened"]
    print(f"{out['cpu']}, {threads} threads: {out['signals']} signals of {out['dim']} values, n = {n}, s = {s}, "
          f"screening M = {scr.candidates}, refresh {scr.refresh}")
    for name, t in sec.items():
        share = f"{100 * t / total:5.1f}% of α⁰ + kernel" if t else ""
        print(f"  {name:24s} {1e3 * t:9.1f} ms  {share}")
    print(f"  bounds: α⁰ at the GEMM rate {1e3 * out['bound_alpha0_s']:.1f} ms; G-row copies at the copy bandwidth "
          f"{1e3 * out['bound_row_copies_s']:.1f} ms; {out['signals_per_s']:.0f} signals/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
