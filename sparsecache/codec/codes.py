"""What a stored code is, below both the codec that makes it and the store that keeps it.

A code for one signal (one token × one group of L layers) is a fixed-width row of atom
indices (b-bit packed or Elias–Fano coded, `bitpack`) plus s coefficients. The store lays
these out as arrays (`store.layout`); the codec encodes and decodes them (`codec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The coefficient formats a store holds, and the numpy dtype each is stored as: numpy has no
# fp8, so e4m3 coefficients are stored as their bytes.
STORAGE_DTYPES = {"float16": "float16", "float32": "float32", "float8": "uint8"}
COEF_DTYPE_NAMES = tuple(STORAGE_DTYPES)
INDEX_CODINGS = ("packed", "elias-fano")


def index_row_bytes(config, indices: str) -> int:
    """Bytes of one signal's atom indices for a DictConfig under an index coding."""
    from .bitpack import ef_row_bytes, row_bytes  # torch: not needed for the names above (the CLI's choices)

    if indices == "elias-fano":
        return ef_row_bytes(config.sparsity, config.atoms)
    return row_bytes(config.sparsity, config.index_bits)


@dataclass
class Codes:
    """Codes of one K or V tensor: indices uint8 [G, T, row_bytes], coefficients [G, T, s]."""

    indices: np.ndarray
    coefficients: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.indices.nbytes + self.coefficients.nbytes
