"""The store's own fixtures: encodes that the fault-injection tests crash and compare."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from support.corpora import write_corpus
from support.crashes import CRASH_TOPICS, HISTORY_BATCH_TOKENS, HISTORY_CONFIG, FakeEmbedder


@pytest.fixture(scope="module")
def history_encode(tiny_model, tiny_dictionary):
    """encode_with(corpus, store) as the fault-injection histories run it: the tiny model,
    small chunks and batches (many commits), a fake embedder, --delete-missing, --keep 3."""
    fake = FakeEmbedder()

    def run(corpus, store):
        return encode_with([str(corpus)], str(store), tiny_dictionary, tiny_model, HISTORY_CONFIG,
                           EncodeOptions(batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3, progress=False),
                           embedder=fake)
    return run



@pytest.fixture(scope="module")
def crash_corpus(tmp_path_factory) -> Path:
    """Ten short documents after one long one, so the second batch ends inside a document."""
    from pydoc_data.topics import topics

    root = write_corpus(tmp_path_factory.mktemp("crash") / "corpus", CRASH_TOPICS)
    (root / "aaa-long.txt").write_text(topics["specialnames"][:6000])
    return root


@pytest.fixture(scope="module")
def reference_plain(crash_corpus, tiny_model, tiny_dictionary, embedder, tmp_path_factory) -> Path:
    """The crash corpus's store on the plain layout (`--encode-after prefix`), whose encode a rerun continues
    inside a document."""
    from sparsecache.store import StoreConfig

    out = tmp_path_factory.mktemp("ref-plain") / "store"
    encode_with([str(crash_corpus)], out, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64, encode_after="prefix"),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    return out


@pytest.fixture(scope="module")
def reference(crash_corpus, tiny_model, tiny_dictionary, embedder, tmp_path_factory) -> Path:
    from sparsecache.store import StoreConfig

    out = tmp_path_factory.mktemp("ref") / "store"
    encode_with([str(crash_corpus)], out, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    return out

