"""Which FAISS index a store's segment gets, and how it is searched (no FAISS or torch imported:
the CLI's options read these)."""

from __future__ import annotations

HNSW_ABOVE = 50_000  # vectors in an index segment above which "auto" picks HNSW over exact search
IVF_ABOVE = 200_000  # and above which IVF over float16 vectors: half HNSW's bytes, memory-mapped, and on
# near-tied neighbours (BENCHMARKS.md, "A store for a real corpus") recall@8 0.999 where HNSW gives 0.75
INDEX_KINDS = ("auto", "flat", "hnsw", "ivf-f16", "ivf-sq8")
IVF_CODES = {"ivf-f16": "QT_fp16", "ivf-sq8": "QT_8bit"}  # ivf-sq8: half ivf-f16's bytes, recall 0.90 there
IVF_NPROBE = 16  # lists an IVF search visits (same section: recall@8 and latency against nprobe)
KIND_HELP = (f"exact (flat), HNSW, or IVF over float16 (ivf-f16) or 8-bit (ivf-sq8) vectors; auto picks by "
             f"a segment's size: HNSW above {HNSW_ABOVE:,} chunks, ivf-f16 above {IVF_ABOVE:,}")


def pick_kind(n: int, kind: str = "auto") -> str:
    """The index kind for `n` vectors: `kind`, or by size where it is "auto"."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    return "ivf-f16" if n > IVF_ABOVE else "hnsw" if n > HNSW_ABOVE else "flat"
