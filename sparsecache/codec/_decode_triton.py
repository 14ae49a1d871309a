"""The decode as one fused Triton kernel (`Codec.gpu_decode = "triton"`, #95 item 1).

Each program computes a [BLOCK_N signals × BLOCK_D values] tile of the output: for each of the s
(index, coefficient) pairs of its signals it reads those atoms' BLOCK_D-wide slices of the table Dᵀ
[n, m] (fp16 or bf16 atoms: an 8B shape's 8,192 × 2,048 table is 33.5 MB, so it stays in an H100's
50 MB L2) and accumulates in float32; the output is written once, float32. No dense [N, n] matrix (the
"dense" form) and no per-signal gather of whole atom rows in float32 (the "gather" form).

Triton compiles for a GPU; on a CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`,
read when the kernel is first built), which is how the tests check it against the CPU reference.
"""

from __future__ import annotations

import functools

import torch

BLOCK_N = 32  # signals per program
BLOCK_D = 128  # output values per program (one tile of a signal's L·m)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode(idx_ptr, coef_ptr, table_ptr, out_ptr, N, D, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        rmask, cmask = rows < N, cols < D
        acc = tl.zeros((BN, BD), dtype=tl.float32)
        for j in tl.static_range(S):
            a = tl.load(idx_ptr + rows * S + j, mask=rmask, other=0).to(tl.int64)
            c = tl.load(coef_ptr + rows * S + j, mask=rmask, other=0.0).to(tl.float32)
            t = tl.load(table_ptr + a[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += c[:, None] * t.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])

    return decode


def reconstruct_triton(indices: torch.Tensor, coefficients: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`omp.reconstruct` through the fused kernel: signals [N, m] float32 from codes (indices, coefficients
    [N, s]) over `table` = Dᵀ [n, m] on the same device. A repeated index sums, as the gather does."""
    import triton

    N, s = indices.shape
    n, D = table.shape
    out = torch.empty(N, D, dtype=torch.float32, device=table.device)
    if N == 0:
        return out
    idx = indices.to(table.device, torch.int32).contiguous()
    coef = coefficients.to(table.device, torch.float32).contiguous()
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(D, BLOCK_D))
    _kernel()[grid](idx, coef, table.contiguous(), out, N, D, S=s, BN=BLOCK_N, BD=BLOCK_D)
    return out
