"""What a dictionary is and how one is learned or adapted: plain dataclasses, importable
without torch (the CLI states their defaults in --help without loading it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

# how a dictionary file may store its atoms (dictionary.ATOM_DTYPES maps them to torch dtypes)
ATOM_DTYPE_NAMES = ("float16", "float32")


def check_atoms_dtype(name: str) -> None:
    if name not in ATOM_DTYPE_NAMES:
        raise ConfigError(f"atoms_dtype must be one of {sorted(ATOM_DTYPE_NAMES)}, got {name!r}")


@dataclass(frozen=True)
class DictConfig:
    """What a dictionary is: its size, the codes' sparsity and the layer grouping."""

    atoms: int = 8192
    sparsity: int = 32  # learn-dict's from-scratch default; the shipped default is L10, s = 80 (dictionaries/README.md)
    layers_per_signal: int = 5

    def __post_init__(self):
        if not 2 <= self.atoms <= 65536:
            raise ConfigError(f"atoms must be in 2..65536 (indices pack into ≤16 bits), got {self.atoms}")
        if not 1 <= self.sparsity <= self.atoms:
            raise ConfigError(f"sparsity must be in 1..atoms, got {self.sparsity}")
        if self.layers_per_signal < 1:
            raise ConfigError(f"layers_per_signal must be ≥ 1, got {self.layers_per_signal}")

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.atoms)))

    def check_signal(self, n_layers: int, m: int) -> None:
        """Raise ConfigError if this config cannot code a model with these dimensions."""
        from .signals import check_grouping

        check_grouping(n_layers, self.layers_per_signal)
        if self.sparsity > self.layers_per_signal * m:
            raise ConfigError(f"sparsity {self.sparsity} exceeds the signal size {self.layers_per_signal * m}")


@dataclass(frozen=True)
class TrainConfig:
    """How a dictionary is learned; written into its metadata."""

    steps: int = 3000
    batch: int = 4096
    lr: float = 0.5
    lr_v: float | None = 0.1  # V prefers a smaller step (held-out NMSE, BENCHMARKS.md); None = lr
    lr_final_fraction: float = 0.05
    precondition: bool = True
    normalize: bool = True
    init: str = "data"
    dead_after: int = 150
    val_every: int = 50
    val_signals: int = 4096
    patience: int = 10
    seed: int = 0
    chunk_tokens: int = 256
    max_tokens: int = 150_000
    layer_scales: bool = True  # equal energy per layer inside signals of L > 1 layers (Dictionary.scales)
    atoms_dtype: str = "float16"  # how the learned atoms are written (ATOM_DTYPES); checkpoints stay float32

    def __post_init__(self):
        if self.steps < 1 or self.batch < 1:
            raise ConfigError("steps and batch must be ≥ 1")
        check_atoms_dtype(self.atoms_dtype)
        if self.init not in ("data", "random"):
            raise ConfigError(f"init must be 'data' or 'random', got {self.init!r}")


@dataclass(frozen=True)
class AdaptConfig:
    """How `encode-corpus --adapt` fits a dictionary to a new store's corpus; kept in its metadata."""

    steps: int = 100
    tokens: int = 60_000  # calibration tokens sampled from the corpus (~2 min of KV extraction on 2 CPU cores)
    batch: int = 1024
    seed: int = 0

    def train_config(self) -> TrainConfig:
        return TrainConfig(steps=self.steps, batch=self.batch, max_tokens=self.tokens, seed=self.seed,
                           val_every=max(1, min(25, self.steps // 4)), patience=1_000_000)
