"""Dictionaries (`codec.dictionary`, `codec.learn`): learning beats its initialisation, a resumed
run equals an uninterrupted one, files round-trip with their fingerprints (float16 atoms too),
bad files and configs are named, and each shipped dictionary is found by its model's fingerprint."""

import json
from dataclasses import replace

import pytest
import torch

from sparsecache.codec.dictionary import DictConfig, Dictionary
from sparsecache.codec.learn import TrainConfig, collect_signals, init_config, learn, nmse
from sparsecache.errors import ConfigError, DictionaryError, DictionaryMismatch
from sparsecache.codec.signals import from_signals, to_signals
from sparsecache.text.documents import builtin_documents


@pytest.fixture(scope="module")
def tiny_signals(tiny_model):
    docs = builtin_documents("train")[:20]
    train, _ = collect_signals(tiny_model, docs, 1, 128, 6000, cache=False)
    held, _ = collect_signals(tiny_model, builtin_documents("heldout")[:5], 1, 128, 2000, cache=False)
    return train, held


def small_train(**kw):
    base = dict(steps=30, batch=256, val_every=10, val_signals=512, patience=100, dead_after=5)
    base.update(kw)
    return TrainConfig(**base)


def test_learning_beats_its_initialisation(tiny_model, tiny_signals, tmp_path):
    train, held = tiny_signals
    cfg = DictConfig(atoms=128, sparsity=4)
    d = learn(train, held, cfg, small_train(steps=1), tiny_model.fingerprint(), tmp_path / "d0", progress=False)
    d2 = learn(train, held, cfg, small_train(), tiny_model.fingerprint(), tmp_path / "d1", progress=False)
    for k in "kv":
        y = held[k][:2000].float()
        assert nmse(y, d2.atoms(k), 4) < 0.9 * nmse(y, d.atoms(k), 4)
    # unit-norm columns, up to the float16 file's rounding (2^-11 relative per value)
    assert torch.allclose(d2.keys.norm(dim=0), torch.ones(128), atol=5e-4)
    assert len(d2.meta["history"]) == 3


def test_resume_gives_the_same_dictionary_as_an_uninterrupted_run(tiny_model, tiny_signals, tmp_path):
    train, held = tiny_signals
    cfg, fp = DictConfig(atoms=64, sparsity=4), tiny_model.fingerprint()
    full = learn(train, held, cfg, small_train(steps=20), fp, tmp_path / "full", progress=False)
    # "crash" after the step-10 checkpoint: run 10 steps of a 20-step schedule by stopping early
    learn(train, held, cfg, small_train(steps=20, patience=0), fp, tmp_path / "cut", progress=False)
    state = json.loads((tmp_path / "cut" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 10
    assert [p.name for p in (tmp_path / "cut" / "checkpoint").glob("state-*")] == [state["tensors"]]
    resumed = learn(train, held, cfg, small_train(steps=20), fp, tmp_path / "cut", resume=True, progress=False)
    torch.testing.assert_close(resumed.keys, full.keys)
    torch.testing.assert_close(resumed.values, full.values)


def test_save_load_roundtrip_and_fingerprints(tiny_model, tmp_path):
    d = Dictionary(torch.nn.functional.normalize(torch.randn(32, 64), dim=0),
                   torch.nn.functional.normalize(torch.randn(32, 64), dim=0),
                   DictConfig(64, 4, 1), tiny_model.fingerprint(), {"note": "x"})
    d.save(tmp_path / "d")
    for path in (tmp_path / "d", tmp_path / "d" / "dictionary.json", tmp_path / "d" / "atoms.safetensors"):
        e = Dictionary.load(path)
        assert torch.equal(e.keys, d.keys) and e.config == d.config and e.meta["note"] == "x"
        assert e.fingerprint() == d.fingerprint()
    e.check_model(tiny_model.fingerprint())
    other = dict(tiny_model.fingerprint(), config_hash="0" * 16, name="other")
    with pytest.raises(DictionaryMismatch, match="other"):
        d.check_model(other)


def test_float16_atoms_halve_the_file_and_load_back_with_the_fingerprint_they_were_saved_with(tiny_model, tmp_path):
    d = Dictionary(torch.nn.functional.normalize(torch.randn(32, 256), dim=0),
                   torch.nn.functional.normalize(torch.randn(32, 256), dim=0),
                   DictConfig(256, 4, 1), tiny_model.fingerprint())
    d.save(tmp_path / "f32")
    d.stored_as("float16").save(tmp_path / "f16")
    unrounded = replace(d, atoms_dtype="float16")  # save() rounds what it writes, so this is the same file
    unrounded.save(tmp_path / "f16b")
    sizes = {n: (tmp_path / n / "atoms.safetensors").stat().st_size for n in ("f32", "f16", "f16b")}
    assert sizes["f16"] < 0.55 * sizes["f32"] and sizes["f16b"] == sizes["f16"]
    e = Dictionary.load(tmp_path / "f16")
    assert e.atoms_dtype == "float16" and e.keys.dtype == torch.float32
    assert json.loads((tmp_path / "f16" / "dictionary.json").read_text())["fingerprint"] == e.fingerprint()
    assert Dictionary.load(tmp_path / "f16b").fingerprint() == e.fingerprint() != d.fingerprint()
    # saving again (eval-dict --record does) keeps float16
    e.save(tmp_path / "f16")
    assert (tmp_path / "f16" / "atoms.safetensors").stat().st_size == sizes["f16"]
    assert Dictionary.load(tmp_path / "f32").atoms_dtype == "float32"
    # the rounding costs nothing measurable in coding error
    y = torch.randn(512, 32)
    assert nmse(y, e.keys, 4) == pytest.approx(nmse(y, d.keys, 4), rel=1e-2)
    with pytest.raises(ConfigError, match="atoms_dtype"):
        replace(d, atoms_dtype="bfloat16")


def test_load_errors(tmp_path):
    with pytest.raises(DictionaryError, match="no dictionary"):
        Dictionary.load(tmp_path)
    (tmp_path / "dictionary.json").write_text('{"format_version": 99, "atoms": 4, "sparsity": 1, '
                                              '"layers_per_signal": 1, "model": {}}')
    from safetensors.torch import save_file
    save_file({"keys": torch.zeros(2, 4), "values": torch.zeros(2, 4)}, str(tmp_path / "atoms.safetensors"))
    with pytest.raises(DictionaryError, match="newer"):
        Dictionary.load(tmp_path)
    (tmp_path / "dictionary.json").write_text('{"atoms": 4, "sparsity": 1, "layers_per_signal": 1, "model": {}}')
    save_file({"keys": torch.zeros(2, 4, dtype=torch.bfloat16), "values": torch.zeros(2, 4, dtype=torch.bfloat16)},
              str(tmp_path / "atoms.safetensors"))
    with pytest.raises(DictionaryError, match="float32 or float16"):
        Dictionary.load(tmp_path)


@pytest.mark.parametrize("kw,msg", [
    (dict(atoms=70000), "65536"), (dict(atoms=1), "65536"), (dict(sparsity=0), "sparsity"),
    (dict(layers_per_signal=0), "layers_per_signal"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        DictConfig(**kw)


def test_signal_checks():
    with pytest.raises(ConfigError, match="divide"):
        DictConfig(layers_per_signal=7).check_signal(30, 192)
    with pytest.raises(ConfigError, match="exceeds"):
        DictConfig(sparsity=200, layers_per_signal=1).check_signal(30, 192)
    DictConfig(layers_per_signal=3, sparsity=200).check_signal(30, 192)


def test_layer_grouping_roundtrip():
    kv = torch.randn(6, 5, 4)
    sig = to_signals(kv, 3)
    assert sig.shape == (2, 5, 12)
    torch.testing.assert_close(sig[1, 2], torch.cat([kv[3, 2], kv[4, 2], kv[5, 2]]))
    torch.testing.assert_close(from_signals(sig, 3), kv)


def test_continuing_a_dictionary_keeps_its_shape_and_may_change_only_the_sparsity():
    d = Dictionary(torch.randn(8, 16), torch.randn(8, 16), DictConfig(atoms=16, sparsity=2, layers_per_signal=1), {})
    assert init_config(d, DictConfig(atoms=16, sparsity=5, layers_per_signal=1)) == DictConfig(16, 5, 1)
    for other in (DictConfig(atoms=32, sparsity=2, layers_per_signal=1), DictConfig(atoms=16, sparsity=2, layers_per_signal=2)):
        with pytest.raises(ConfigError, match="it fixes that"):
            init_config(d, other)


def test_learn_config_continues_a_dictionary_with_its_sizes(tiny_dictionary):
    from sparsecache.errors import ConfigError
    from sparsecache.codec.learn import learn_config

    config, tcfg = learn_config(None, sparsity=8, steps=5)
    assert (config.atoms, config.sparsity, config.layers_per_signal) == (DictConfig.atoms, 8, DictConfig.layers_per_signal)
    assert tcfg.steps == 5 and tcfg.atoms_dtype == TrainConfig.atoms_dtype
    config, tcfg = learn_config(tiny_dictionary, sparsity=2, steps=5)
    assert config == DictConfig(tiny_dictionary.config.atoms, 2, tiny_dictionary.config.layers_per_signal)
    assert tcfg.atoms_dtype == tiny_dictionary.atoms_dtype  # a continuation is stored as compactly as its start
    with pytest.raises(ConfigError, match="drop --atoms 64"):
        learn_config(tiny_dictionary, atoms=64)


def test_each_shipped_dictionary_is_found_by_its_models_fingerprint(tiny_model, tmp_path):
    from sparsecache.codec.dictionary import (DEFAULT_DICTIONARY, META_FILE, MODEL_DICTIONARIES, SHIPPED_DIR,
                                        shipped_dictionary)
    from sparsecache.ingest.encoder import dictionary_for

    assert shipped_dictionary() == SHIPPED_DIR / DEFAULT_DICTIONARY
    for name in (DEFAULT_DICTIONARY, *MODEL_DICTIONARIES):
        model = json.loads((SHIPPED_DIR / name / META_FILE).read_text())["model"]
        assert shipped_dictionary({**model, "name": "renamed"}) == SHIPPED_DIR / name  # names are for messages
    with pytest.raises(DictionaryError, match="no dictionary ships for model .*learn-dict"):
        shipped_dictionary(tiny_model.fingerprint())
    tiny_dir = tmp_path / "tiny"
    tiny_model.hf.save_pretrained(tiny_dir)
    with pytest.raises(DictionaryError, match="no dictionary ships"):  # what encode-corpus --model asks
        dictionary_for(tmp_path / "store", None, str(tiny_dir))
