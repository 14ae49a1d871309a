"""RagPrompts without an engine: layout, options, the prefix-cache salt, following new versions."""

from __future__ import annotations

import pytest

from sparsecache.errors import ConfigError, StoreError
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.store import StoreConfig
from sparsecache.vllm.serving import PARAMS_KEY, RagPrompts

CONFIG = StoreConfig(chunk_tokens=64, zarr_chunk_tokens=32, coef_dtype="float16")


@pytest.fixture
def built(tiny_model, tiny_dictionary, embedder, corpus_dir, tmp_path):
    def run():
        encode_with([str(corpus_dir)], tmp_path / "store", tiny_dictionary, tiny_model, CONFIG,
                    EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
        return tmp_path / "store"
    return run


def test_requests_lay_out_retrieve_within_documents_and_refuse_bad_input(built, tiny_model_dir):
    rag = RagPrompts(built(), model=str(tiny_model_dir))
    req = rag.request("What does assert do?", top_k=3)
    ids = req.kv_transfer_params[PARAMS_KEY]["chunks"]
    assert len(ids) == 3 and [h["id"] for h in req.chunks] == ids
    assert req.kv_transfer_params[PARAMS_KEY]["version"] == rag.store.version
    docs = sorted({c.doc_id for c in rag.store.chunks()})[:2]
    assert {h["doc_id"] for h in rag.request("anything", top_k=20, documents=docs).chunks} == set(docs)
    given = rag.request("anything", chunks=ids[:1])
    assert given.chunks[0]["score"] is None and given.chunks[0]["doc_id"] == req.chunks[0]["doc_id"]
    with pytest.raises(ConfigError, match="empty"):
        rag.request("   ")
    with pytest.raises(StoreError, match="no live chunk"):
        rag.request("anything", chunks=["nope"])
    with pytest.raises(StoreError, match="no document"):
        rag.request("anything", documents=["nope.txt"])


def test_the_cache_salt_separates_kv_that_differs(built, tiny_model_dir):
    """Blended KV depends on the question and the settings; decoded KV (none) on neither."""
    rag = RagPrompts(built(), model=str(tiny_model_dir))
    ids = [c.id for c in rag.store.chunks()][:2]

    def salt(question, **params):
        req = rag.request(question, chunks=ids)
        req.kv_transfer_params[PARAMS_KEY].update(params)
        return req.cache_salt

    assert salt("a?") == salt("a?") != salt("b?")  # the default blends
    assert salt("a?", recompute_ratio=0.5) != salt("a?", recompute_ratio=0.25)
    assert salt("a?", method="none") == salt("b?", method="none") != salt("a?", method="infoflow")
    assert salt("a?", method="none", source="raw") != salt("a?", method="none")
    assert rag.request("a?", chunks=ids).vllm_prompt()["cache_salt"] == salt("a?")


def test_a_following_rag_sees_each_new_version(built, tiny_model_dir, corpus_dir):
    store = built()
    rag = RagPrompts(store, model=str(tiny_model_dir), follow_s=0)
    pinned = RagPrompts(store, model=str(tiny_model_dir))
    first = rag.store.version
    (corpus_dir / "new.txt").write_text("Zebras graze on the savannah in the early morning light.\n")
    built()
    req = rag.request("zebras on the savannah", top_k=1)
    assert req.kv_transfer_params[PARAMS_KEY]["version"] == first + 1 and req.chunks[0]["doc_id"].endswith("new.txt")
    assert pinned.request("zebras", top_k=1).kv_transfer_params[PARAMS_KEY]["version"] == first


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's, on importing vLLM (hidden outside pytest)
def test_serve_stops_at_start_up_with_one_line(built, tmp_path, monkeypatch):
    """No vLLM: how to install it. With vLLM: a store that cannot be opened, or one of another
    model than the one to serve, ends the command before any engine starts."""
    import sys

    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
        r = CliRunner().invoke(cli, ["serve", str(tmp_path / "none.store")])
    assert r.exit_code == 1 and "bash scripts/setup.sh vllm" in r.output and len(r.output.splitlines()) == 1
    pytest.importorskip("vllm")
    r = CliRunner().invoke(cli, ["serve", str(tmp_path / "none.store")])
    assert r.exit_code == 1 and "no sparsecache store at" in r.output and len(r.output.splitlines()) == 1, r.output
    r = CliRunner().invoke(cli, ["serve", str(built())])  # the tiny model's store, the default model to serve
    assert r.exit_code == 1 and "encoded with model" in r.output and len(r.output.splitlines()) == 1, r.output


def test_the_kv_cache_on_a_cpu_is_sized_from_the_memory_free():
    """`serve`'s rule on a CPU: room for max_seqs requests of max_len tokens, at most half of what
    is free on vLLM's NUMA node, at least one request; a request that cannot fit is one line."""
    from sparsecache.vllm.server import KV_CACHE_SHARE, kv_cache_bytes

    assert kv_cache_bytes(100, 1000, 8, 10**9) == 8 * 100 * 1000
    assert kv_cache_bytes(100, 1000, 10**6, 10**9) == int(KV_CACHE_SHARE * 10**9)
    with pytest.raises(ConfigError, match="free on NUMA node 1.*--max-model-len.*--kv-cache-gb"):
        kv_cache_bytes(10**6, 1000, 1, 10**9, node=1)


def test_a_damaged_local_store_gets_one_line_with_its_status_and_verify_names_the_damage(built, tiny_model_dir):
    """The server's retrieval and layout (`Rag`, no engine) over a local store whose chunk file
    is removed (500: damaged, named) or cannot be read (a directory in its place: 503); a chunk
    read before is still answered, the next request after the repair too, and `verify` names
    the file and the chunk it holds."""
    pytest.importorskip("prometheus_client")
    from sparsecache.kvstore import verify
    from sparsecache.store.reader import chunk_key
    from sparsecache.vllm.server import Rag, ServeConfig, StoreDamaged, StoreDown

    store = built()
    rag = Rag(ServeConfig(str(store), model=str(tiny_model_dir), top_k=1))
    try:
        s = rag.prompts.store
        tokens = s.array("tokens")
        step = tokens.chunks[0]
        chunks = s.chunks()
        spans = s.spans([c.id for c in chunks])

        def files(span):
            return set(range(span[0] // step, (span[1] - 1) // step + 1))

        held = chunks[0]
        assert rag.request("what?", {"chunks": [held.id]}).chunks[0]["id"] == held.id  # read: held in memory
        other, span = next((c, sp) for c, sp in zip(chunks, spans) if not files(sp) & files(spans[0]))
        key = f"{s.manifest.generation}/tokens/{chunk_key(tokens, span[0] // step, 0)}"
        path = store / "data" / key
        data = path.read_bytes()
        path.unlink()
        with pytest.raises(StoreDamaged) as damaged:
            rag.request("what?", {"chunks": [other.id]})
        message = str(damaged.value)
        assert damaged.value.status == 500 and key in message and "sparsecache verify" in message and "\n" not in message
        assert rag.request("what?", {"chunks": [held.id]}).chunks[0]["id"] == held.id
        path.mkdir()  # a file that cannot be read
        with pytest.raises(StoreDown) as down:
            rag.request("what?", {"chunks": [other.id]})
        assert down.value.status == 503 and str(path) in str(down.value) and "\n" not in str(down.value)
        report = verify(store)
        assert not report["ok"] and any(p.startswith(key) for p in report["problems"])
        assert other.id in report["corrupt_chunks"] and held.id not in report["corrupt_chunks"]
        path.rmdir()
        path.write_bytes(data)
        assert rag.request("what?", {"chunks": [other.id]}).chunks[0]["id"] == other.id
    finally:
        rag.close()


def test_the_server_spends_a_requests_ttft_budget_at_its_context_length(built, tiny_model_dir):
    """`serve --ttft-budget` (or a request's `ttft_budget`): the ratio is fixed at layout from the store's
    refit for this device, passed to the connector as the ratio in effect (one salt) and reported with the
    sources; a ratio given wins, and a bad budget is a 400."""
    pytest.importorskip("prometheus_client")
    from sparsecache.query.budget import Costs
    from sparsecache.store import Writer
    from sparsecache.vllm.server import BadRequest, Rag, ServeConfig

    store = built()
    refit = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)
    with Writer(store) as w:
        w.publish_calibration({"cpu": {"method": "none", "label": "none", "costs": refit.to_dict()}},
                              note="calibrated (cpu)")
    rag = Rag(ServeConfig(str(store), model=str(tiny_model_dir), top_k=2, method="infoflow", ttft_budget=0.5))
    try:
        rag.device = "cpu"
        ids = [c.id for c in rag.prompts.store.chunks()][:2]
        req = rag.request("what?", rag.options({"chunks": ids}))
        assert req.params["recompute_ratio"] == pytest.approx(refit.ratio(req.context_tokens, 0.5), abs=1e-4)
        assert rag.sources(req)["recompute_ratio"] == req.params["recompute_ratio"]
        tighter = rag.request("what?", rag.options({"chunks": ids, "ttft_budget": 0.3}))
        assert tighter.params["recompute_ratio"] < req.params["recompute_ratio"]
        assert tighter.cache_salt != req.cache_salt
        given = rag.request("what?", rag.options({"chunks": ids, "recompute_ratio": 0.2}))
        assert given.params["recompute_ratio"] == 0.2
        with pytest.raises(BadRequest, match="ttft"):
            rag.options({"ttft_budget": 3})
    finally:
        rag.close()
