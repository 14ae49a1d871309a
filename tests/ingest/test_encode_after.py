"""Chunks encoded after what they will be read with (#94 item 2, `--encode-after`): what each chunk
reads is what the store records, its own K/V alone is kept, and a neighbours store brought up to date
equals one built fresh from the same corpus (the crash histories are in `store/test_crashes.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsecache.errors import ConfigError
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.model.kvmodel import extract_kv
from sparsecache.kvstore import compact, verify
from sparsecache.store import Store, StoreConfig
from support.crashes import FakeEmbedder
from support.stores import assert_same_live_chunks

CONFIG = dict(chunk_tokens=48, zarr_chunk_tokens=16, coef_dtype="float16")


def encode(corpus, store, model, dictionary, mode: str, chunks: int = 1, **options):
    return encode_with([str(corpus)], store, dictionary, model,
                       StoreConfig(**CONFIG, encode_after=mode, encode_after_chunks=chunks),
                       EncodeOptions(batch_tokens=200, progress=False, **options), embedder=FakeEmbedder())


def after_column(store) -> dict[tuple[str, int], str]:
    s = Store.open(store)
    rows = s.manifest.live_rows()
    cols = {c: s.column(c)[rows] for c in ("doc_id", "ordinal", "chunk_id", "after")}
    return {(str(d), int(o)): str(a) for d, o, a in zip(cols["doc_id"], cols["ordinal"], cols["after"])}


def chunk_ids(store) -> dict[str, tuple[str, int]]:
    s = Store.open(store)
    rows = s.manifest.live_rows()
    return {str(c): (str(d), int(o)) for c, d, o in zip(*(s.column(n)[rows] for n in ("chunk_id", "doc_id", "ordinal")))}


def test_a_context_is_read_and_left_out_as_a_longer_prefix_would_be(tiny_model):
    """extract_kv's per-chunk contexts give the K/V a prefix of prefix + context gives, batched with others."""
    prefix, ctx, chunk, other = [5, 6, 7], [40, 41, 42, 43], [100, 101, 102], [200, 201]
    got = extract_kv(tiny_model, [chunk, other], prefix, contexts=[ctx, []])
    want = extract_kv(tiny_model, [chunk], prefix + ctx)[0]
    alone = extract_kv(tiny_model, [other], prefix)[0]
    for g, w in zip(got[0], want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    for g, w in zip(got[1], alone):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert got[0][0].shape == (tiny_model.n_layers, 3, tiny_model.m)
    assert not torch.allclose(got[0][0], extract_kv(tiny_model, [chunk], prefix)[0][0], atol=1e-4)


@pytest.mark.parametrize("n", [1, 2])
def test_document_mode_reads_the_chunks_before_it(corpus_dir, tmp_path, tiny_model, tiny_dictionary, n):
    encode(corpus_dir, tmp_path / "s", tiny_model, tiny_dictionary, "document", n)
    after, ids = after_column(tmp_path / "s"), chunk_ids(tmp_path / "s")
    by_key = {v: k for k, v in ids.items()}
    assert any(o > 1 for _, o in after)  # the corpus has documents of several chunks
    for (doc, ordinal), a in after.items():  # the one just before first
        assert a == ",".join(by_key[(doc, o)] for o in range(ordinal - 1, max(-1, ordinal - 1 - n), -1))


@pytest.mark.parametrize("n", [1, 2])
def test_neighbours_mode_reads_the_nearest_chunks_of_other_documents(corpus_dir, tmp_path, tiny_model,
                                                                     tiny_dictionary, n):
    encode(corpus_dir, tmp_path / "s", tiny_model, tiny_dictionary, "neighbours", n)
    after, ids = after_column(tmp_path / "s"), chunk_ids(tmp_path / "s")
    s = Store.open(tmp_path / "s")
    rows = s.manifest.live_rows()
    emb, cid, doc = s.column("embeddings")[rows], s.column("chunk_id")[rows], s.column("doc_id")[rows]
    sims = emb @ emb.T
    for i in range(len(rows)):  # brute force, beside the encoder's FAISS search: best first, ties by id
        other = sorted((j for j in range(len(rows)) if doc[j] != doc[i]), key=lambda j: (-sims[i, j], cid[j]))
        assert after[ids[str(cid[i])]] == ",".join(str(cid[j]) for j in other[:n])


def test_the_context_is_laid_out_as_a_query_would():
    """Nearest next to the chunk, each read chunk with the trailer after it and the header before the next."""
    from sparsecache.ingest.after import After

    a = After("neighbours", header=(-1, -2), trailer=(-3,), count=2,
              neighbour={"c": [("near", (10, 11)), ("far", (20,))]})

    class C:
        id = "c"

    assert a.context(C()) == ([20, -3, -1, -2, 10, 11, -3, -1, -2], "near,far")


def test_only_the_chunks_own_kv_is_kept(corpus_dir, tmp_path, tiny_model, tiny_dictionary):
    """The same tokens and bytes per token as a plain store: the context's K/V is not stored; the codes differ
    where a chunk read something."""
    encode(corpus_dir, tmp_path / "plain", tiny_model, tiny_dictionary, "prefix")
    encode(corpus_dir, tmp_path / "nb", tiny_model, tiny_dictionary, "neighbours")
    a, b = Store.open(tmp_path / "plain"), Store.open(tmp_path / "nb")
    assert a.manifest.tokens == b.manifest.tokens and a.manifest.chunks == b.manifest.chunks
    assert np.array_equal(a.array("tokens")[:], b.array("tokens")[:])
    assert a.array("k_coefficients").shape == b.array("k_coefficients").shape
    assert not np.array_equal(a.array("k_indices")[:], b.array("k_indices")[:])


def test_a_changed_neighbour_re_encodes_the_chunks_that_read_it(corpus_dir, tmp_path, tiny_model, tiny_dictionary):
    """The nightly rule: a held document whose chunks' nearest neighbours changed is encoded again, so the store
    equals a fresh build of the new corpus; an unchanged corpus does nothing."""
    corpus = corpus_dir
    store = tmp_path / "store"
    encode(corpus, store, tiny_model, tiny_dictionary, "neighbours")
    again = encode(corpus, store, tiny_model, tiny_dictionary, "neighbours")
    assert again.tokens == 0 and not again.published
    before = after_column(store)
    # a copy of one chunk's text as a new document: that chunk's nearest is now the copy (an equal vector)
    (corpus / "zz-copy.txt").write_text((corpus / "pass.txt").read_text())
    (corpus / "del.txt").unlink()
    r = encode(corpus, store, tiny_model, tiny_dictionary, "neighbours", delete_missing=True)
    assert r.documents["new"] == 1 and r.documents["refreshed"] >= 1
    now = after_column(store)
    assert any(before.get(k) != v for k, v in now.items() if k[0] == "pass.txt")
    fresh = tmp_path / "fresh"
    encode(corpus, fresh, tiny_model, tiny_dictionary, "neighbours")
    assert after_column(store) == after_column(fresh)
    assert_same_live_chunks(store, fresh)


def test_compaction_keeps_what_each_chunk_read(corpus_dir, tmp_path, tiny_model, tiny_dictionary):
    corpus = corpus_dir
    store = tmp_path / "store"
    encode(corpus, store, tiny_model, tiny_dictionary, "document")
    (corpus / "del.txt").write_text((corpus / "del.txt").read_text() + "\n\nOne more paragraph.")
    encode(corpus, store, tiny_model, tiny_dictionary, "document")
    before = after_column(store)
    compact(store, keep=1)
    assert after_column(store) == before
    assert verify(store)["ok"]


def test_a_plain_store_has_no_after_column_and_an_option_is_checked(corpus_dir, tmp_path, tiny_model,
                                                                    tiny_dictionary):
    encode(corpus_dir, tmp_path / "s", tiny_model, tiny_dictionary, "prefix")
    assert "after_ends" not in Store.open(tmp_path / "s").group
    with pytest.raises(ConfigError, match="encode-after"):
        StoreConfig(encode_after="everything")
    with pytest.raises(ConfigError):  # a store keeps what its chunks were encoded after
        encode(corpus_dir, tmp_path / "s", tiny_model, tiny_dictionary, "document")


def test_encode_corpus_takes_the_option_and_keeps_it(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    """Through the CLI, as a user runs it: the store records the mode, and a re-index without the option keeps it."""
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    args = ["encode-corpus", str(corpus_dir), "--store", str(tmp_path / "s"), "--model", str(tiny_model_dir),
            "--dict", str(tiny_dictionary_dir), "--chunk-tokens", "64"]
    r = CliRunner().invoke(cli, args + ["--encode-after", "document"])
    assert r.exit_code == 0, r.output
    assert Store.open(tmp_path / "s").config.encode_after == "document"
    (corpus_dir / "pass.txt").write_text("Changed. " + (corpus_dir / "pass.txt").read_text())
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0 and "1 changed" in r.output, r.output
    assert after_column(tmp_path / "s")[("pass.txt", 1)] != ""
    info = CliRunner().invoke(cli, ["info", str(tmp_path / "s")])
    assert "each chunk encoded after the chunk(s) before it in its document (up to 1" in info.output, info.output
    r = CliRunner().invoke(cli, args + ["--encode-after", "neighbours"])
    assert r.exit_code != 0 and "encode_after" in r.output.replace("-", "_"), r.output



def test_a_new_store_is_encoded_after_neighbours_by_default_and_an_old_plain_store_stays_plain(
        corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    """The default since #94's rule chose it, as a user runs it (no option): a new store's chunks read their
    nearest neighbour. A plain store's attributes leave the field out (as releases before it wrote them), and
    a nightly re-index of it with today's defaults keeps it plain."""
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    args = ["encode-corpus", str(corpus_dir), "--model", str(tiny_model_dir), "--dict", str(tiny_dictionary_dir),
            "--chunk-tokens", "64"]
    r = CliRunner().invoke(cli, args + ["--store", str(tmp_path / "new")])
    assert r.exit_code == 0, r.output
    assert Store.open(tmp_path / "new").config.encode_after == StoreConfig().encode_after == "neighbours"
    assert all(after_column(tmp_path / "new").values())  # every chunk read another document's
    r = CliRunner().invoke(cli, args + ["--store", str(tmp_path / "old"), "--encode-after", "prefix"])
    assert r.exit_code == 0, r.output
    assert "encode_after" not in Store.open(tmp_path / "old").attrs["config"]
    (corpus_dir / "pass.txt").write_text("Changed. " + (corpus_dir / "pass.txt").read_text())
    r = CliRunner().invoke(cli, args + ["--store", str(tmp_path / "old")])
    assert r.exit_code == 0 and "1 changed" in r.output, r.output
    assert Store.open(tmp_path / "old").config.encode_after == "prefix"
    assert "after_ends" not in Store.open(tmp_path / "old").group


def test_a_release_before_encode_after_opens_a_plain_store_and_refuses_one_encoded_after(corpus_dir, tmp_path,
                                                                                        tiny_model, tiny_dictionary):
    """A plain store written now keeps the attributes an earlier release reads; a store encoded after its
    neighbours says format 5, which that release refuses in one line ("upgrade sparsecache") instead of
    misreading it."""
    from support.stores import open_in_release

    before = "b06d2da"  # the last commit before --encode-after
    encode(corpus_dir, tmp_path / "plain", tiny_model, tiny_dictionary, "prefix")
    encode(corpus_dir, tmp_path / "nb", tiny_model, tiny_dictionary, "neighbours")
    ok = open_in_release(before, tmp_path / "plain", tmp_path)
    assert ok.returncode == 0 and ok.stdout.split()[2] == "1", ok.stderr[-2000:]
    refused = open_in_release(before, tmp_path / "nb", tmp_path / "nb-reader")
    assert refused.returncode != 0 and "upgrade sparsecache" in refused.stderr, refused.stderr[-2000:]
    assert Store.open(tmp_path / "nb").config.encode_after == "neighbours"  # and this one reads it
