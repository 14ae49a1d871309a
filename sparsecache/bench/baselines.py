"""What a user would otherwise store: the KV compressors sparsecache is measured against.

Each baseline maps one chunk's K or V [n_layers, T, m] (pre-RoPE keys, as the store keeps
them) to what a reader gets back, and counts the bytes it would store for that chunk:

- `Fp16`: raw half precision (TurboRAG/LMCache-style stores), 1×.
- `Fp8`: a plain e4m3 cast (saturating at ±448), 2×.
- `Kivi`: KIVI's asymmetric group quantisation, keys per channel (a group is 32 tokens of
  one channel) and values per token (32 channels of one token), fp16 scale and zero per
  group. KIVI keeps the newest tokens in fp16 while a generation runs; a stored corpus
  chunk has no such tail, so every token is quantised (a last partial group included).
- `LayerSVD`: per layer and chunk, the centred rank-r truncated SVD; stored: token
  coefficients T×r, the basis r×m and the mean m, all fp16.
- `CrossLayerSVD` (xKV): the same over groups of `group` consecutive layers concatenated
  along channels, so the token subspace is shared across the group; a last group with
  fewer layers takes the remainder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codec.coding import to_e4m3


@dataclass(frozen=True)
class Fp16:
    family = "fp16"

    @property
    def label(self) -> str:
        return "fp16"

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return x.half().float()

    def nbytes(self, n_layers: int, T: int, m: int, kind: str) -> float:
        return 2.0 * n_layers * T * m


@dataclass(frozen=True)
class Fp8:
    family = "fp8"

    @property
    def label(self) -> str:
        return "fp8-e4m3"

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return to_e4m3(x).float()

    def nbytes(self, n_layers: int, T: int, m: int, kind: str) -> float:
        return 1.0 * n_layers * T * m


def quantize_groups(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min/max quantisation along the last dim (one group per row), dequantised.
    Scale and zero are rounded to fp16 as they would be stored."""
    levels = 2 ** bits - 1
    lo = x.amin(-1, keepdim=True).half().float()
    scale = ((x.amax(-1, keepdim=True) - lo) / levels).half().float()
    q = torch.round((x - lo) / scale.clamp_min(1e-8)).clamp(0, levels)
    return q * scale + lo


@dataclass(frozen=True)
class Kivi:
    bits: int = 2
    group: int = 32
    family = "kivi"

    @property
    def label(self) -> str:
        return f"kivi-int{self.bits}"

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        # keys: groups run along tokens within a channel; values: along channels within a token
        y = x.transpose(1, 2) if kind == "k" else x  # (L, rows, n) with groups along n
        parts = [quantize_groups(y[..., a : a + self.group], self.bits)  # a partial last group too
                 for a in range(0, y.shape[-1], self.group)]
        y = torch.cat(parts, -1)
        return y.transpose(1, 2).contiguous() if kind == "k" else y

    def nbytes(self, n_layers: int, T: int, m: int, kind: str) -> float:
        groups = n_layers * (m * math.ceil(T / self.group) if kind == "k" else T * math.ceil(m / self.group))
        return n_layers * T * m * self.bits / 8 + groups * 2 * 2


def _truncated(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Centred rank-`rank` SVD approximation of x [T, d] (fp16 factors, as stored)."""
    mean = x.mean(0, keepdim=True).half().float()
    U, S, Vh = torch.linalg.svd(x - mean, full_matrices=False)
    r = min(rank, S.shape[0])
    coef = (U[:, :r] * S[:r]).half().float()
    return coef @ Vh[:r].half().float() + mean


@dataclass(frozen=True)
class LayerSVD:
    rank: int = 32
    family = "svd"

    @property
    def label(self) -> str:
        return f"svd-r{self.rank}"

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return torch.stack([_truncated(layer.float(), self.rank) for layer in x])

    def nbytes(self, n_layers: int, T: int, m: int, kind: str) -> float:
        r = min(self.rank, T, m)
        return 2.0 * n_layers * (T * r + r * m + m)


@dataclass(frozen=True)
class CrossLayerSVD:
    rank: int = 64
    group: int = 4
    family = "xkv"

    @property
    def label(self) -> str:
        return f"xkv{self.group}-r{self.rank}"

    def groups(self, n_layers: int) -> list[range]:
        return [range(a, min(a + self.group, n_layers)) for a in range(0, n_layers, self.group)]

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        L, T, m = x.shape
        out = torch.empty_like(x, dtype=torch.float32)
        for g in self.groups(L):
            wide = x[g.start : g.stop].float().permute(1, 0, 2).reshape(T, len(g) * m)  # (T, |g|·m)
            out[g.start : g.stop] = _truncated(wide, self.rank).view(T, len(g), m).permute(1, 0, 2)
        return out

    def nbytes(self, n_layers: int, T: int, m: int, kind: str) -> float:
        total = 0.0
        for g in self.groups(n_layers):
            d = len(g) * m
            r = min(self.rank, T, d)
            total += 2.0 * (T * r + r * d + d)
        return total


def default_baselines() -> list:
    """The baselines `bench quality` runs, at ratios that bracket sparsecache's (T = 512)."""
    return [Fp16(), Fp8(), Kivi(4), Kivi(2),
            *(LayerSVD(r) for r in (8, 16, 32, 48)),
            *(CrossLayerSVD(r) for r in (16, 32, 64, 96))]
