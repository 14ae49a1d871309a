"""Decode on the CPU as one compiled gather-accumulate per (layer, signal block) (numba).

A signal's decode is Σ_t c_t · D[:, a_t]: s atom columns of L·m values from a table of n
atoms. At the default (n = 8192, L·m = 1920) the fp32 table is 63 MB per kind, larger than
the last-level cache, so `embedding_bag` fetches every gathered row from DRAM. Here the table
is held in fp16 (the precision the dictionary is stored in, so nothing is lost) and cut into
column tiles of one layer each (8192 × 192 × 2 bytes = 3 MB, cache-resident): all signals
are decoded one tile at a time, reading half the bytes from cache instead of memory. Each
tile's result goes straight to its place in [layers, T, m], divided by the layer's scale,
so no separate permute or scaling pass runs.

Conversion fp16 → fp32 is one LLVM `fpext` (an F16C instruction on x86), exact. The kernel is
bound by the latency of the random row gathers, not bandwidth (narrower tiles that fit L2
were slower), so each row is prefetched a few terms before it is used (1.5x).
"""

from __future__ import annotations

import mmap

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import numba_pool

numba_pool.start()  # before any kernel runs: see numba_pool

PREFETCH_AHEAD = 4  # atom rows requested this many terms before they are summed (2-8 measured alike)


@intrinsic
def _as_float(typingctx, x):
    """x as float32: a uint16 is the bits of an IEEE half (converted exactly), a float32 is itself."""
    if x == types.float32:
        return types.float32(types.float32), lambda context, builder, sig, args: args[0]
    if x != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _prefetch(typingctx, arr, i):
    """Ask the cache for the line holding flat element i of the C-contiguous `arr` (no fault)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(arr, i), codegen


def empty_huge(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array backed by memory the kernel may give in 2 MB pages
    (madvise; Linux only, else an ordinary array). The decode's output is written once, right
    after allocation: in 4 KB pages the first touch of 8 chunks' K (90 MB) cost ~55 ms of
    page faults, a third of the decode."""
    n = int(np.prod(shape)) * 4
    if n < 1 << 22 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, np.float32)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.float32).reshape(shape)  # the array keeps the mapping alive


def atom_tiles(atoms: np.ndarray, width: int, half: bool) -> np.ndarray:
    """The atoms D [L·m, n] in column tiles [L·m / width, n, width]: fp16 bits (uint16) when
    `half` (exact only for atoms that are fp16 values), float32 otherwise."""
    d, n = atoms.shape
    rows = np.ascontiguousarray(atoms.T, dtype=np.float16).view(np.uint16) if half else \
        np.ascontiguousarray(atoms.T, dtype=np.float32)  # (n, d)
    return np.ascontiguousarray(rows.reshape(n, d // width, width).transpose(1, 0, 2))


@numba.njit(parallel=True, cache=True, nogil=True)
def ef_decode(packed: np.ndarray, count: int, low_bits: int, out: np.ndarray) -> int:
    """Elias–Fano rows uint8 [N, row_bytes] (`bitpack.pack_sorted_rows`) → out [N, count];
    returns how many rows do not hold exactly `count` values (damaged codes)."""
    N, nb = packed.shape
    bad = 0
    for r in numba.prange(N):
        row = packed[r]
        bit = 0
        for j in range(count):  # low parts: `low_bits` each, most significant bit first
            v = 0
            for _ in range(low_bits):
                v = (v << 1) | ((row[bit >> 3] >> (7 - (bit & 7))) & 1)
                bit += 1
            out[r, j] = v
        j = 0
        for pos in range(nb * 8 - count * low_bits):  # the upper parts' unary bit vector
            b = bit + pos
            if (row[b >> 3] >> (7 - (b & 7))) & 1:
                if j < count:
                    out[r, j] |= (pos - j) << low_bits
                j += 1
        if j != count:
            bad += 1
    return bad


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def decode_tiles(idx: np.ndarray, coef: np.ndarray, tiles: np.ndarray, inv_scale: np.ndarray,
                 out: np.ndarray, n_threads: int) -> None:
    """out [G·L, T, m] float32 from codes idx, coef [G·T, s] (signal g·T + t) over column
    tiles [L·m / W, n, W] (`atom_tiles`); every layer is multiplied by inv_scale [G·L]."""
    n_tiles, _, W = tiles.shape
    GL, T, m = out.shape
    per_layer = m // W
    L = n_tiles // per_layer
    G = GL // L
    N, s = idx.shape
    block = (T + n_threads - 1) // n_threads
    for task in numba.prange(G * n_tiles * n_threads):
        part = task % n_threads
        ti = (task // n_threads) % n_tiles
        g = task // (n_threads * n_tiles)
        layer = g * L + ti // per_layer
        e0 = (ti % per_layer) * W
        tile = tiles[ti]
        flat = tile.reshape(-1)
        f = inv_scale[layer]
        acc = np.empty(W, np.float32)
        for t in range(part * block, min(T, (part + 1) * block)):
            b = g * T + t
            acc[:] = 0.0
            for k in range(s):
                # the gathered rows are random, so the hardware prefetcher cannot guess them:
                # request the row PREFETCH_AHEAD terms ahead (into the next signal at the end)
                ahead = k + PREFETCH_AHEAD
                nb = b if ahead < s else min(b + 1, N - 1)
                base = idx[nb, ahead % s] * W
                for o in range(0, W, 32):
                    _prefetch(flat, base + o)
                c = coef[b, k]
                row = tile[idx[b, k]]
                for w in range(W):
                    acc[w] += c * _as_float(row[w])
            dst = out[layer, t]
            for w in range(W):
                dst[e0 + w] = acc[w] * f
