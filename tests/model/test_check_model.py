"""`check-model`: the gate a model passes before a dictionary or store is built for it."""

import json

import pytest
from click.testing import CliRunner

from sparsecache.cli.main import cli
from sparsecache.model.check import Check, ModelCheck, check_model, ensure_checked
from sparsecache.errors import ModelError
from sparsecache.model import load_model
from support.models import GEMMA2, GEMMA3, tiny


@pytest.mark.parametrize("family, extra", [
    ("Llama", {}),
    ("Llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    ("Qwen2", {}),
    ("Qwen3", {}),
    ("Mistral", {}),
    ("Phi3", {}),
    ("Phi3", {"partial_rotary_factor": 0.5}),
    ("Mistral", {"sliding_window": 24}),
    ("Gemma2", GEMMA2),
    ("Gemma3", GEMMA3),
], ids=["llama", "llama3-rope", "qwen2", "qwen3", "mistral", "phi3", "phi3-partial-rotary", "mistral-window",
        "gemma2", "gemma3"])
def test_supported_families_pass_every_check(tmp_path, family, extra):
    result = check_model(load_model(str(tiny(family, tmp_path / family, **extra))))
    assert [c.name for c in result.checks] == ["capture", "recompute-all", "single-chunk"]
    assert result.passed, result.to_dict()


def test_a_model_whose_keys_are_captured_in_the_wrong_place_fails(tmp_path, monkeypatch):
    """Qwen3 normalises keys after k_proj: keys taken from k_proj (what sparsecache captured
    before it knew the family) are not what its attention rotates. The capture check sees it."""
    import sparsecache.model.kvmodel as model_module

    model = load_model(str(tiny("Qwen3", tmp_path / "qwen3")))
    assert check_model(model).passed
    monkeypatch.setattr(model_module, "key_value_modules", lambda attn: [
        (attn.k_proj, lambda out: {"k": out}), (attn.v_proj, lambda out: {"v": out})])
    capture = check_model(model).checks[0]
    assert capture.name == "capture" and not capture.passed and capture.error > 1e-2


@pytest.mark.parametrize("family, extra", [("Gemma2", GEMMA2), ("Gemma3", GEMMA3), ("Mistral", {"sliding_window": 24})],
                         ids=["gemma2", "gemma3", "mistral-window"])
def test_ignoring_sliding_windows_fails_recompute_all(tmp_path, family, extra, monkeypatch):
    """Recomputation must apply each layer's window at global positions; without it the
    assembled context attends further back than the model ever does, and the check sees it."""
    import sparsecache.model.stack as stack

    model = load_model(str(tiny(family, tmp_path / family, **extra)))
    monkeypatch.setattr(stack, "layer_windows", lambda config: [None] * config.num_hidden_layers)
    capture, assembled, _ = check_model(model).checks
    assert capture.passed and not assembled.passed and assembled.error > 1e-2


def test_gemma3_needs_one_rope_table_per_layer_type(tmp_path, monkeypatch):
    """Gemma 3's sliding layers rotate with a local base, its full layers with a scaled global
    one; rotating every layer with one table puts keys at the wrong angles."""
    import dataclasses

    from sparsecache.model import KVModel

    model = load_model(str(tiny("Gemma3", tmp_path / "gemma3", **GEMMA3)))
    assert model.rope.layer_types == ("sliding_attention", "full_attention")
    one_table = KVModel.rope.fget
    monkeypatch.setattr(KVModel, "rope", property(
        lambda self: dataclasses.replace(one_table(self), layer_types=("full_attention",) * 2)))
    capture = check_model(model).checks[0]
    assert not capture.passed and capture.error > 1e-2


def test_other_families_are_refused_in_one_line(tmp_path):
    with pytest.raises(ModelError, match="unsupported architecture 'gpt_neox'"):
        load_model(str(tiny("GPTNeoX", tmp_path / "gpt_neox")))


def test_the_gate_runs_once_per_fingerprint_and_refuses_a_failing_model(tiny_model, monkeypatch):
    import sparsecache.model.check as check

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
    r = CliRunner().invoke(cli, ["check-model", str(tiny("GPTNeoX", tmp_path / "neox"))])
    assert r.exit_code == 1 and "unsupported architecture 'gpt_neox'" in r.output and "Traceback" not in r.output


def test_encode_corpus_refuses_a_model_that_fails_the_check(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir,
                                                          monkeypatch):
    import sparsecache.model.check as check

    monkeypatch.setattr(check, "check_model", lambda m: ModelCheck(m.name, m.fingerprint(),
                                                                   [Check("single-chunk", "…", error=1.0)]))
    monkeypatch.setenv("SPARSECACHE_CACHE", str(tmp_path / "cache"))  # no cached pass from other tests
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus_dir), "--store", str(tmp_path / "store"),
                                 "--model", str(tiny_model_dir), "--dict", str(tiny_dictionary_dir)])
    assert r.exit_code == 1 and "fails sparsecache's model check: single-chunk" in r.output
    assert not (tmp_path / "store" / "manifests").exists() or not any((tmp_path / "store" / "manifests").iterdir())


def test_the_sample_is_longer_than_the_shortest_sliding_window(tmp_path, monkeypatch):
    """A real model's windows (Gemma 3: 512) are longer than the default 96-token sample, and
    a window that never cuts checks nothing about it: the sample then outgrows the window."""
    import sparsecache.model.check as check

    asked = []
    real = check.sample_ids
    monkeypatch.setattr(check, "sample_ids", lambda model, tokens: asked.append(tokens) or real(model, tokens))
    gemma3 = load_model(str(tiny("Gemma3", tmp_path / "gemma3", **{**GEMMA3, "sliding_window": 200})))
    assert check_model(gemma3).passed and asked == [200 + check.WINDOW_OVERHANG]
    llama = load_model(str(tiny("Llama", tmp_path / "llama")))
    assert check_model(llama).passed and asked[-1] == 96  # no window: the default sample
