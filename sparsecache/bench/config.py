"""What the quality benchmarks evaluate on: plain dataclasses, importable without torch, so
the CLI takes its defaults (and `--help` states them) from here."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import FORWARD_DTYPE


@dataclass(frozen=True)
class FrontierConfig:
    """What `bench quality` evaluates on; serialised into its JSON."""

    passages: int = 8
    prefix_tokens: int = 512  # also the chunk length T the per-chunk bytes are counted for
    continuation_tokens: int = 64
    trials: int = 16
    needle_chunks: int = 4
    needle_chunk_tokens: int = 128
    fusion: str = "infoflow"  # the recomputation method the query issue measured best
    recompute_ratio: float = 0.15
    corpus_tokens: int = 1_000_000  # what dictionary/basis overhead is spread over
    learn_steps: int = 300  # for dictionaries neither shipped nor cached
    atoms: int = 8192
    seed: int = 0


@dataclass(frozen=True)
class EvalConfig:
    """What `eval-dict` evaluates a dictionary on."""

    passages: int = 16
    prefix_tokens: int = 512
    continuation_tokens: int = 64
    coef_dtype: str = "float16"
    screening: object = None  # an omp.Screening; None: as the CPU encoder codes by default (omp.EXACT: exact Batch-OMP)
    forward_dtype: str = FORWARD_DTYPE  # the K/V coded: the encode forward's, in this dtype (FORWARD_DTYPES)
    first_layer: str = "tokens"  # as a store is read (QueryConfig.first_layer): layer 0 exact, from the tokens; or "codes"
