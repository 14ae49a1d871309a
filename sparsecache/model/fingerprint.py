"""Model fingerprints: what a dictionary and a store record of the model whose K/V they hold,
so that neither is used with another (`model.config_fingerprint` makes one)."""

from __future__ import annotations

from ..errors import DictionaryMismatch

# The fingerprint fields that must match for K/V to mean the same; "name" is for messages.
FINGERPRINT_FIELDS = ("config_hash", "layers", "m")


def same_model(fingerprint: dict, recorded: dict) -> bool:
    """Whether two fingerprints describe K/V of the same meaning (names are for messages only)."""
    return all(fingerprint.get(k) == recorded.get(k) for k in FINGERPRINT_FIELDS)


def check_same_model(fingerprint: dict, recorded: dict, what: str) -> None:
    """Raise DictionaryMismatch unless `what` (recorded with `recorded`) holds K/V of the
    model `fingerprint` describes."""
    if not same_model(fingerprint, recorded):
        raise DictionaryMismatch(f"{what} was encoded with model {recorded.get('name')}, "
                                 f"not {fingerprint.get('name')}: pass that model with --model")
