"""The model wrapper (`model.kvmodel`): re-rotated keys reproduce the model's own cache, a rebuilt
cache continues as a plain forward, the prefix and padding are handled exactly, fingerprints,
and unsupported or missing models (and a transformers that computes Gemma 3 wrongly) refused."""

import json

import pytest
import torch

from sparsecache.errors import ModelError
from sparsecache.model import continuation_logits, extract_kv, load_model, rotate_keys


def cache_layers(model, ids):
    out = model.hf(input_ids=torch.tensor([ids]), use_cache=True)
    c = getattr(out, model.cache_arg)
    flat = lambda t: t[0].transpose(0, 1).flatten(-2)  # (1, H, T, D) -> (T, H·D)
    return out.logits[0], [(flat(c.layers[i].keys), flat(c.layers[i].values)) for i in range(model.n_layers)]


def test_rerotated_keys_reproduce_the_models_cache(tiny_model):
    ids = list(range(100, 160))
    (k, v), = extract_kv(tiny_model, [ids])
    assert k.shape == (tiny_model.n_layers, len(ids), tiny_model.m)
    _, cache = cache_layers(tiny_model, ids)
    rotated = rotate_keys(k, torch.arange(len(ids)), tiny_model)
    for layer, (ck, cv) in enumerate(cache):
        assert (rotated[layer] - ck).norm() / ck.norm() < 1e-5
        assert (v[layer] - cv).norm() / cv.norm() < 1e-5
    # pre-RoPE keys really are un-rotated: at position 0 RoPE is the identity, later not
    torch.testing.assert_close(k[:, 0], rotated[:, 0])
    assert (k[:, 5:] - rotated[:, 5:]).abs().max() > 1e-3


def test_continuation_from_rebuilt_cache_matches_plain_forward(tiny_model):
    ids = list(range(200, 250))
    logits, _ = cache_layers(tiny_model, ids)
    (k, v), = extract_kv(tiny_model, [ids[:40]])
    got = continuation_logits(tiny_model, rotate_keys(k, torch.arange(40), tiny_model), v, ids[40:])
    torch.testing.assert_close(got, logits[40:], atol=1e-4, rtol=1e-4)


def test_prefix_is_excluded_and_batching_with_padding_is_exact(tiny_model):
    prefix = [5, 6, 7, 8]
    chunks = [list(range(300, 330)), list(range(400, 412)), list(range(500, 547))]
    batched = extract_kv(tiny_model, chunks, prefix, batch_tokens=10_000)
    for chunk, (k, v) in zip(chunks, batched):
        (fk, fv), = extract_kv(tiny_model, [prefix + chunk])
        torch.testing.assert_close(k, fk[:, len(prefix):], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, fv[:, len(prefix):], atol=1e-5, rtol=1e-5)


def test_fingerprint_is_stable_and_describes_kv(tiny_model, tiny_model_dir):
    fp = tiny_model.fingerprint()
    assert fp["layers"] == 4 and fp["m"] == 32
    assert load_model(str(tiny_model_dir)).fingerprint() == fp


@pytest.mark.parametrize("edit,message", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: [p.unlink() for p in d.glob("*.safetensors")], "no weights"),
    (lambda d: _patch_config(d, model_type="gpt2"), "unsupported architecture"),
    (lambda d: _patch_config(d, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "depends on sequence length"),
])
def test_unsupported_models_are_clear_errors(tiny_model_dir, tmp_path, edit, message):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    edit(d)
    with pytest.raises(ModelError, match=message):
        load_model(str(d))


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(str(tmp_path / "nope"))


def _patch_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_a_conversion_without_architectures_is_redone(tmp_path):
    """Caches converted before vLLM support (no `architectures`, lm_head only) are not reused."""
    from sparsecache.model.gguf import is_standard_dir

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not is_standard_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    assert is_standard_dir(tmp_path)


def test_a_gguf_file_or_a_directory_holding_one_is_a_model(tiny_gguf, tmp_path):
    from sparsecache.model.gguf import model_dir
    from sparsecache.paths import cache_root

    converted = model_dir(tiny_gguf)
    assert converted.parent == cache_root() / "models" and converted.name.startswith("tiny-")
    assert (converted / "config.json").exists() and (converted / "model.safetensors").exists()
    assert model_dir(str(tiny_gguf)) == converted and model_dir(tiny_gguf.parent) == converted  # converted once
    assert load_model(str(tiny_gguf)).name == converted.name
    (tmp_path / "a.gguf").write_bytes(b"a")
    (tmp_path / "b.gguf").write_bytes(b"b")
    with pytest.raises(ModelError, match="holds 2 GGUF files; pass one of them: a.gguf, b.gguf"):
        model_dir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelError, match="a HuggingFace directory or a .gguf file"):
        model_dir(tmp_path / "notes.txt")


def test_gemma3_is_refused_with_a_transformers_that_computes_it_wrongly(monkeypatch):
    import transformers

    from sparsecache.errors import ModelError
    from sparsecache.model import check_config

    config = transformers.Gemma3TextConfig(num_hidden_layers=2)
    check_config(config, "here")  # the installed transformers (>= 5.19, as pyproject pins)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ModelError, match="Gemma 3 needs transformers >= 5.19"):
        check_config(config, "here")
