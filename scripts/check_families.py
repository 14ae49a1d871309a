"""`check-model`'s three checks on a tiny random model of each family (BENCHMARKS.md, "Model families"),
then the same checks with one family-specific step left out, to show that the gate sees it.

    python scripts/check_families.py
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_check_model import GEMMA2, GEMMA3, tiny  # noqa: E402  (the tests' tiny-model builder)

import sparsecache.stack as stack  # noqa: E402
from sparsecache.check import check_model  # noqa: E402
from sparsecache.errors import ModelError  # noqa: E402
from sparsecache.model import KVModel, load_model  # noqa: E402

LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 256}}
LONGROPE = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
FAMILIES = [("Llama", {}, "Llama"), ("Llama", LLAMA3, "Llama 3.x"), ("Qwen2", {}, "Qwen2"), ("Mistral", {}, "Mistral"),
            ("Mistral", {"sliding_window": 24}, "Mistral W=24"), ("Qwen3", {}, "Qwen3"), ("Phi3", {}, "Phi-3"),
            ("Phi3", {"partial_rotary_factor": 0.5}, "Phi-3 partial"), ("Phi3", LONGROPE, "Phi-4-mini-like"),
            ("Gemma2", GEMMA2, "Gemma 2"), ("Gemma3", GEMMA3, "Gemma 3")]


def no_windows():
    return mock.patch.object(stack, "layer_windows", lambda config: [None] * config.num_hidden_layers)


def one_rope_table():
    rope = KVModel.rope.fget
    return mock.patch.object(KVModel, "rope", property(
        lambda self: dataclasses.replace(rope(self), layer_types=("full_attention",) * self.n_layers)))


ABLATIONS = [("Gemma 2", "windows ignored", no_windows), ("Gemma 3", "windows ignored", no_windows),
             ("Mistral W=24", "windows ignored", no_windows), ("Gemma 3", "one RoPE table", one_rope_table)]


def report(model) -> str:
    return ", ".join(f"{c.name} {c.error:.1e}{'' if c.passed else ' FAIL'}" for c in check_model(model).checks)


def main() -> None:
    models = {}
    with tempfile.TemporaryDirectory() as d:
        for family, extra, label in FAMILIES:
            path = tiny(family, Path(d) / label.replace(" ", "_"), **extra)
            try:
                models[label] = load_model(str(path))
            except ModelError as e:
                print(f"{label:<16} refused: {str(e).split(': ', 1)[-1]}")
                continue
            print(f"{label:<16} {report(models[label])}")
        for label, what, patch in ABLATIONS:
            with patch():
                print(f"{label + ', ' + what:<32} {report(models[label])}")


if __name__ == "__main__":
    main()
