"""Orthogonal Matching Pursuit, batched: the encode hot path.

`batch_omp` follows Rubinstein, Zibulevsky & Elad, "Efficient implementation of the K-SVD
algorithm using Batch OMP" (2008): with G = DᵀD precomputed once per dictionary, the
residual correlations are α = α⁰ − G[:, S] x_S, and the least-squares solve on the support
grows a Cholesky factor one row per iteration. Per signal that costs n·m (α⁰) + ~n·s²/2
(correlation updates) multiply-adds, against n·m·s for an OMP that re-correlates the
residual with a GEMM each step. Everything is vectorised over a batch of signals; no
Python loop touches individual signals.

Three implementations of the same greedy algorithm, one per kind of hardware:

- on the CPU, the fused numba loop of `_omp_cpu` (memory traffic, not FLOPs, bounds the
  torch ops there);
- on a GPU, `omp_block_gemm`: the residual's correlations come from one GEMM per step,
  α = Dᵀ(y − D_S x_S), which equals Batch-OMP's α⁰ − G_S x_S but runs on the matrix units
  instead of reading s gathered Gram rows per signal from memory (n·s²/2 floats per signal,
  4 MB at n = 8192, s = 16: that traffic, not arithmetic, bounds Batch-OMP on a GPU). The
  step that only *chooses* the next atom may run in fp16 on the unit-normalised residual
  (an argmax needs no more); the least-squares coefficients are always solved in fp32
  from the exact α⁰;
- `omp_block`: Batch-OMP in plain torch ops (any device), the formulation the others are
  checked against and `bench omp` compares with.

Tests hold all of them to the reference and to scikit-learn.

`reference_omp` is the textbook loop (one signal at a time, lstsq on the support) that the
tests compare the fast path against.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# G rows gathered per signal dominate memory: batch * sparsity * atoms * 4 bytes.
_GATHER_BUDGET_BYTES = 64 << 20
# The GEMM form holds ~3 [batch, atoms] fp32 tensors (α⁰, α, scores); a GPU wants thousands
# of signals per step to hide its ~15 kernel launches per atom.
_GEMM_BUDGET_BYTES = 1 << 30
PIVOT_TOL = 1e-6  # squared distance of a unit atom from the support's span
SELECT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Screening:
    """Candidate screening of the CPU Batch-OMP (`_omp_cpu`): a step may only choose among the
    `candidates` atoms of largest |α| at the last screening, done at the start and every
    `refresh` steps from the exact correlations of all atoms. 0 candidates: exact Batch-OMP,
    the reference. Only the CPU kernel screens; on a GPU the GEMM form is compute-bound and
    runs exact. The codes have the same format either way: a store may mix them."""

    candidates: int = 512
    refresh: int = 16

    def __post_init__(self):
        if self.candidates < 0 or self.refresh < 1:
            raise ConfigError(f"screening needs candidates >= 0 and refresh >= 1, got {self}")

    @property
    def exact(self) -> bool:
        return self.candidates == 0

    @classmethod
    def default_for(cls, dim: int, atoms: int) -> "Screening":
        """The default for a dictionary of `atoms` atoms of `dim` values: screening where the
        signal is large against the dictionary, exact Batch-OMP where it is not. Measured on the
        default model's held-out K/V (BENCHMARKS.md): +0.1-0.2% NMSE at 1,920 values (L10),
        +0.4-0.6% at 960 (L5), but +2-6% at 192 (L1, 43x more atoms than values), past the 2%
        a default may cost."""
        return cls() if atoms <= SCREEN_MAX_OVERCOMPLETE * dim else EXACT


EXACT = Screening(candidates=0)
SCREEN_MAX_OVERCOMPLETE = 10  # atoms per signal value up to which the CPU OMP screens by default


def gram(atoms: torch.Tensor) -> torch.Tensor:
    """G = DᵀD [n, n] float32 for a dictionary whose columns are atoms, D [m, n]."""
    d = atoms.float()
    return d.T @ d


def batch_size_for(n_atoms: int, sparsity: int) -> int:
    """Signals per Batch-OMP step that keep the gathered Gram rows within budget."""
    return max(16, min(4096, _GATHER_BUDGET_BYTES // (4 * n_atoms * sparsity)))


def gemm_batch_size_for(n_atoms: int) -> int:
    """Signals per step of `omp_block_gemm` that keep its [B, n] tensors within budget."""
    return max(16, min(16384, _GEMM_BUDGET_BYTES // (12 * n_atoms)))


@torch.no_grad()
def batch_omp(signals: torch.Tensor, atoms: torch.Tensor, sparsity: int,
              G: torch.Tensor | None = None, batch_size: int | None = None,
              select_dtype: str = "float16", graphed: bool = False,
              screening: Screening = EXACT, on_block=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse codes of `signals` [N, m] over `atoms` D [m, n] (unit-norm columns).

    Returns (indices [N, s] int64, coefficients [N, s] float32) on the signals' device, in
    selection order. `G` (from `gram`) is reused across calls when given. `select_dtype` is
    the precision of the atom-choosing GEMM on non-CPU devices (see the module docstring).
    `graphed` replays each block as a CUDA graph captured once per (atoms, G) pair: for
    callers that code many batches with one dictionary (the codec), on CUDA only.
    `screening` applies to the CPU kernel only (see `Screening`). `on_block(n)` is called as
    each block of n signals is coded (a progress bar's hook).
    """
    D = atoms.to(signals.device, torch.float32)
    if G is None:
        G = gram(D)
    n = D.shape[1]
    fused = signals.device.type == "cpu"
    # The fused kernel keeps per-thread buffers only; its batch just bounds α⁰ [B, n].
    step = batch_size or (2048 if fused else gemm_batch_size_for(n))
    idx, coef = [], []
    for start in range(0, signals.shape[0], step):
        y = signals[start : start + step].float()
        if fused:
            i, c = omp_block_cpu(y @ D, G, sparsity, screening)
        elif graphed and y.device.type == "cuda" and D.data_ptr() == atoms.data_ptr():
            # (atoms that had to be copied or cast here are not the caller's tensor: no cache key)
            i, c = _graphed_block(D, G, sparsity, select_dtype, step)(y)
        else:
            i, c = omp_block_gemm(y, D, G, sparsity, select_dtype)
        idx.append(i)
        coef.append(c)
        if on_block is not None:
            on_block(y.shape[0])
    if not idx:
        empty = signals.new_zeros((0, sparsity))
        return empty.long(), empty.float()
    return torch.cat(idx), torch.cat(coef)


def omp_block_cpu(alpha0: torch.Tensor, G: torch.Tensor, s: int,
                   screening: Screening = EXACT) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `omp_block` (exact, or screened: `Screening`), as the fused numba loop of `_omp_cpu`."""
    idx = torch.empty(alpha0.shape[0], s, dtype=torch.long)
    coef = torch.empty(alpha0.shape[0], s, dtype=torch.float32)
    # numba is imported on first encode only: readers (query, the vLLM connector) never need it,
    # and vLLM's kernel scan at start-up trips over llvmlite's module objects.
    from ._omp_cpu import omp_codes

    omp_codes(alpha0.contiguous().numpy(), G.contiguous().numpy(), s, idx.numpy(), coef.numpy(),
              torch.get_num_threads(), PIVOT_TOL, screening.candidates, screening.refresh)
    return idx, coef


def omp_block(alpha0: torch.Tensor, G: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-OMP on initial correlations α⁰ [B, n]; returns (indices, coefficients) [B, s]."""
    B, n = alpha0.shape
    Gs = alpha0.new_empty(B, s, n)  # G rows of the chosen atoms
    step = _CholeskyStep(alpha0, G, s)
    alpha = alpha0
    for k in range(s):
        j, row = step.choose(alpha, k, G)
        Gs[:, k] = row
        x = step.solve(j, row.gather(1, step.idx[:, :k]), k)
        if k + 1 < s:
            alpha = torch.baddbmm(alpha0.unsqueeze(1), x.transpose(1, 2), Gs[:, : k + 1], alpha=-1)[:, 0]  # (B, n)
    return step.idx, x[..., 0]


def omp_block_gemm(y: torch.Tensor, D: torch.Tensor, G: torch.Tensor, s: int,
                    select_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """OMP on signals y [B, m] with residual correlations by GEMM; returns (indices, coefficients) [B, s].

    The same selections and coefficients as `omp_block` (up to fp rounding in near-ties):
    Dᵀ(y − D_S x_S) = α⁰ − G_S x_S. With `select_dtype` float16/bfloat16 the atom-choosing GEMM
    runs in that precision on the residual scaled to unit norm (argmax is scale-invariant and
    unit atoms keep every correlation in [-1, 1]); the coefficients stay fp32.
    """
    alpha0 = y @ D  # (B, n), exact: the right-hand side of every least-squares solve
    Dt = D.T.contiguous()  # (n, m): atom rows to gather
    Dsel = D.to(SELECT_DTYPES[select_dtype])
    step = _CholeskyStep(alpha0, G, s)
    alpha = alpha0
    for k in range(s):
        j, _ = step.choose(alpha, k)
        x = step.solve(j, G[j[:, None], step.idx[:, :k]], k)
        if k + 1 < s:
            r = y - torch.bmm(x.transpose(1, 2), Dt[step.idx[:, : k + 1]])[:, 0]  # (B, m)
            if Dsel.dtype != torch.float32:
                r = (r / r.norm(dim=1, keepdim=True).clamp_min(1e-30)).to(Dsel.dtype)
            alpha = r @ Dsel  # (B, n)
    return step.idx, x[..., 0]


class _GraphedBlock:
    """`omp_block_gemm` on a fixed batch of B signals, captured once as a CUDA graph.

    Each of its s steps launches ~40 small kernels; on an H100 the host issued them slower
    than the GPU ran them (8.9 ms of kernels in a 14 ms block at B = 10,922, s = 16). A
    replay issues them all at once. Shorter batches are zero-padded (zero signals get
    distinct atoms and zero coefficients). Holds its atoms and Gram matrix, whose memory
    the graph reads at every replay.
    """

    def __init__(self, D: torch.Tensor, G: torch.Tensor, s: int, select_dtype: str, B: int):
        self.D, self.G = D, G
        self.y = torch.zeros(B, D.shape[0], device=D.device)
        side = torch.cuda.Stream(D.device)
        side.wait_stream(torch.cuda.current_stream(D.device))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS makes handles
            for _ in range(2):
                omp_block_gemm(self.y, D, G, s, select_dtype)
        torch.cuda.current_stream(D.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.idx, self.coef = omp_block_gemm(self.y, D, G, s, select_dtype)

    def __call__(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = y.shape[0]
        self.y[:n].copy_(y)
        self.y[n:].zero_()
        self.graph.replay()
        return self.idx[:n].clone(), self.coef[:n].clone()


GRAPHS: dict[tuple, _GraphedBlock] = {}
GRAPHS_KEPT = 2  # one K and one V dictionary; each graph keeps ~1 GB of intermediates


def _graphed_block(D: torch.Tensor, G: torch.Tensor, s: int, select_dtype: str, B: int) -> _GraphedBlock:
    """The cached graph for these exact atom and Gram tensors (kept alive by the graph, so a
    pointer in the key cannot be reused by another tensor while the entry exists)."""
    key = (D.data_ptr(), tuple(D.shape), G.data_ptr(), s, select_dtype, B)
    if key not in GRAPHS:
        while len(GRAPHS) >= GRAPHS_KEPT:
            GRAPHS.pop(next(iter(GRAPHS)))
        GRAPHS[key] = _GraphedBlock(D, G, s, select_dtype, B)
    return GRAPHS[key]


class _CholeskyStep:
    """What every torch OMP shares: choosing the next atom and growing the Cholesky factor of
    G[S, S] by one row, then solving for the support's coefficients."""

    def __init__(self, alpha0: torch.Tensor, G: torch.Tensor, s: int):
        B, dev = alpha0.shape[0], alpha0.device
        self.alpha0, self.G = alpha0, G
        self.idx = torch.zeros(B, s, dtype=torch.long, device=dev)
        self.L = torch.zeros(B, s, s, device=dev)  # Cholesky factor of G[S, S], grown row by row
        self.live = torch.zeros(B, s, dtype=torch.bool, device=dev)

    def choose(self, alpha: torch.Tensor, k: int, G: torch.Tensor | None = None):
        """Atom j [B] of largest |α| not yet chosen, and its Gram row [B, n] when G is given.

        May overwrite the chosen atoms' entries of α (k > 0), which callers recompute anyway."""
        # Chosen atoms score below every other, so a residual orthogonal to all atoms (a zero
        # signal) still gets distinct atoms, as a sorted-set index coding needs.
        if _fused_argmax(alpha.device):
            from ._omp_cuda import argmax_abs

            if k:
                alpha.scatter_(1, self.idx[:, :k], float("nan"))
            j = argmax_abs(alpha)
        else:
            score = alpha.abs()
            score.scatter_(1, self.idx[:, :k], -1.0)
            j = _argmax(score)  # (B,)
        self.idx[:, k] = j
        return j, None if G is None else torch.index_select(G, 0, j)

    def solve(self, j: torch.Tensor, g_support: torch.Tensor, k: int) -> torch.Tensor:
        """Coefficients x [B, k+1, 1] on the support after adding atom j; g_support = G[j, S] [B, k]."""
        L, live = self.L, self.live
        gjj = self.G[j, j]  # (B,)
        if k == 0:
            pivot = gjj
        else:
            w = torch.linalg.solve_triangular(L[:, :k, :k], g_support.unsqueeze(-1), upper=False)  # (B, k, 1)
            pivot = gjj - w[..., 0].square().sum(1)
        live[:, k] = pivot > PIVOT_TOL
        # An atom (nearly) in the span of the support would blow the coefficients up: it
        # gets a decoupled unit row and a zero right-hand side, so a zero coefficient.
        if k > 0:
            L[:, k, :k] = w[..., 0] * live[:, k, None]
        L[:, k, k] = torch.where(live[:, k], pivot.clamp_min(PIVOT_TOL).sqrt(), 1.0)
        b = (self.alpha0.gather(1, self.idx[:, : k + 1]) * live[:, : k + 1]).unsqueeze(-1)  # (B, k+1, 1)
        # Two triangular solves, not cholesky_solve: its batched CUDA path (MAGMA) allocates
        # per call, which a CUDA graph cannot capture.
        Lk = L[:, : k + 1, : k + 1]
        z = torch.linalg.solve_triangular(Lk, b, upper=False)
        return torch.linalg.solve_triangular(Lk.transpose(1, 2), z, upper=True)  # (B, k+1, 1)


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _fused_argmax(device: torch.device) -> bool:
    """Whether the atom choice runs as the Triton kernel of `_omp_cuda` (CUDA with Triton)."""
    return device.type == "cuda" and _triton_available()


def _argmax(a: torch.Tensor, block: int = 128) -> torch.Tensor:
    """argmax(a, dim=1) [B]; two-level (block maxima first) because a flat row argmax is
    ~3x slower on CPU at n = 8192."""
    B, n = a.shape
    if n % block or n <= block:
        return a.argmax(1)
    v = a.view(B, n // block, block)  # (B, blocks, block)
    blk = v.amax(-1).argmax(1)  # (B,)
    within = v[torch.arange(B, device=a.device), blk].argmax(1)
    return blk * block + within


def reference_omp(signals: torch.Tensor, atoms: torch.Tensor, sparsity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain OMP, one signal at a time, float64: the correctness reference for `batch_omp`."""
    D = atoms.double().cpu()
    all_idx, all_coef = [], []
    for y in signals.double().cpu():
        support: list[int] = []
        r = y.clone()
        coef = torch.zeros(0, dtype=torch.float64)
        for _ in range(sparsity):
            corr = (D.T @ r).abs()
            corr[support] = -1.0
            support.append(int(corr.argmax()))
            Ds = D[:, support]
            coef = torch.linalg.lstsq(Ds, y[:, None]).solution[:, 0]
            r = y - Ds @ coef
        all_idx.append(torch.tensor(support))
        all_coef.append(coef)
    return torch.stack(all_idx), torch.stack(all_coef).float()


def reconstruct_dense(indices: torch.Tensor, coefficients: torch.Tensor, table: torch.Tensor,
                      block_bytes: int = 1 << 28) -> torch.Tensor:
    """`reconstruct` as matrix products: each block of codes scattered into a dense [B, n] matrix
    of `table`'s dtype, times `table` = Dᵀ [n, m] (fp16 atoms hold their stored values exactly, and
    so do fp16 or e4m3 coefficients). A gather reads s atom rows per signal from memory, which
    for a large model's atoms (n·m·4 bytes, beyond a GPU's cache) runs at memory speed; a product
    reads them once per tile and runs at the device's matrix rate, at n/s times the arithmetic
    (for a GPU; a CPU keeps the gather). Float32 signals [N, m]; `block_bytes` bounds the dense
    blocks' memory."""
    n, m = table.shape
    out = torch.empty(indices.shape[0], m, dtype=torch.float32, device=table.device)
    rows = max(1, block_bytes // (n * table.element_size()))
    dense = torch.empty(min(rows, indices.shape[0]), n, dtype=table.dtype, device=table.device)
    for start in range(0, indices.shape[0], rows):
        idx, coef = indices[start:start + rows], coefficients[start:start + rows]
        block = dense[: idx.shape[0]].zero_()
        block.scatter_add_(1, idx.long(), coef.to(table.dtype))  # add: a repeated index sums, as the gather does
        out[start:start + idx.shape[0]] = block @ table
    return out


def reconstruct_csr(indices: torch.Tensor, coefficients: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`reconstruct` as one sparse-times-dense product: the codes as a CSR matrix [N, n] of s entries per
    row (`table`'s dtype) times `table` = Dᵀ [n, m] (cuSPARSE's SpMM on a GPU). A repeated index in a row
    sums, as the gather does. Float32 signals [N, m]."""
    import warnings

    N, s = indices.shape
    crow = torch.arange(0, N * s + 1, s, device=table.device, dtype=torch.int64)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": said once per process, to no one's use
        warnings.simplefilter("ignore", UserWarning)
        codes = torch.sparse_csr_tensor(crow, indices.reshape(-1).to(table.device, torch.int64),
                                        coefficients.reshape(-1).to(table.device, table.dtype),
                                        size=(N, table.shape[0]), device=table.device, check_invariants=False)
    return (codes @ table).float()


def reconstruct(indices: torch.Tensor, coefficients: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Signals [N, m] float32 from codes (indices, coefficients [N, s]) over atoms D [m, n]."""
    table = atoms.T.to(coefficients.device, torch.float32).contiguous()  # (n, m)
    return torch.nn.functional.embedding_bag(
        indices.long(), table, per_sample_weights=coefficients.float(), mode="sum"
    )
