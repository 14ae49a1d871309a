"""b-bit index packing (b in 1..16): the paper's Algorithm 4 layout, generalised.

Values are concatenated MSB-first into one bit stream (value 0's bit b−1 is the stream's
first bit) and the stream is cut into bytes; the last byte is zero-padded. n values take
exactly ceil(n·b / 8) bytes. For b = 13 every group of 8 indices fills 13 bytes, as in the
paper. numpy (`pack_indices` / `unpack_indices`) and torch (`unpack_indices_torch`, runs on
any device) produce and read the same bytes; `reference_pack` is the plain bit loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` values of `bits` bits occupy."""
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")


def pack_indices(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative integers < 2**bits (any shape, flattened) into uint8 [ceil(n·bits/8)]."""
    _check_bits(bits)
    v = np.asarray(values).reshape(-1).astype(np.uint32)
    if v.size and int(v.max()) >> bits:
        raise ValueError(f"value {int(v.max())} does not fit in {bits} bits")
    # (n, bits) bit matrix, MSB first, flattened into the stream, then 8 bits per byte.
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint32)
    stream = ((v[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(stream)


def unpack_indices(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """The first `count` values (int64) from bytes written by `pack_indices`."""
    _check_bits(bits)
    if packed.size < packed_size(count, bits):
        raise ValueError(f"{packed.size} bytes cannot hold {count} values of {bits} bits")
    stream = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.int64)
    return stream.reshape(count, bits).astype(np.int64) @ weights


def unpack_indices_torch(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """`unpack_indices` on a uint8 tensor, on its device; returns int64 [count].

    Each value spans at most 3 bytes (b ≤ 16), so it is read as a 24-bit window starting at
    its first byte, shifted and masked: a gather and a few integer ops, no bit matrix.
    """
    _check_bits(bits)
    if packed.numel() < packed_size(count, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {count} values of {bits} bits")
    p = torch.nn.functional.pad(packed.reshape(-1).long(), (0, 3))
    start = torch.arange(count, device=packed.device) * bits  # first bit of each value
    byte = start >> 3
    window = (p[byte] << 16) | (p[byte + 1] << 8) | p[byte + 2]  # 24 bits
    shift = 24 - bits - (start & 7)
    return (window >> shift) & ((1 << bits) - 1)


def reference_pack(values: list[int], bits: int) -> bytes:
    """Plain bit-by-bit packing, the reference the vectorised versions are tested against."""
    out, acc, filled = bytearray(), 0, 0
    for v in values:
        for i in range(bits - 1, -1, -1):
            acc = (acc << 1) | ((v >> i) & 1)
            filled += 1
            if filled == 8:
                out.append(acc)
                acc, filled = 0, 0
    if filled:
        out.append(acc << (8 - filled))
    return bytes(out)


def row_bytes(count: int, bits: int) -> int:
    """Bytes of one packed row of `count` values: rows start on byte boundaries."""
    return packed_size(count, bits)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[N, s] integers → uint8 [N, row_bytes(s, bits)], each row packed as by `pack_indices`."""
    _check_bits(bits)
    v = np.asarray(values).astype(np.uint32)
    N, s = v.shape
    if v.size and int(v.max()) >> bits:
        raise ValueError(f"value {int(v.max())} does not fit in {bits} bits")
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint32)
    stream = ((v[:, :, None] >> shifts) & 1).astype(np.uint8).reshape(N, s * bits)  # (N, s·b)
    return np.packbits(stream, axis=1)


def unpack_rows(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """uint8 [N, row_bytes] → int64 [N, count], the inverse of `pack_rows`."""
    _check_bits(bits)
    stream = np.unpackbits(np.asarray(packed, dtype=np.uint8), axis=1, count=count * bits)  # (N, s·b)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.int64)
    return stream.reshape(-1, count, bits).astype(np.int64) @ weights


def unpack_rows_torch(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """`unpack_rows` on a uint8 tensor [N, row_bytes], on its device; returns int64 [N, count]."""
    _check_bits(bits)
    if bits in (8, 16):  # byte-aligned (Elias–Fano's low bits at s = 32 over 8192 atoms): no bit arithmetic
        rows = packed[:, : count * bits // 8].long()
        return rows if bits == 8 else (rows[:, 0::2] << 8) | rows[:, 1::2]
    p = torch.nn.functional.pad(packed.long(), (0, 3))  # (N, row_bytes + 3)
    start = torch.arange(count, device=packed.device) * bits
    byte = (start >> 3)[None].expand(p.shape[0], -1)  # (N, count)
    window = (p.gather(1, byte) << 16) | (p.gather(1, byte + 1) << 8) | p.gather(1, byte + 2)
    return (window >> (24 - bits - (start & 7))) & ((1 << bits) - 1)


# ---------------------------------------------------------------- Rice-coded index sets
# A sparse code's atoms are a set: sorted, its gaps g_j = i_j − i_{j−1} − 1 (i_0 = −1) are
# small and roughly geometric, so Rice coding (quotient g >> k in unary, remainder in k
# bits) beats fixed-width indices by up to log2(s!)/s bits per index. Remainders and
# quotients go in two streams so both directions stay vectorised: remainders are fixed-width
# rows (`pack_rows`), quotients one unary bit stream (q zeros, then a one).


def sorted_codes(idx: np.ndarray, coef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [N, s] with each row's atoms ascending (the coefficients follow their atoms)."""
    order = np.argsort(idx, axis=1, kind="stable")
    return np.take_along_axis(idx, order, 1), np.take_along_axis(coef, order, 1)


def _gaps(sorted_idx: np.ndarray) -> np.ndarray:
    return np.diff(sorted_idx.astype(np.int64), axis=1, prepend=-1) - 1


def rice_bits(sorted_idx: np.ndarray, k: int) -> int:
    """Total bits of the Rice code with parameter k for these sorted rows."""
    g = _gaps(sorted_idx)
    return int(g.size * (k + 1) + (g >> k).sum())


def rice_parameter(sorted_idx: np.ndarray, max_k: int = 16) -> int:
    """The k in 0..max_k that codes these rows in the fewest bits."""
    return min(range(max_k + 1), key=lambda k: rice_bits(sorted_idx, k))


@dataclass(frozen=True)
class RiceCode:
    remainders: np.ndarray  # uint8 [N, row_bytes(s, k)] (empty rows when k = 0)
    unary: np.ndarray  # uint8, the quotients' bit stream
    k: int

    @property
    def nbytes(self) -> int:
        return self.remainders.nbytes + self.unary.nbytes


def rice_encode(sorted_idx: np.ndarray, k: int) -> RiceCode:
    g = _gaps(sorted_idx)
    if g.size and g.min() < 0:
        raise ValueError("rows must be strictly ascending (a sparse code never repeats an atom)")
    q = (g >> k).ravel()
    ones = np.cumsum(q + 1) - 1
    stream = np.zeros(int(ones[-1]) + 1 if ones.size else 0, dtype=bool)
    stream[ones] = True
    rem = pack_rows(g & ((1 << k) - 1), k) if k else np.zeros((g.shape[0], 0), np.uint8)
    return RiceCode(rem, np.packbits(stream), k)


def rice_decode(code: RiceCode, rows: int, count: int) -> np.ndarray:
    """int64 [rows, count] ascending atom indices from `rice_encode`'s output."""
    ones = np.flatnonzero(np.unpackbits(code.unary))[: rows * count]
    q = np.diff(ones, prepend=-1) - 1
    g = q.reshape(rows, count) << code.k
    if code.k:
        g |= unpack_rows(code.remainders, count, code.k)
    return np.cumsum(g + 1, axis=1) - 1


# ---------------------------------------------------------------- Elias–Fano rows
# Rice codes are variable-length, which would cost the store its fixed-width rows (random
# access by token, direct chunk reads, one reshape on the GPU). Elias–Fano codes a sorted set
# of `count` values below `universe` in a fixed size: each value's low l bits verbatim, and
# its high part as a unary bit vector of count + ((universe − 1) >> l) bits in which value j
# sets bit (value >> l) + j. With l ≈ log2(universe / count) that is ≤ 2 + log2(universe/count)
# bits per value: 10 bits per index at s = 32 over 8192 atoms (Rice: 9.5 on average, packed: 13).
# Row layout, MSB-first like `pack_rows`: [low bits of value 0 .. count−1][upper bit vector].


def ef_low_bits(count: int, universe: int) -> int:
    """The low-bit width l that makes Elias–Fano rows shortest (ties: the larger l)."""
    return min(range(17), key=lambda l: (count * l + ((universe - 1) >> l), -l))


def ef_row_bits(count: int, universe: int) -> int:
    l = ef_low_bits(count, universe)
    return count * l + count + ((universe - 1) >> l)


def ef_row_bytes(count: int, universe: int) -> int:
    """Bytes of one Elias–Fano row (rows start on byte boundaries)."""
    return (ef_row_bits(count, universe) + 7) // 8


def pack_sorted_rows(sorted_idx: np.ndarray, universe: int) -> np.ndarray:
    """[N, s] strictly ascending rows of values < universe → uint8 [N, ef_row_bytes(s, universe)]."""
    v = np.asarray(sorted_idx).astype(np.int64)
    N, s = v.shape
    if v.size and (v.min() < 0 or v.max() >= universe):
        raise ValueError(f"values must lie in [0, {universe})")
    if s > 1 and (np.diff(v, axis=1) <= 0).any():
        raise ValueError("rows must be strictly ascending (a sparse code never repeats an atom)")
    l = ef_low_bits(s, universe)
    upper = np.zeros((N, s + ((universe - 1) >> l)), np.uint8)  # (N, U)
    np.put_along_axis(upper, (v >> l) + np.arange(s), 1, axis=1)
    low = ((v[:, :, None] >> np.arange(l - 1, -1, -1)) & 1).astype(np.uint8).reshape(N, s * l)  # (N, s·l)
    return np.packbits(np.concatenate([low, upper], axis=1), axis=1)


def unpack_sorted_rows(packed: np.ndarray, count: int, universe: int) -> np.ndarray:
    """uint8 [N, row_bytes] → int64 [N, count] ascending, the inverse of `pack_sorted_rows`."""
    l = ef_low_bits(count, universe)
    packed = np.asarray(packed, np.uint8)
    low = unpack_rows(packed, count, l) if l else 0  # the low bits are a `pack_rows` row prefix
    upper = np.unpackbits(packed, axis=1, count=ef_row_bits(count, universe))[:, count * l:]  # (N, U)
    ones = np.flatnonzero(upper) % upper.shape[1]  # row-major: each row's set bits in order
    return ((ones.reshape(-1, count) - np.arange(count)) << l) | low


def unpack_sorted_rows_torch(packed: torch.Tensor, count: int, universe: int) -> torch.Tensor:
    """`unpack_sorted_rows` on a uint8 tensor [N, row_bytes], on its device; int64 [N, count].

    `nonzero` lists each row's set bits in order; the j-th one's column minus j is value j's
    high part. (A sync-free cumsum + scatter version was 6x slower on the CPU.)"""
    l = ef_low_bits(count, universe)
    N, U = packed.shape[0], ef_row_bits(count, universe) - count * l
    low = unpack_rows_torch(packed, count, l) if l else 0  # (N, count)
    first = count * l // 8  # the upper vector starts in this byte
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = ((packed[:, first:, None] >> shifts) & 1).reshape(N, -1)  # (N, 8·(row_bytes − first))
    upper = bits[:, count * l - 8 * first:][:, :U]  # (N, U)
    cols = upper.nonzero()[:, 1]
    if cols.numel() != N * count:
        raise ValueError(f"not Elias–Fano rows of {count} values: {cols.numel()} set bits in {N} rows")
    return ((cols.view(N, count) - torch.arange(count, device=packed.device)) << l) | low


def reference_sorted_pack(values: list[int], universe: int) -> bytes:
    """Plain Elias–Fano packing of one ascending row, bit by bit: the reference for the above."""
    s = len(values)
    l = ef_low_bits(s, universe)
    bits = [(v >> i) & 1 for v in values for i in range(l - 1, -1, -1)]
    upper = [0] * (s + ((universe - 1) >> l))
    for j, v in enumerate(values):
        upper[(v >> l) + j] = 1
    bits += upper
    bits += [0] * (-len(bits) % 8)
    return bytes(int("".join(map(str, bits[i:i + 8])), 2) for i in range(0, len(bits), 8))
