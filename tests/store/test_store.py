"""The store: exact round trip, incremental re-index, versions, compaction, locking, damage."""

from __future__ import annotations

import json
from dataclasses import replace
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import DictConfig, Dictionary
from sparsecache.errors import DictionaryMismatch, StoreCorrupt, StoreError, StoreLocked, StoreUnavailable, TextError
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.kvstore import KVStore, compact, verify
from sparsecache.model import extract_kv, prefix_ids
from sparsecache.store import Lock, StoreConfig, VersionPoller, Writer, open_backend, read_manifest, versions
from support.corpora import write_corpus
from support.stores import all_codes, assert_same_codes

# the store's own mechanics on the plain layout (each chunk after the prefix alone: the reference K/V below, the
# reindex counts, format-2 stores, which predate --encode-after); the default, chunks encoded after their nearest
# neighbour, is tests/ingest/test_encode_after.py's and tests/store/test_crashes.py's
CONFIG = StoreConfig(chunk_tokens=64, zarr_chunk_tokens=32, coef_dtype="float16", encode_after="prefix")


@pytest.fixture
def build(tiny_model, tiny_dictionary, embedder):
    def run(corpus, store, config=CONFIG, **options):
        options = EncodeOptions(**{"batch_tokens": 256, "progress": False, **options})
        return encode_with([str(c) for c in corpus], store, tiny_dictionary, tiny_model, config, options,
                           embedder=embedder)
    return run


@pytest.fixture
def store(build, corpus_dir, tmp_path) -> Path:
    build([corpus_dir], tmp_path / "store")
    return tmp_path / "store"


def test_store_decode_equals_codec_decode(store, tiny_model, tiny_dictionary):
    s = KVStore.open(store)
    chunks = s.chunks()
    ids = [c.id for c in chunks]
    codes = s.read_codes(ids)
    tokens = np.split(codes.tokens, np.cumsum(codes.lengths)[:-1])
    kv = extract_kv(tiny_model, [t.tolist() for t in tokens], prefix_ids(tiny_model, None))
    codec = Codec(tiny_dictionary, CONFIG.coef_dtype, indices=CONFIG.index_coding)
    keys, values = (torch.cat([x[i] for x in kv], 1) for i in (0, 1))
    ref_k, ref_v = codec.encode(keys, "k"), codec.encode(values, "v")
    # The store ran the model in batches of other shapes than this one padded forward, so KV
    # can differ in the last bit (seen on AVX-512 and AMD machines): the chosen atoms agree,
    # fp16 coefficients within one ulp.
    for got, ref in ((codes.k, ref_k), (codes.v, ref_v)):
        np.testing.assert_array_equal(got.indices, ref.indices)
        np.testing.assert_allclose(got.coefficients.astype(np.float32), ref.coefficients.astype(np.float32),
                                   rtol=2**-10, atol=2**-24)
    decoded = s.load_kv(ids)
    k_ref = codec.decode(ref_k, "k").split(codes.lengths, 1)
    v_ref = codec.decode(ref_v, "v").split(codes.lengths, 1)
    for (k, v), kr, vr in zip(decoded, k_ref, v_ref):
        torch.testing.assert_close(k, kr, rtol=0, atol=1e-3)  # one coefficient ulp × one atom entry
        torch.testing.assert_close(v, vr, rtol=0, atol=1e-3)
    # and decoding is a pure function of the codes: the same codes decode bit-identically
    again = codec.decode(codes.k, "k").split(codes.lengths, 1)
    assert all(torch.equal(k, a) for (k, _), a in zip(decoded, again))
    assert codes.nbytes == codes.k.nbytes + codes.v.nbytes + codes.tokens.nbytes


def test_direct_chunk_reads_equal_zarr_reads(store):
    """The fast read path (chunk files + CRC) against zarr's own reader, on random spans."""
    from sparsecache.store import CODE_ARRAYS, LocalBackend, read_spans_direct

    s = KVStore.open(store)
    rng = np.random.default_rng(0)
    n = s.manifest.tokens
    starts = rng.integers(0, n - 1, 20)
    spans = [(int(a), int(min(n, a + rng.integers(1, 100)))) for a in starts]
    for name in (*CODE_ARRAYS, "tokens"):
        arr = s.group[name]
        axis = 0 if name == "tokens" else 1
        got = read_spans_direct(arr, LocalBackend(store), f"data/g000001/{name}", spans, axis)
        ref = np.concatenate([arr[a:b] if axis == 0 else arr[:, a:b] for a, b in spans], axis)
        np.testing.assert_array_equal(got, ref)


def test_compressed_store_reads_the_same_codes(build, store, corpus_dir, tmp_path):
    build([corpus_dir], tmp_path / "zstd", config=replace(CONFIG, compressor="zstd"))
    assert_same_codes(all_codes(tmp_path / "zstd"), all_codes(store))
    assert verify(tmp_path / "zstd")["ok"]


def test_prefix_kv_is_exact_and_stored_once(store, tiny_model):
    ids, k, v = KVStore.open(store).prefix()
    assert ids == prefix_ids(tiny_model, None)
    ref_k, ref_v = extract_kv(tiny_model, [ids])[0]
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_unchanged_corpus_does_nothing(build, store, corpus_dir):
    before = versions(store)
    r = build([corpus_dir], store)
    assert not r.published and r.tokens == 0 and "nothing to encode" in r.message
    assert versions(store) == before


def test_incremental_reindex_encodes_only_what_changed(build, store, corpus_dir, embedder):
    old = KVStore.open(store)
    old_chunks = {c.doc_id: c.id for c in old.chunks() if c.ordinal == 0}
    (corpus_dir / "assert.txt").write_text("Zebras graze on the savannah grasslands of Kenya every morning.")
    (corpus_dir / "break.txt").unlink()
    (corpus_dir / "new.txt").write_text("Volcanic eruptions in Iceland disrupted European air travel.")
    r = build([corpus_dir], store, delete_missing=True)
    assert r.documents == {"new": 1, "changed": 1, "unchanged": 4, "deleted": 1, "resumed": 0}
    new = KVStore.open(store)
    assert new.version == old.version + 1
    docs = {c.doc_id for c in new.chunks()}
    assert "break.txt" not in docs and "new.txt" in docs
    assert r.tokens == sum(c.token_length for c in new.chunks() if c.doc_id in ("assert.txt", "new.txt"))
    hit, _ = new.search(embedder.embed(["zebras on the savannah"])[0], 1)[0]
    assert hit.doc_id == "assert.txt" and hit.id != old_chunks["assert.txt"]
    live = {c.id for c in new.chunks()}
    assert old_chunks["assert.txt"] not in live  # the old text is tombstoned, not searchable
    hits = [c.id for c, _ in new.search(embedder.embed([old.texts([old_chunks["assert.txt"]])[0]])[0], 50)]
    assert old_chunks["assert.txt"] not in hits
    info = new.info()
    assert info["tombstoned_chunks"] > 0 and info["chunks"] == len(live)


def test_old_versions_beyond_keep_are_pruned(build, store, corpus_dir):
    for i, topic in enumerate(("return", "yield", "while")):
        write_corpus(corpus_dir, (topic,))
        build([corpus_dir], store, keep=2)
    assert versions(store) == [4, 5]
    kept = [read_manifest(store, v) for v in (4, 5)]
    # what the kept versions name and nothing else: index segments and document-table pieces they share stay
    assert {f"index/{p.name}" for p in (store / "index").iterdir()} == {r["key"] for m in kept for r in m.index_segments}
    assert {f"meta/{k}/{p.name}" for k in ("segments", "live") for p in (store / "meta" / k).iterdir()
            if p.name != "zarr.json"} == \
        {r["key"] for m in kept for r in m.segments} | {m.live for m in kept}
    assert verify(store)["ok"] and KVStore.open(store, 4).chunks()


def test_without_delete_missing_documents_stay(build, store, corpus_dir):
    (corpus_dir / "break.txt").unlink()
    r = build([corpus_dir], store)
    assert not r.published
    assert "break.txt" in {c.doc_id for c in KVStore.open(store).chunks()}


def test_reader_pinned_to_a_version_is_unaffected_by_reindex(build, store, corpus_dir):
    reader = KVStore.open(store)
    before = all_codes(store, reader.version)
    first = {c.id for c in reader.chunks()}
    (corpus_dir / "pass.txt").write_text("Changed text about something else entirely. " * 20)
    write_corpus(corpus_dir, ("return", "yield", "while"))
    build([corpus_dir], store, delete_missing=True)
    assert KVStore.open(store).version == reader.version + 1
    assert {c.id for c in reader.chunks()} == first
    for cid, (doc, tokens, *codes) in before.items():  # the old handle, reading after N+1 was published
        got = reader.read_codes([cid])
        np.testing.assert_array_equal(got.tokens, tokens)
        np.testing.assert_array_equal(got.k.indices, codes[0])
        np.testing.assert_array_equal(got.v.coefficients, codes[3])
    assert_same_codes(all_codes(store, reader.version), before)  # and a fresh reader of version N


def test_the_version_poller_lists_in_its_thread_and_announces_a_version_once_ready(build, store, corpus_dir, tmp_path):
    """A server asks for the latest version per request: asking never lists the store; a poll
    (the poller's thread, every interval) lists it, makes a new version ready, then announces it.
    A poll that fails leaves the version before announced and the next one tries again; with
    interval 0 every ask lists, in the caller's thread."""
    backend = open_backend(store)
    listings, readied = [], []
    real = backend.list
    backend.list = lambda prefix: listings.append(prefix) or real(prefix)
    poller = VersionPoller(backend, every_s=3600, ready=readied.append)  # its thread waits an hour: polls are ours
    first = poller.version
    try:
        assert [poller() for _ in range(5)] == [first] * 5 and len(listings) == 1
        write_corpus(corpus_dir, ("return", "yield"))
        build([corpus_dir], store)
        assert poller() == first and len(listings) == 1
        poller.poll()
        assert poller() == first + 1 and readied == [first + 1] and len(listings) == 2

        def broken(version):
            raise StoreError("cannot open it")

        poller.ready = broken
        write_corpus(corpus_dir, ("raise",))
        build([corpus_dir], store)
        poller.poll()
        assert poller() == first + 1 and poller.failures == 1 and "cannot open it" in poller.last_error
        assert not poller.unreachable  # the store answered: the new version is what failed

        def silent(version):
            raise StoreUnavailable(f"{backend}: object storage did not answer (timed out after 5 s)")

        poller.ready = silent
        poller.poll()
        assert poller() == first + 1 and poller.failures == 2 and poller.unreachable
        poller.ready = readied.append
        poller.poll()
        assert poller() == first + 2 and poller.last_error is None and not poller.unreachable
    finally:
        poller.close()
    eager = VersionPoller(backend, every_s=0)
    n = len(listings)
    assert eager() == first + 2 and len(listings) == n + 1
    with pytest.raises(StoreError, match="no published version"):
        VersionPoller(open_backend(tmp_path / "nothing"))


def test_compact_drops_tombstones_and_keeps_codes(build, store, corpus_dir):
    (corpus_dir / "del.txt").write_text("Entirely different content now. " * 30)
    (corpus_dir / "pass.txt").unlink()
    build([corpus_dir], store, delete_missing=True)
    live = all_codes(store)
    m = compact(store, keep=1)
    s = KVStore.open(store)
    assert s.version == m.version and versions(store) == [m.version]
    assert s.info()["tombstoned_chunks"] == 0 and m.generation == "g000002"
    assert [p.name for p in (store / "data").iterdir() if p.is_dir()] == ["g000002"]
    assert_same_codes(all_codes(store), live)
    assert sum(ix.ntotal for ix in s.indexes()) == len(live)  # one fresh segment: no deleted rows left in it
    assert verify(store)["ok"]


def test_second_writer_is_refused_and_stale_lock_taken_over(store):
    assert (store / ".lock").exists()  # laying out a new store must not delete the lock it holds
    with Writer(store):
        with pytest.raises(StoreLocked, match=r"store is locked: .* pid \d+ on "):
            Writer(store).__enter__()
    (store / ".lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "since": "yesterday"}))
    with pytest.warns(UserWarning, match="stale lock left by pid 999999"):
        with Writer(store):
            pass
    lock = Lock(store).acquire()
    assert lock.stale is None  # a clean release leaves no owner behind
    lock.release()


def test_corrupt_array_file_is_named_by_verify_and_load_kv(store):
    s = KVStore.open(store)
    target = s.chunks()[0]
    chunk_file = store / "data" / "g000001" / "k_coefficients" / "c" / "0" / "0" / "0"
    chunk_file.write_bytes(chunk_file.read_bytes()[:-10])  # truncated
    r = verify(store)
    assert not r["ok"] and any("k_coefficients/c/0/0/0" in p for p in r["problems"])
    assert target.id in r["corrupt_chunks"]
    with pytest.raises(StoreCorrupt, match=target.id):
        KVStore.open(store).load_kv([target.id])


def test_missing_array_file_is_damage_not_zeros(store):
    s = KVStore.open(store)
    target = s.chunks()[-1]
    step = 32
    key = target.token_offset // step
    (store / "data" / "g000001" / "v_indices" / "c" / "0" / str(key) / "0").unlink()
    assert "missing" in " ".join(verify(store)["problems"])
    with pytest.raises(StoreCorrupt, match="missing"):
        KVStore.open(store).load_kv([target.id])


def test_newer_format_is_refused_without_damage(build, store, corpus_dir):
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["sparsecache"]["format"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="newer sparsecache"):
        KVStore.open(store)
    write_corpus(corpus_dir, ("return",))
    with pytest.raises(StoreError, match="newer sparsecache"):
        build([corpus_dir], store)
    assert versions(store) == [1, 2]


def test_wrong_dictionary_is_refused(build, store, corpus_dir, tiny_model):
    from sparsecache.testing import unit_atoms

    other = Dictionary(unit_atoms(32, 512, 7), unit_atoms(32, 512, 8), DictConfig(512, 4, 1), tiny_model.fingerprint())
    write_corpus(corpus_dir, ("return",))
    with pytest.raises(DictionaryMismatch, match="was encoded with dictionary"):
        encode_with([str(corpus_dir)], store, other, tiny_model, CONFIG, EncodeOptions(progress=False))
    foreign = Dictionary(other.keys, other.values, other.config, {**tiny_model.fingerprint(), "config_hash": "x"})
    with pytest.raises(DictionaryMismatch, match="learned for"):
        encode_with([str(corpus_dir)], store, foreign, tiny_model, CONFIG, EncodeOptions(progress=False))
    assert versions(store) == [1, 2]


def test_other_config_is_refused(build, store, corpus_dir):
    write_corpus(corpus_dir, ("return",))
    with pytest.raises(ValueError, match="chunk_tokens=64"):
        build([corpus_dir], store, config=StoreConfig(chunk_tokens=128))


def test_bad_input_leaves_the_store_alone(build, store, tmp_path):
    before = all_codes(store)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.txt").write_bytes(b"\x00\x01binary")
    with pytest.raises(TextError, match="binary"):
        build([bad], store)
    with pytest.raises(TextError, match="no documents"):
        build([tmp_path / "bad2" if (tmp_path / "bad2").mkdir() is None else None], store)
    (bad / "x.txt").write_bytes(bytes(range(1, 256)) * 20)  # binary without a NUL byte
    with pytest.raises(TextError, match="binary"):
        build([bad], store)
    assert versions(store) == [1, 2] and not (store / "pending.json").exists()
    assert_same_codes(all_codes(store), before)


def test_damaged_chunk_table_names_its_file(store):
    """A checksum error in the chunk-text array used to surface without the file's name."""
    s = KVStore.open(store)
    ids = [c.id for c in s.chunks()]
    f = store / "data" / "g000001" / "text_utf8" / "c" / "0"
    f.write_bytes(f.read_bytes()[:-6] + b"damage")
    with pytest.raises(StoreCorrupt, match="g000001/text_utf8/c/0"):
        KVStore.open(store).texts(ids[:1])
    r = verify(store)
    assert any("text_utf8/c/0" in p for p in r["problems"]) and set(r["corrupt_chunks"]) == set(ids)


def test_publish_is_durable(build, corpus_dir, tmp_path, monkeypatch):
    """Power loss: every file a manifest names (the index, the data) is fsynced before the
    manifest is renamed into place, and the directories after; pending.json likewise only
    records rows whose bytes were synced."""
    import os

    events = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, **kw):
        events.append(("rename", os.path.realpath(a), os.path.realpath(b)))
        return real_replace(a, b, **kw)

    def link(a, b, **kw):  # how a manifest is created: link(2) never overwrites
        events.append(("rename", os.path.realpath(a), os.path.realpath(b)))
        return real_link(a, b, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    store = tmp_path / "store"
    build([corpus_dir], store)
    root = os.path.realpath(store)
    synced = set()
    checked = 0
    for e in events:
        if e[0] == "fsync":
            synced.add(e[1])
        elif e[2].endswith(".json") and ("/manifests/" in e[2] or e[2].endswith("pending.json")):
            # everything under data/ and index/ that exists at that point was synced before
            assert e[1] in synced, f"{e[1]} renamed before it was synced"
            for sub in ("data", "index"):
                for dirpath, _, files in os.walk(os.path.join(root, sub)):
                    for f in files:
                        path = os.path.join(dirpath, f)
                        if not f.endswith(".tmp") and "/manifests/" in e[2] and os.path.getmtime(path) <= os.path.getmtime(e[2]):
                            assert path in synced, f"{path} not synced before {e[2]}"
            checked += 1
        elif e[2].endswith(".faiss"):
            assert e[1] in synced, "index file renamed into place before its bytes were synced"
    assert checked >= 2 and any("/manifests/v" in e[2] for e in events if e[0] == "rename")
    manifests_dir = os.path.join(root, "manifests")
    assert manifests_dir in synced


def test_path_traversal_ids_stay_data(build, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "../../etc/passwd", "text": "An innocent text about gardens. " * 5}) + "\n")
    before = set(tmp_path.parent.rglob("passwd"))
    build([src], tmp_path / "s")
    s = KVStore.open(tmp_path / "s")
    assert [c.doc_id for c in s.chunks()] == ["../../etc/passwd"]
    assert set(tmp_path.parent.rglob("passwd")) == before
    files = {p.relative_to(tmp_path / "s").parts[0] for p in (tmp_path / "s").rglob("*")}
    assert files <= {"zarr.json", "prefix", "dictionary", "data", "manifests", "meta", "index", ".lock",
                     ".sparsecache-store"}


def test_not_a_store(tmp_path, build, corpus_dir):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(StoreError, match="not a sparsecache store"):
        build([corpus_dir], tmp_path / "mine")
    with pytest.raises(StoreError, match="no sparsecache store"):
        KVStore.open(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_another_zarr_group_is_never_wiped(tmp_path, build, corpus_dir):
    """Regression: a directory holding some other Zarr group (zarr.json, no manifests) passed
    the half-created-store check, and creating the store deleted data/, index/, ... inside it."""
    import zarr

    other = tmp_path / "theirs"
    g = zarr.open_group(str(other), mode="w")
    g.create_array("data", data=np.arange(10))
    (other / "index").mkdir()
    (other / "index" / "keep.txt").write_text("theirs")
    before = sorted(p.relative_to(other).as_posix() for p in other.rglob("*"))
    with pytest.raises(StoreError, match="not a sparsecache store"):
        build([corpus_dir], other)
    assert sorted(p.relative_to(other).as_posix() for p in other.rglob("*")) == before
    np.testing.assert_array_equal(zarr.open_array(str(other / "data"))[:], np.arange(10))


def test_info_reports_sizes_and_ratios(store, tiny_dictionary):
    info = KVStore.open(store).info()
    c = info["compression"]
    assert info["documents"] == 6 and info["chunks"] > 6 and info["tombstoned_chunks"] == 0
    assert c["code_bytes_per_token"] == 4 * 2 * (5 + 4 * 2)  # G=4 groups × K,V × (packed 4×9 bits + 4 fp16)
    assert c["theoretical"] == round(2 * 4 * 32 * 2 / c["code_bytes_per_token"], 3)
    assert 0.95 < c["disk_vs_theoretical_codes"] < 1.3  # tiny store: the last Zarr chunk is partly empty
    assert info["dictionary"] == tiny_dictionary.fingerprint()
    assert set(info["bytes_on_disk"]) >= {"k_indices", "k_coefficients", "v_indices", "v_coefficients", "dictionary"}


def test_float8_coefficient_store(build, store, corpus_dir, tmp_path):
    """e4m3 coefficients (stored as bytes): same indices, values within e4m3's rounding."""
    fp8 = tmp_path / "fp8"
    build([corpus_dir], fp8, config=StoreConfig(chunk_tokens=64, zarr_chunk_tokens=32, coef_dtype="float8", encode_after="prefix"))
    a, b = KVStore.open(store), KVStore.open(fp8)
    ids = [c.id for c in a.chunks()]
    ca, cb = a.read_codes(ids), b.read_codes(ids)
    np.testing.assert_array_equal(ca.k.indices, cb.k.indices)
    assert cb.k.coefficients.dtype == np.uint8 and cb.k.nbytes < ca.k.nbytes
    c16 = torch.as_tensor(ca.v.coefficients).float()
    c8 = torch.as_tensor(cb.v.coefficients).view(torch.float8_e4m3fn).float()
    assert ((c8 - c16).abs() <= c16.abs() * 2 ** -4 + 2 ** -9).all()
    for (k16, _), (k8, _) in zip(a.load_kv(ids), b.load_kv(ids)):
        assert ((k8 - k16).square().sum() / k16.square().sum()).item() < 0.01
    assert verify(fp8)["ok"]
    assert b.info()["compression"]["code_bytes_per_token"] == 4 * 2 * (5 + 4)  # 1-byte coefficients


def test_elias_fano_and_packed_stores_hold_the_same_codes(build, store, corpus_dir, tmp_path):
    """Index coding is lossless: each token's atom set and its coefficients are the same."""
    from sparsecache.codec.bitpack import unpack_rows, unpack_sorted_rows

    packed = tmp_path / "packed"
    build([corpus_dir], packed, config=replace(CONFIG, index_coding="packed"))
    ef, pk = KVStore.open(store), KVStore.open(packed)
    assert (ef.config.index_coding, pk.config.index_coding) == ("elias-fano", "packed")
    ids = [c.id for c in ef.chunks()]
    a, b = ef.read_codes(ids), pk.read_codes(ids)
    s, n = ef.dictionary.config.sparsity, ef.dictionary.config.atoms
    G, T, _ = a.k.indices.shape
    ia = unpack_sorted_rows(a.k.indices.reshape(G * T, -1), s, n)
    ib = unpack_rows(b.k.indices.reshape(G * T, -1), s, ef.dictionary.config.index_bits)
    ca, cb = a.k.coefficients.reshape(G * T, s), b.k.coefficients.reshape(G * T, s)
    assert (np.diff(ia, axis=1) > 0).all()
    for r in range(0, G * T, 7):
        assert dict(zip(ia[r], ca[r])) == dict(zip(ib[r], cb[r]))
    for (k1, v1), (k2, v2) in zip(ef.load_kv(ids), pk.load_kv(ids)):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)


def test_format_1_store_reads_as_packed(build, corpus_dir, tmp_path):
    """Stores written before index_coding existed (format 1) have packed indices and still read."""
    old = tmp_path / "old"
    build([corpus_dir], old, config=replace(CONFIG, index_coding="packed"))
    before = all_codes(old)
    meta = old / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["sparsecache"]["format"] = 1
    del doc["attributes"]["sparsecache"]["config"]["index_coding"]
    meta.write_text(json.dumps(doc))
    s = KVStore.open(old)
    assert s.config.index_coding == "packed" and s.codec().indices == "packed"
    assert_same_codes(all_codes(old), before)
    write_corpus(corpus_dir, ("return",))
    build([corpus_dir], old, config=replace(CONFIG, index_coding="packed"))
    assert verify(old)["ok"] and versions(old) == [1, 2, 3]


def _as_format_2(store: Path) -> None:
    """Rewrite a store's text columns the way format 2 kept them (zarr-python vlen strings)."""
    import zarr

    from sparsecache.store.layout import TABLE_STR

    s = KVStore.open(store)
    cols = {c: s.column(c) for c in TABLE_STR}
    g = zarr.open_group(str(store / "data" / s.manifest.generation), mode="r+")
    for c, values in cols.items():
        shutil.rmtree(store / "data" / s.manifest.generation / f"{c}_utf8")
        shutil.rmtree(store / "data" / s.manifest.generation / f"{c}_ends")
        with zarr.config.set({"array.write_empty_chunks": True}):  # as sparsecache's writer always did
            g.create_array(c, shape=(len(values),), chunks=(4096,), dtype=str)[:] = values
    root = zarr.open_group(str(store), mode="r+")
    root.attrs["sparsecache"] = {**root.attrs["sparsecache"], "format": 2}


def test_format_2_stores_still_read_and_append(build, store, corpus_dir, tmp_path):
    before = all_codes(store)
    texts = KVStore.open(store).texts(list(before))
    _as_format_2(store)
    s = KVStore.open(store)
    assert s.legacy_strings and s.texts(list(before)) == texts
    r = verify(store)
    assert r["ok"], r["problems"]
    (corpus_dir / "new.txt").write_text("A new document about lists and tuples. " * 20)
    build([corpus_dir], store)  # appends in the generation's own (legacy) layout
    assert verify(store)["ok"] and "new.txt" in {c.doc_id for c in KVStore.open(store).chunks()}
    m = compact(store, keep=1)  # compaction moves it to the current layout
    assert not KVStore.open(store).legacy_strings and verify(store)["ok"]
    assert m.generation == "g000002"


def test_search_within_documents_finds_k_among_them(store, embedder):
    s = KVStore.open(store)
    q = embedder.embed(["assertions and debugging"])[0]
    docs = sorted({c.doc_id for c in s.chunks()})
    some = [d for d in docs if d != s.search(q, 1)[0][0].doc_id][:2]
    hits = s.search(q, 50, documents=some)
    assert {c.doc_id for c, _ in hits} == set(some)
    assert len(hits) == sum(c.doc_id in some for c in s.chunks())  # the restriction is in the search, not after it
    assert [c.id for c, _ in s.search(q, 2, documents=some)] == [c.id for c, _ in hits[:2]]
    with pytest.raises(StoreError, match="no document 'missing.txt'"):
        s.search(q, 2, documents=["missing.txt"])


def test_a_session_reads_again_at_the_newest_version_when_its_version_is_compacted_away(store, tiny_model):
    """Session.query and Session.retrieve read at a live version: a compact that deletes the
    version a session holds makes its next read go to the newest version, once."""
    from sparsecache.query.session import Session

    s = Session(store, tiny_model)
    before = s.store.version
    compact(store, keep=1)
    assert not s.store.published()
    a = s.query("What does the global statement do?", top_k=2, max_new_tokens=2)
    assert a.chunks and s.rereads == 1 and s.store.version == before + 1
    assert s.retrieve("What does the global statement do?", 2) and s.rereads == 1


def test_a_large_stores_reader_reads_single_rows_as_the_whole_columns_say(store, monkeypatch):
    """Above WHOLE_COLUMNS_UP_TO chunks a reader reads only the rows a search answers with
    (two rounds of concurrent Zarr reads); they must be what the whole columns hold."""
    import sparsecache.store.reader as reader

    whole = KVStore.open(store)
    rows = whole.live_rows()[[0, -1, 1, len(whole.live_rows()) // 2]]
    monkeypatch.setattr(reader, "WHOLE_COLUMNS_UP_TO", 0)
    lazy = KVStore.open(store)
    assert lazy.chunks_at(rows) == whole.chunks_at(rows) and not lazy._columns
    ids = [c.id for c in whole.chunks_at(rows)]
    assert lazy.texts(ids) == whole.texts(ids) and lazy.spans(ids) == whole.spans(ids)
    q = whole.search(np.ones(whole.attrs["embed_dim"], np.float32) / 20, 3)
    assert [(c, round(s, 5)) for c, s in lazy.search(np.ones(whole.attrs["embed_dim"], np.float32) / 20, 3)] == \
        [(c, round(s, 5)) for c, s in q]
    assert lazy._points.cache  # read from the chunk objects, not through zarr's pipeline


def test_direct_table_reads_equal_zarrs_and_name_a_damaged_chunk(store, tmp_path, monkeypatch):
    """`DirectPoints` (chunk objects, CRC-checked, zstd undone) reads what zarr reads, at any
    positions of every chunk-table array; a damaged chunk is named, never decoded as data."""
    import sparsecache.store.reader as reader
    from sparsecache.store.layout import zarr_points

    s = KVStore.open(store)
    names = [n for n in s.group.array_keys() if s.group[n].ndim == 1 and s.group[n].shape[0] and n != "tokens"]
    assert {"doc_id_ends", "doc_id_utf8", "ordinal"} <= set(names)
    rng = np.random.default_rng(0)
    reads = [(n, np.sort(rng.integers(0, s.group[n].shape[0], 7))) for n in names]
    for got, want in zip(s._points(reads), zarr_points(s._handles)(reads)):
        np.testing.assert_array_equal(got, want)
    monkeypatch.setattr(reader.DirectPoints, "CACHE_BYTES", 1)  # a full cache evicting what a read needs
    small = KVStore.open(store)
    for _ in range(2):
        for got, want in zip(small._points(reads), zarr_points(s._handles)(reads)):
            np.testing.assert_array_equal(got, want)

    copy = tmp_path / "damaged"
    shutil.copytree(store, copy)
    chunk = copy / s.data / "doc_id_ends" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    monkeypatch.setattr(reader, "WHOLE_COLUMNS_UP_TO", 0)
    with pytest.raises(StoreCorrupt, match="doc_id_ends/c/0 fails its CRC32C"):
        KVStore.open(copy).chunks_at([0])
