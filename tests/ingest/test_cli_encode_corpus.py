"""encode-corpus, info, verify, search, compact through the CLI on a tiny corpus."""

from __future__ import annotations

import json


from sparsecache.kvstore import KVStore
from sparsecache.store import Writer
from support.cli import cli_encode, invoke


def test_missing_index_file_is_one_line(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    """`info` on a store whose FAISS file is gone used to die with a FileNotFoundError traceback."""
    store = tmp_path / "store"
    assert cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    for f in (store / "index").glob("*.faiss"):
        f.unlink()
    for args in (("info", store), ("verify", store)):
        r = invoke(*args)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert "FAISS index of version" in r.output and "is missing" in r.output


def test_errors_are_one_line(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    from sparsecache.codec.dictionary import default_dictionary

    store = tmp_path / "store"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli_encode(empty, store, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code == 1 and r.output.strip().startswith("Error: no documents in") and "Traceback" not in r.output
    r = cli_encode(corpus_dir, store, tiny_model_dir, tmp_path / "no-dict")
    assert r.exit_code == 1 and "no dictionary at" in r.output
    r = cli_encode(corpus_dir, store, tiny_model_dir, "default")  # none ships for the tiny model
    assert r.exit_code == 1 and "no dictionary ships for model" in r.output and "learn-dict" in r.output
    r = cli_encode(corpus_dir, store, tiny_model_dir, default_dictionary())  # SmolLM2's, not the tiny model's
    assert r.exit_code == 1 and "dictionary was learned for" in r.output
    assert cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    with Writer(store):
        r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir)
        assert r.exit_code == 1 and "store is locked" in r.output
        r = invoke("compact", store)
        assert r.exit_code == 1 and "store is locked" in r.output
    r = invoke("info", tmp_path / "nowhere")
    assert r.exit_code == 1 and "no sparsecache store" in r.output


def test_existing_store_keeps_its_settings_when_options_are_left_out(corpus_dir, tmp_path, tiny_model_dir,
                                                                      tiny_dictionary_dir):
    """A nightly re-index must not break when sparsecache's defaults change: settings fixed at
    creation come from the store unless given, and a contradicting one is refused."""
    store = tmp_path / "store"
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--indices", "packed",
               "--coefficients", "float16")
    assert r.exit_code == 0, r.output
    (corpus_dir / "new.txt").write_text("The nonlocal statement rebinds names in the enclosing scope. " * 4)
    r = invoke("encode-corpus", corpus_dir, "--store", store, "--model", tiny_model_dir, "--device", "cpu")
    assert r.exit_code == 0 and "published version 3: 7 documents" in r.output, r.output
    config = KVStore.open(store).config
    assert (config.index_coding, config.coef_dtype, config.chunk_tokens) == ("packed", "float16", 64)
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--indices", "elias-fano")
    assert r.exit_code == 1 and "index_coding='packed'" in r.output and "Traceback" not in r.output


def test_adapt_fits_the_dictionary_to_a_new_store_and_a_reindex_keeps_it(corpus_dir, tmp_path, tiny_model_dir,
                                                                         tiny_dictionary_dir, tiny_dictionary):
    from sparsecache.codec.dictionary import Dictionary
    from sparsecache.store import existing_dictionary

    store = tmp_path / "store"
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--adapt", 3, "--json")
    assert r.exit_code == 0, r.output
    assert "adapt" in json.loads(r.stdout)["seconds"]
    adapted = Dictionary.load(existing_dictionary(store))
    assert adapted.meta["adapt"]["from"] == tiny_dictionary.fingerprint() and adapted.meta["adapt"]["steps"] == 3
    assert adapted.fingerprint() != tiny_dictionary.fingerprint()
    assert KVStore.open(store).info()["dictionary"] == adapted.fingerprint()

    # the nightly job reruns the same command on a changed corpus: the stored adaptation is reused
    (corpus_dir / "new.txt").write_text("The nonlocal statement rebinds names in the enclosing scope. " * 4)
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--adapt", 3, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["documents"]["new"] == 1 and "adapt" not in report["seconds"]
    assert Dictionary.load(existing_dictionary(store)).fingerprint() == adapted.fingerprint()
    # and another dictionary is still refused
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code == 1 and "was encoded with dictionary" in r.output


def test_a_store_keeps_a_scaled_dictionary_and_decodes_with_its_scales(corpus_dir, tmp_path, tiny_model_dir,
                                                                       tiny_model):
    """Per-layer scales and float16 atoms travel with the store's dictionary copy: a reader
    decodes each layer with its own factor (what the encoder's codec would give back)."""
    import torch

    from sparsecache.codec.coding import Codec
    from sparsecache.codec.dictionary import DictConfig, Dictionary
    from sparsecache.testing import unit_atoms

    scales = {k: torch.tensor([8.0, 1.0, 0.5, 2.0]) for k in "kv"}
    d = Dictionary(unit_atoms(64, 256, 1), unit_atoms(64, 256, 2), DictConfig(256, 8, 2), tiny_model.fingerprint(),
                   scales=scales).stored_as("float16")
    store = tmp_path / "store"
    r = cli_encode(corpus_dir, store, tiny_model_dir, d.save(tmp_path / "scaled"), "--coefficients", "float32")
    assert r.exit_code == 0, r.output
    s = KVStore.open(store)
    assert s.dictionary.fingerprint() == d.fingerprint() and torch.equal(s.dictionary.scales["v"], scales["v"])
    assert s.dictionary.atoms_dtype == "float16"
    chunk = s.chunks()[0].id
    (_, v), = s.load_kv([chunk])
    codes = s.read_codes([chunk]).v
    torch.testing.assert_close(v, Codec(d, "float32", indices=s.config.index_coding).decode((codes.indices, codes.coefficients), "v"))
    unscaled = Dictionary(d.keys, d.values, d.config, d.model)
    assert not torch.allclose(v, Codec(unscaled, "float32", indices=s.config.index_coding).decode((codes.indices, codes.coefficients), "v"))


def test_an_anchor_encodes_every_chunk_after_it_and_is_not_kept(corpus_dir, tmp_path, tiny_model_dir,
                                                                 tiny_dictionary_dir):
    """`--anchor A` codes each chunk as it would be coded after the prefix P followed by A (the
    codes equal those of a store whose prefix is P then A), while the store's own prefix, what a
    query lays chunks after, stays P. The anchor is fixed at creation like the prefix."""
    from sparsecache.model import chunk_context_ids, load_model, prefix_ids

    p, a = "You answer questions.\n", "Background: the documents describe Python.\n"
    model = load_model(str(tiny_model_dir))
    assert chunk_context_ids(model, p, a) == prefix_ids(model, p + a) != prefix_ids(model, p)  # no merge at the seam
    anchored, joined = tmp_path / "anchored", tmp_path / "joined"
    r = cli_encode(corpus_dir, anchored, tiny_model_dir, tiny_dictionary_dir, "--prefix", p, "--anchor", a)
    assert r.exit_code == 0, r.output
    assert cli_encode(corpus_dir, joined, tiny_model_dir, tiny_dictionary_dir, "--prefix", p + a).exit_code == 0
    s, t = KVStore.open(anchored), KVStore.open(joined)
    assert s.config.anchor == a and t.config.anchor is None
    assert s.prefix()[0] == prefix_ids(model, p) and t.prefix()[0] == prefix_ids(model, p + a)
    ids = [c.id for c in s.chunks()]
    assert ids == [c.id for c in t.chunks()]
    x, y = s.read_codes(ids), t.read_codes(ids)
    for kv in ("k", "v"):
        assert (getattr(x, kv).indices == getattr(y, kv).indices).all() and \
            (getattr(x, kv).coefficients == getattr(y, kv).coefficients).all(), kv
    r = cli_encode(corpus_dir, anchored, tiny_model_dir, tiny_dictionary_dir, "--anchor", "Another anchor.")
    assert r.exit_code == 1 and "was built with anchor=" in r.output and "Traceback" not in r.output


def test_the_forward_dtype_is_the_users_choice_reported_and_checked(corpus_dir, tmp_path, tiny_model_dir,
                                                                     tiny_dictionary_dir):
    """`--forward-dtype` picks the encode forward's precision (auto: bfloat16 on a CPU with native
    bfloat16 dot products, `dtypes.native_bf16`); the report says what ran; a bad value is refused
    before any work."""
    from sparsecache.dtypes import forward_dtype

    for given in ("float32", "bfloat16", "auto"):
        r = cli_encode(corpus_dir, tmp_path / given, tiny_model_dir, tiny_dictionary_dir, "--forward-dtype", given,
                       "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["forward_dtype"] == forward_dtype(given, "cpu")
        assert KVStore.open(tmp_path / given).info()["chunks"] > 0
    r = cli_encode(corpus_dir, tmp_path / "bad", tiny_model_dir, tiny_dictionary_dir, "--forward-dtype", "float16")
    assert r.exit_code == 2 and "--forward-dtype" in r.output
