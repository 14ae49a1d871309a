"""Global K/V dictionaries: the artifact (atoms, per-layer scales, metadata), its file
format, its fingerprint, and where the shipped ones live. How one is learned is `learn.py`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .. import __version__
from ..durable import publish_file, write_atomic
from ..errors import DictionaryError, DictionaryMismatch
from ..model.fingerprint import FINGERPRINT_FIELDS, same_model
from .config import DictConfig, check_atoms_dtype

FORMAT_VERSION = 2  # 2: per-layer scales (written only by dictionaries that have them)
ATOMS_FILE = "atoms.safetensors"
META_FILE = "dictionary.json"
KINDS = ("k", "v")
# how a dictionary file stores its atoms; in memory they are always float32. float16 halves the
# file (a 10-layer dictionary is 126 MB in float32, over GitHub's 100 MB file limit) and costs
# nothing measurable: each value rounds to within 2^-11 of itself (docs/benchmarks-history.md, "float16 atoms")
ATOM_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class Dictionary:
    """D_K and D_V [L·m, atoms] float32 with unit-norm columns, plus what they were made for.

    `scales` (optional) holds one factor per model layer for K and for V [n_layers]: a layer's
    K/V is multiplied by it before coding and divided by it after decoding. Inside a signal of
    L layers OMP minimises the group's total error, so a layer with 1% of the group's energy
    (the default model's layer-0 V) was left with errors larger than itself; equal energy per
    layer bounds every layer's error (docs/benchmarks-history.md, "Per-layer scales")."""

    keys: torch.Tensor
    values: torch.Tensor
    config: DictConfig
    model: dict
    meta: dict = field(default_factory=dict)
    scales: dict[str, torch.Tensor] | None = None
    atoms_dtype: str = "float32"  # how save() writes the atoms (ATOM_DTYPES)

    def __post_init__(self):
        check_atoms_dtype(self.atoms_dtype)

    def stored_as(self, atoms_dtype: str) -> "Dictionary":
        """This dictionary with its atoms rounded to `atoms_dtype` (still float32 in memory), as
        save() writes it and load() reads it back: the fingerprint is the same on both sides."""
        t = ATOM_DTYPES[atoms_dtype]
        return replace(self, keys=self.keys.to(t).float(), values=self.values.to(t).float(), atoms_dtype=atoms_dtype)

    def atoms(self, kind: str) -> torch.Tensor:
        return self.keys if kind == "k" else self.values

    def scale(self, kind: str) -> torch.Tensor | None:
        """Per-layer factors [n_layers] applied before coding `kind`, or None."""
        return None if self.scales is None else self.scales[kind]

    @property
    def signal_dim(self) -> int:
        return self.keys.shape[0]

    def fingerprint(self) -> str:
        """sha256 of the atoms and config: what a store records to refuse another dictionary."""
        h = hashlib.sha256(json.dumps(asdict(self.config), sort_keys=True).encode())
        for t in (self.keys, self.values, *(self.scales or {}).values()):
            h.update(t.contiguous().float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def check_model(self, fingerprint: dict) -> None:
        """Raise DictionaryMismatch unless this dictionary was learned on a model like `fingerprint`."""
        mine = self.model
        for key in FINGERPRINT_FIELDS:
            if mine.get(key) != fingerprint.get(key):
                raise DictionaryMismatch(
                    f"dictionary was learned for {mine.get('name')} ({key}={mine.get(key)}), "
                    f"not for {fingerprint.get('name')} ({key}={fingerprint.get(key)})"
                )

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes of the atoms as the file stores them: of `kind`, or of both K and V."""
        per_kind = self.keys.numel() * ATOM_DTYPES[self.atoms_dtype].itemsize
        return per_kind if kind is not None else 2 * per_kind

    def save(self, path: str | Path) -> Path:
        """Write `path/atoms.safetensors` and `path/dictionary.json`; returns the directory."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        d = self.stored_as(self.atoms_dtype)  # the fingerprint of what load() will read
        meta = {
            "format_version": FORMAT_VERSION if self.scales is not None else 1,  # old readers keep reading
            "library_version": __version__,
            **asdict(self.config),
            "model": self.model,
            "fingerprint": d.fingerprint(),
            **self.meta,
        }
        t = ATOM_DTYPES[self.atoms_dtype]
        tensors = {"keys": d.keys.to(t).contiguous().cpu(), "values": d.values.to(t).contiguous().cpu()}
        if self.scales is not None:
            tensors.update({f"{name}_scales": self.scales[k].float().contiguous().cpu()
                            for k, name in zip(KINDS, ("keys", "values"))})
        publish_file(out / ATOMS_FILE, lambda tmp: save_file(tensors, str(tmp)))
        write_atomic(out / META_FILE, json.dumps(meta, indent=2, default=str) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Dictionary":
        """Load from the directory `save` wrote (or either file inside it)."""
        from safetensors.torch import load_file

        root = dictionary_dir(path)
        if not (root / META_FILE).exists() or not (root / ATOMS_FILE).exists():
            raise DictionaryError(f"no dictionary at {path} (expected {META_FILE} and {ATOMS_FILE})")
        try:
            meta = json.loads((root / META_FILE).read_text())
            tensors = load_file(str(root / ATOMS_FILE))
        except (OSError, ValueError) as e:
            raise DictionaryError(f"{root}: unreadable dictionary: {e}") from e
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise DictionaryError(f"{root}: written by a newer sparsecache (format {meta['format_version']})")
        config = DictConfig(meta["atoms"], meta["sparsity"], meta["layers_per_signal"])
        extra = {k: v for k, v in meta.items() if k not in (*asdict(config), "model", "format_version",
                                                             "library_version", "fingerprint")}
        scales = ({k: tensors[f"{name}_scales"].float() for k, name in zip(KINDS, ("keys", "values"))}
                  if "keys_scales" in tensors else None)
        stored = {t: name for name, t in ATOM_DTYPES.items()}.get(tensors["keys"].dtype)
        if stored is None or tensors["values"].dtype != tensors["keys"].dtype:
            raise DictionaryError(f"{root}: atoms must be float32 or float16, got {tensors['keys'].dtype}")
        d = cls(tensors["keys"].float(), tensors["values"].float(), config, meta["model"], extra, scales, stored)
        if d.keys.shape != (d.keys.shape[0], config.atoms) or d.values.shape != d.keys.shape:
            raise DictionaryError(f"{root}: atoms do not match the metadata ({config.atoms} atoms)")
        if scales is not None and any(t.ndim != 1 or not bool((t > 0).all()) for t in scales.values()):
            raise DictionaryError(f"{root}: per-layer scales must be positive vectors")
        return d


# bench quality's pick over nine held-out domains: the best worst-domain top-1 a store can write at
# ≥ 20× (docs/benchmarks-history.md, "The frontier by domain"); the default store's codes are L10 at s = 80
DEFAULT_DICTIONARY = "smollm2-135m-n8192-s80-L10"


# the repository's dictionaries/ (sparsecache/dictionaries links to it); an installed wheel holds the default
SHIPPED_DIR = Path(__file__).parent.parent / "dictionaries"  # sparsecache/dictionaries


# Each other model's pick, found by its fingerprint (the repository's dictionaries/ only: a wheel
# carries the default's alone). Gemma 3 270M: bench quality's rule at ≥ 20×, BENCHMARKS.md.
MODEL_DICTIONARIES = ("gemma-3-270m-n8192-s100-L9", "qwen2.5-coder-0.5b-n8192-s64-L12")


def default_dictionary() -> Path:
    """The shipped dictionary for the default model (in the repository's dictionaries/, or in the wheel)."""
    path = SHIPPED_DIR / DEFAULT_DICTIONARY
    if not (path / META_FILE).exists():
        raise DictionaryError(f"shipped dictionary not found at {path}; pass --dict")
    return path


def shipped_dictionary(fingerprint: dict | None = None) -> Path:
    """The shipped dictionary for the model `fingerprint` describes (`model.model_fingerprint`;
    None: the default model's). Raises DictionaryError where none ships for that model."""
    if fingerprint is None:
        return default_dictionary()
    for name in (DEFAULT_DICTIONARY, *MODEL_DICTIONARIES):
        meta = SHIPPED_DIR / name / META_FILE
        if meta.exists() and same_model(fingerprint, json.loads(meta.read_text()).get("model", {})):
            return meta.parent
    raise DictionaryError(f"no dictionary ships for model {fingerprint.get('name')} (in {SHIPPED_DIR}): learn one "
                          "with `sparsecache learn-dict --model MODEL --out DIR` and pass --dict DIR")


def dictionary_dir(path: str | Path) -> Path:
    """The directory of a dictionary, given it or either of its files."""
    p = Path(path)
    return p.parent if p.name in (ATOMS_FILE, META_FILE) else p
