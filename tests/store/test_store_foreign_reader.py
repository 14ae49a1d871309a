"""A store is readable by any Zarr v3 implementation: every array of a fresh store opens and
reads with Google's tensorstore (a client sparsecache did not write), equal to what
zarr-python reads; the text columns decode from their UTF-8 bytes and ends; float8
coefficients say they are e4m3."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.kvstore import KVStore
from sparsecache.store import StoreConfig

ts = pytest.importorskip("tensorstore", reason="the test extra installs tensorstore")


def open_ts(path):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()


def test_every_array_reads_with_tensorstore(tiny_model, tiny_dictionary, embedder, corpus_dir, tmp_path):
    store = tmp_path / "store"
    encode_with([str(corpus_dir)], store, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    s = KVStore.open(store)
    arrays = sorted(p.parent for p in store.rglob("zarr.json") if json.loads(p.read_text())["node_type"] == "array")
    assert len(arrays) >= 20
    for path in arrays:
        ours = np.asarray(__import__("zarr").open_array(str(path), mode="r")[...])
        theirs = open_ts(path).read().result()
        np.testing.assert_array_equal(theirs, ours, err_msg=str(path.relative_to(store)))
    g = store / "data" / "g000001"
    ends = open_ts(g / "text_ends").read().result()
    blob = open_ts(g / "text_utf8").read().result().tobytes()
    texts = [blob[a:b].decode() for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]
    assert texts == list(s.column("text"))
    attrs = json.loads((g / "k_coefficients" / "zarr.json").read_text())["attributes"]
    assert attrs["sparsecache"]["element_type"] == "float8_e4m3fn"
    coef = open_ts(g / "k_coefficients").read().result()
    ml = pytest.importorskip("ml_dtypes")
    as_fp8 = coef.view(ml.float8_e4m3fn).astype(np.float32)  # what a foreign reader does with the attribute
    live = as_fp8[:, : s.manifest.tokens]
    assert np.isfinite(live).all() and np.abs(live).max() > 0
