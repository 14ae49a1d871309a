"""`check-model`'s three checks on a tiny random model of each family (BENCHMARKS.md, "Model families").

Families `load_model` refuses are wrapped directly, to show what the gate would see.

    python scripts/check_families.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_check_model import tiny  # noqa: E402  (the tests' tiny-model builder)

from sparsecache.check import check_model  # noqa: E402
from sparsecache.errors import ModelError  # noqa: E402
from sparsecache.model import KVModel, load_model  # noqa: E402

LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 256}}
FAMILIES = [("Llama", {}, "Llama"), ("Llama", LLAMA3, "Llama 3.x"), ("Qwen2", {}, "Qwen2"), ("Mistral", {}, "Mistral"),
            ("Qwen3", {}, "Qwen3"), ("Phi3", {}, "Phi-3"), ("Phi3", {"partial_rotary_factor": 0.5}, "Phi-3 partial"),
            ("Gemma2", {}, "Gemma 2")]


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        for family, extra, label in FAMILIES:
            path = tiny(family, Path(d) / family / label.replace(" ", "_"), **extra)
            try:
                model, accepted = load_model(str(path)), "yes"
            except ModelError as e:
                accepted = f"refused ({str(e).split(': ', 1)[-1]})"
                model = KVModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                                AutoTokenizer.from_pretrained(path), label)
            try:
                errors = ", ".join(f"{c.name} {c.error:.1e}" for c in check_model(model).checks)
            except AttributeError as e:
                errors = f"cannot capture: {e}"
            print(f"{label:<10} accepted: {accepted}\n           {errors}")


if __name__ == "__main__":
    main()
