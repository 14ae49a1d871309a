"""kill -9 an encode at exact points (and at a random moment), rerun, and compare with an
uninterrupted build: same live chunks, same codes, same documents."""

from __future__ import annotations

import random
import signal
import time

import pytest
from conftest import CRASH_TOPICS, all_codes, assert_same_codes, encode_cmd, kill_at, rerun, start_encode

from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.kvstore import KVStore, verify
from sparsecache.store import read_manifest


@pytest.mark.parametrize("point", ["commit:2", "index:1", "publish:1"])
def test_killed_encode_resumes_to_the_same_store(point, crash_corpus, reference, tiny_model_dir,
                                                 tiny_dictionary_dir, tmp_path):
    store = tmp_path / "store"
    cmd = encode_cmd(crash_corpus, store, tiny_model_dir, tiny_dictionary_dir)
    kill_at(cmd, point, tmp_path)
    if point == "commit:2":
        assert read_manifest(store).version == 1  # nothing published yet: readers see the empty store
        assert (store / "pending.json").exists()
    report = rerun(cmd)
    total = KVStore.open(reference).info()["tokens"]
    if point == "publish:1":  # the version was out; the rerun finds nothing to do
        assert not report["published"] and report["tokens"] == 0
    elif point == "index:1":  # everything was encoded; the rerun only indexes and publishes
        assert report["documents"]["resumed"] == len(CRASH_TOPICS) + 1 and report["tokens"] == 0
    else:  # killed inside the long document: the rerun continues it from the recorded batch
        assert report["documents"]["resumed"] == 0 and 0 < report["tokens"] <= total - 2 * 256
    assert_same_codes(all_codes(store), all_codes(reference))
    assert read_manifest(store).documents == read_manifest(reference).documents
    assert verify(store)["ok"]


def test_killed_at_a_random_moment(crash_corpus, reference, tiny_model_dir, tiny_dictionary_dir, tmp_path):
    store = tmp_path / "store"
    cmd = encode_cmd(crash_corpus, store, tiny_model_dir, tiny_dictionary_dir)
    rng = random.Random(1)
    for _ in range(2):
        proc = start_encode(cmd)
        time.sleep(rng.uniform(4.0, 12.0))  # import + model load take ~4 s here; encoding ~5 s
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rerun(cmd)
    assert_same_codes(all_codes(store), all_codes(reference))
    s = KVStore.open(store)
    assert s.info()["tombstoned_chunks"] == 0


def test_killed_inside_a_document_then_the_corpus_changes(crash_corpus, tiny_model, tiny_dictionary, embedder,
                                                          tiny_model_dir, tiny_dictionary_dir, tmp_path):
    """The nightly case with a real kill -9: killed inside the long first document, then a
    document whose id sorts before it arrives and another is deleted; the rerun must equal a
    fresh encode of the changed corpus (it used to alias the two documents' rows)."""
    import shutil

    from conftest import assert_same_live_chunks

    from sparsecache.store import StoreConfig

    corpus = tmp_path / "corpus"
    shutil.copytree(crash_corpus, corpus)
    store = tmp_path / "store"
    cmd = encode_cmd(corpus, store, tiny_model_dir, tiny_dictionary_dir) + ["--delete-missing"]
    kill_at(cmd, "commit:1", tmp_path)
    (corpus / "aa0-new.txt").write_text((corpus / "pass.txt").read_text() + " Then more text arrived.")
    (corpus / "del.txt").unlink()
    rerun(cmd)
    assert verify(store)["ok"]
    fresh = tmp_path / "fresh"
    encode_with([str(corpus)], fresh, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    assert_same_live_chunks(store, fresh)
