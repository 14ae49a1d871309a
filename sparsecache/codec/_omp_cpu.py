"""Batch-OMP for the CPU as one fused, compiled loop per signal (numba).

On a CPU the torch formulation streams every [batch, atoms] intermediate through memory
several times per iteration and is bandwidth-bound (~1.1K signals/s on 2 cores). Here each
signal's working set (α⁰, α and the chosen rows of G: (s + 2) · n floats) stays in cache, the
correlation update and the argmax share one pass, and signals run in parallel threads.
Exact, it is the same algorithm with the same outputs as `omp.omp_block`; the tests compare
them. With candidate screening (`omp.Screening`) a step updates only the candidates'
correlations, Σ k·M instead of Σ k·n floats per signal (the rows of n = 8,192 atoms no
longer fit L2 at s = 80; M = 512 of them do).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from . import numba_pool

numba_pool.start()  # before any kernel runs: see numba_pool


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def omp_codes(alpha0: np.ndarray, G: np.ndarray, s: int, idx_out: np.ndarray, coef_out: np.ndarray,
              n_blocks: int, pivot_tol: float, candidates: int = 0, refresh: int = 16) -> None:
    """Fill idx_out [N, s] int64 and coef_out [N, s] float32 from α⁰ [N, n] and G [n, n].

    `candidates` M (0 or ≥ n: exact Batch-OMP) screens the atoms a step may choose: the M of
    largest |α| at the last screening. A screening computes the exact α of every atom, chooses
    that step's atom from it and keeps the M largest; it runs at the start, whenever the best
    candidate falls below the largest |α| left out (an atom outside may now lead), and at the
    latest `refresh` steps after the last. Between screenings a step updates M correlations
    instead of n, so the support's rows it reads, s·M floats, stay in L2 instead of streaming
    Σ k·n floats from memory. The coefficients are exact least squares on the chosen support;
    an atom whose squared distance from the support's span is below `pivot_tol` gets a zero
    coefficient (`omp.PIVOT_TOL`, shared with the torch paths)."""
    N, n = alpha0.shape
    M = n if candidates <= 0 or candidates >= n else candidates
    exact = M == n
    per = (N + n_blocks - 1) // n_blocks
    for blk in numba.prange(n_blocks):
        # G rows of the support, copied: a screening reads them again from cache (reading them in place
        # from G, 256 MB at n = 8,192, measured 3-5% slower)
        Gs = np.empty((s, n), np.float32)
        GsC = Gs if exact else np.empty((s, M), np.float32)  # ... at the candidates
        cand = np.arange(M)
        aC = np.empty(M, np.float32)  # α⁰ at the candidates
        alpha = np.empty(n, np.float32)
        scratch = np.empty(n, np.float32)
        buf = np.empty(n, np.float32)  # a screening's selection (kth_largest_sampled)
        chosen = np.zeros(n, np.bool_)
        acc = np.empty(n, np.float32)  # α at the candidates (next_atom)
        L = np.zeros((s, s), np.float64)
        w = np.zeros(s, np.float64)  # the new row of L (cholesky_append)
        wf = np.zeros(s, np.float64)  # L⁻¹ α⁰[S], one entry more each step (cholesky_solve)
        x = np.zeros(s, np.float64)
        xs = np.zeros(s, np.float32)
        live = np.zeros(s, np.bool_)
        for b in range(blk * per, min(N, (blk + 1) * per)):
            a0 = alpha0[b]
            idx = idx_out[b]
            if exact:
                aC = a0
                j = _argmax_abs(a0)
            else:
                j, left_out = screen(a0, 0, Gs, xs, M, cand, aC, chosen, alpha, scratch, buf)
                last = 0
            for k in range(s):
                idx[k] = j
                chosen[j] = True
                Gs[k, :] = G[j, :]
                cholesky_append(L, w, Gs[k], idx, k, j, live, pivot_tol)
                cholesky_solve(L, a0, idx, k + 1, x, wf, live)
                if k + 1 == s:
                    break
                for t in range(k + 1):
                    xs[t] = x[t]
                if exact:
                    j = next_atom(a0, Gs, xs, cand, chosen, k + 1, acc)[0]
                    continue
                gather(Gs, cand, GsC, k, k + 1)
                c, best = next_atom(aC, GsC, xs, cand, chosen, k + 1, acc)
                if best >= left_out and k + 1 - last < refresh:
                    j = cand[c]
                    continue
                j, left_out = screen(a0, k + 1, Gs, xs, M, cand, aC, chosen, alpha, scratch, buf)
                last = k + 1
                gather(Gs, cand, GsC, 0, k + 1)
            for k in range(s):
                coef_out[b, k] = x[k]
                chosen[idx[k]] = False


@numba.njit(fastmath=True, error_model="numpy")
def gather(Gs, cand, GsC, t0, t1) -> None:
    """GsC[t] = Gs[t] at the candidates, for support rows t0 ≤ t < t1."""
    for t in range(t0, t1):
        row = Gs[t]
        for c in range(cand.shape[0]):
            GsC[t, c] = row[cand[c]]


@numba.njit(fastmath=True, error_model="numpy")
def screen(a0, k, Gs, xs, M, cand, aC, chosen, alpha, scratch, buf):
    """A screening at support size k: the exact α = α⁰ − G[:, S] x_S of every atom; cand[:M] =
    the M unchosen atoms of largest |α|, in increasing order, and aC = α⁰ at them. Returns
    (the unchosen atom of largest |α|, the largest |α| left out of the candidates)."""
    n = a0.shape[0]
    correlations(a0, Gs, xs, k, alpha)
    best, j = np.float32(-1.0), 0
    for i in range(n):
        v = np.float32(-1.0) if chosen[i] else abs(alpha[i])
        scratch[i] = v
        if v > best:
            best, j = v, i
    thr = kth_largest_sampled(scratch, M, buf)
    c = 0
    for i in range(n):  # strictly above the threshold, then ties at it, in atom order
        if not chosen[i] and abs(alpha[i]) > thr:
            cand[c] = i
            c += 1
    for i in range(n):
        if c < M and not chosen[i] and abs(alpha[i]) == thr:
            cand[c] = i
            c += 1
    cand[:c].sort()
    for t in range(c, M):  # fewer than M unchosen atoms: repeat the last (never chosen twice)
        cand[t] = cand[c - 1]
    for t in range(M):
        aC[t] = a0[cand[t]]
    return j, thr


@numba.njit(fastmath=True, error_model="numpy")
def kth_largest(a, k):
    """The k-th largest value of `a` (1-based), by quickselect in place (a is scratch)."""
    lo, hi, target = 0, a.shape[0] - 1, a.shape[0] - k
    while lo < hi:
        mid = (lo + hi) // 2  # median of three as the pivot
        p = max(min(a[lo], a[mid]), min(max(a[lo], a[mid]), a[hi]))
        i, j = lo, hi
        while i <= j:
            while a[i] < p:
                i += 1
            while a[j] > p:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return a[target]


SAMPLE_STEP = 8  # kth_largest_sampled's stride: the sample is 1/8 of the values


@numba.njit(fastmath=True, error_model="numpy")
def kth_largest_sampled(a, k, buf):
    """kth_largest(a, k), the same value, in about 40% of its time where k is a small share of
    a: a quickselect over every SAMPLE_STEP-th value puts a bound τ below about 2k values, the
    values ≥ τ are copied into `buf` (a's size) and the k-th largest is selected among them
    (exactly a's: every value left out is smaller). Where fewer than k values reach τ, over all
    of a. `a` and `buf` are scratch."""
    n = a.shape[0]
    m = n // SAMPLE_STEP
    if m < 64 or k > m:
        return kth_largest(a, k)
    for i in range(m):
        buf[i] = a[i * SAMPLE_STEP]
    tau = kth_largest(buf[:m], min(m, 2 * k // SAMPLE_STEP + 8))
    c = 0
    for i in range(n):
        v = a[i]
        if v >= tau:
            buf[c] = v
            c += 1
    if c < k:
        return kth_largest(a, k)
    return kth_largest(buf[:c], k)


@numba.njit(fastmath=True, error_model="numpy")
def _argmax_abs(a: np.ndarray) -> int:
    best, j = -1.0, 0
    for i in range(a.shape[0]):
        v = abs(a[i])
        if v > best:
            best, j = v, i
    return j


@numba.njit(fastmath=True, error_model="numpy")
def cholesky_append(L, w, row, idx, k, j, live, pivot_tol) -> None:
    """Grow the Cholesky factor of G[S, S] by atom j, whose G row is `row` (support size k → k+1)."""
    total = 0.0
    for t in range(k):
        acc = row[idx[t]]
        for u in range(t):
            acc -= L[t, u] * w[u]
        w[t] = acc / L[t, t]
        total += w[t] * w[t]
    pivot = row[j] - total
    live[k] = pivot > pivot_tol
    # An atom (nearly) in the span of the support would blow the coefficients up: it gets a
    # decoupled unit row instead, and a zero right-hand side (so a zero coefficient).
    for t in range(k):
        L[k, t] = w[t] if live[k] else 0.0
    L[k, k] = math.sqrt(pivot) if live[k] else 1.0


@numba.njit(fastmath=True, error_model="numpy")
def cholesky_solve(L, a0, idx, k, x, wf, live) -> None:
    """x[:k] = (L Lᵀ)⁻¹ α⁰[S]: forward substitution for the support's newest row only (the
    rows before it are unchanged since the last step, so wf[:k-1] still holds their solution;
    called for k = 1, 2, … in turn), then backward substitution."""
    t = k - 1
    acc = a0[idx[t]] if live[t] else 0.0
    for u in range(t):
        acc -= L[t, u] * wf[u]
    wf[t] = acc / L[t, t]
    for t in range(k - 1, -1, -1):
        acc = wf[t]
        for u in range(t + 1, k):
            acc -= L[u, t] * x[u]
        x[t] = acc / L[t, t]


@numba.njit(fastmath=True, error_model="numpy")
def correlations(a0, Gs, xs, k, out) -> None:
    """out = α⁰ − Σ_{t<k} xs[t] · Gs[t]: the correlations after the support's first k atoms, over
    whatever atoms the rows hold (all of them for a screening, the candidates for a step). One
    contiguous row at a time: the loop LLVM vectorises (8 floats per FMA on AVX2); indexing the
    rows 2-D within tiles of α, as the kernel did before, was not, and ran ~8x slower at the same
    arithmetic (#82: 4 against 33 GFLOP/s per core)."""
    n = a0.shape[0]
    for i in range(n):
        out[i] = a0[i]
    for t in range(k):
        xt = xs[t]
        row = Gs[t]
        for i in range(n):
            out[i] -= xt * row[i]


@numba.njit(fastmath=True, error_model="numpy")
def next_atom(a0, Gs, xs, cand, chosen, k, acc):
    """(argmax, max) over candidates c whose atom cand[c] is off the support of |α|,
    α = α⁰ − G[cand, S] x_S, computed in `acc` (`correlations`)."""
    n = a0.shape[0]
    correlations(a0, Gs, xs, k, acc)
    best, j = np.float32(-1.0), 0
    for i in range(n):
        v = abs(acc[i])
        if v > best and not chosen[cand[i]]:
            best, j = v, i
    return j, best
