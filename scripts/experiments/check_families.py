"""`check-model`'s three checks on a tiny random model of each family (BENCHMARKS.md, "Model families"),
then the same checks with one family-specific step left out, to show that the gate sees it.
With --vllm, each family instead goes through vLLM with the connector (tests/vllm/test_vllm.py's
engine agreement, one process per family): a store coded with random unit atoms, one chunk of
exact KV against vLLM's prefill, several chunks against our own loop, and blending (ratio 1.0
against vLLM's prefill, the default's selected positions against `query`'s).

    python scripts/experiments/check_families.py [--vllm [--out docs/benchmarks/families-vllm.json]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from conftest import GEMMA2, GEMMA3, tiny  # noqa: E402  (the tests' tiny-model builder)

import sparsecache.model.stack as stack
from sparsecache.errors import ModelError  # noqa: E402
from sparsecache.model import KVModel, load_model  # noqa: E402
from sparsecache.model.check import check_model  # noqa: E402

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


# vLLM's CPU attention takes head sizes of 32 and up
VLLM_SIZES = dict(hidden_size=128, head_dim=32)
VLLM_QUESTION = "What does the pass statement do?"


def vllm_store(model, root: Path) -> Path:
    from pydoc_data.topics import topics

    from conftest import unit_atoms

    from sparsecache.codec.dictionary import DictConfig, Dictionary
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    (root / "corpus").mkdir(parents=True)
    for t in ("assert", "break", "continue", "pass"):
        (root / "corpus" / f"{t}.txt").write_text(topics[t][:1500])
    d = Dictionary(unit_atoms(model.m, 256, 1), unit_atoms(model.m, 256, 2), DictConfig(256, 8, 1), model.fingerprint())
    encode_with([str(root / "corpus")], root / "store", d, model, StoreConfig(), EncodeOptions(progress=False))
    session = Session(root / "store", model)
    session.raw_files([c.id for c in session.store.chunks()])
    return root / "store"


def check_vllm(out: Path | None, only: list[str] | None) -> None:
    from conftest import engine_agreement

    results = json.loads(out.read_text()) if out is not None and out.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        for family, extra, label in FAMILIES:
            if only and label not in only:
                continue
            where = Path(d) / label.replace(" ", "_")
            try:
                path = tiny(family, where / "model", **{**extra, **VLLM_SIZES})
                model = load_model(str(path))
            except Exception as e:  # noqa: BLE001 -- ModelError, or transformers refusing the config at this size
                print(f"{label:<16} refused: {str(e).split(': ', 1)[-1]}", flush=True)
                continue
            try:
                r = engine_agreement(str(path), vllm_store(model, where), VLLM_QUESTION)
            except AssertionError as e:  # the engine did not start or the script failed
                r = {"error": str(e)[-600:]}
            results[label] = r
            if out is not None:
                out.write_text(json.dumps(results, indent=1))
            if "error" in r:
                print(f"{label:<16} vLLM: {r['error'].strip().splitlines()[-1]}", flush=True)
                continue
            print(f"{label:<16} one chunk {'=' if r['one_chunk']['same_tokens'] else '!='} vLLM prefill; "
                  f"raw/codes same answer as ours {r['raw']['same_answer']}/{r['codes']['same_answer']}; "
                  f"ratio 1.0 {'=' if r['blend-all']['same_tokens'] else '!='} vLLM prefill "
                  f"({r['blend-all']['max_logprob_diff']:.1e}); default blend same positions "
                  f"{r['blend']['same_positions']}, same answer {r['blend']['same_answer']} "
                  f"({r['blend']['max_logprob_diff']:.1e})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", action="store_true", help="through vLLM with the connector instead")
    ap.add_argument("--out", type=Path, help="with --vllm: every family's result as JSON (merged into it)")
    ap.add_argument("--families", nargs="+", help="with --vllm: only these labels")
    args = ap.parse_args()
    if args.vllm:
        return check_vllm(args.out, args.families)
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
