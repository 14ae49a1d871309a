"""The real Qwen2.5-Coder-0.5B-Instruct (`scripts/setup.sh qwen`, six pinned packages, ~470 MB;
skipped where they are not installed): named by `--model qwen2.5-coder-0.5b`, checked against
its pins and converted once, and passing the gate every model passes (`check-model`)."""

from __future__ import annotations

import json

import pytest

from sparsecache.model.packaged import PACKAGED

QWEN = PACKAGED["qwen2.5-coder-0.5b"]
pytest.importorskip(QWEN.parts[-1].module)
pytestmark = pytest.mark.slow


def test_check_model_passes_it_by_name():
    from support.cli import invoke

    r = invoke("check-model", "qwen2.5-coder-0.5b", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["passed"], result
    assert result["model"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert result["fingerprint"]["layers"] == 24 and result["fingerprint"]["m"] == 2 * 64
    assert [c["name"] for c in result["checks"]] == ["capture", "recompute-all", "single-chunk"]


def test_its_shipped_dictionary_is_found_and_the_default_path_keeps_full_prefills_answer(embedder, tmp_path):
    """`encode-corpus --model qwen2.5-coder-0.5b` with no --dict codes with its shipped dictionary
    (found by the model's fingerprint); a query of it with no --model reads it with Qwen (the
    store's own packaged model) and, with the default method, predicts full prefill's answer."""
    from pydoc_data.topics import topics

    from support.cli import invoke
    from sparsecache.codec.dictionary import SHIPPED_DIR, shipped_dictionary
    from sparsecache.model.kvmodel import model_fingerprint

    path = shipped_dictionary(model_fingerprint("qwen2.5-coder-0.5b"))
    assert path.parent == SHIPPED_DIR and path.name.startswith("qwen2.5-coder-0.5b-")
    meta = json.loads((path / "dictionary.json").read_text())
    assert "eval" in meta, "shipped dictionaries carry their eval-dict numbers"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for t in ("pass", "assert"):
        (corpus / f"{t}.txt").write_text(topics[t][:2000])
    r = invoke("encode-corpus", corpus, "--store", tmp_path / "store", "--model", "qwen2.5-coder-0.5b")
    assert r.exit_code == 0, r.output
    r = invoke("query", tmp_path / "store", "What does the pass statement do?", "--top-k", 2, "--max-new-tokens", 16,
               "--compare", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["answer"] and out["full_prefill"]["token_agreement"] >= 0.5, out


def test_its_shipped_wrapper_is_found_by_the_model_and_one_wrapped_chunk_is_full_prefill():
    """Qwen's shipped header-only wrapper (#80 item 3), learned from data no evaluation reads, is found by
    the model's fingerprint (opt-in: a new Qwen store stays plain unless asked), and with k = 1 the
    wrapped per-chunk path gives full prefill's logits of `prefix | header chunk | question`."""
    from support.models import assert_shipped_opt_in_wrapper
    from sparsecache.model import load_model
    from sparsecache.wrapper.apply import Wrapper, shipped_wrapper

    m = load_model("qwen2.5-coder-0.5b")
    assert Wrapper.load(shipped_wrapper(m.fingerprint())).meta["recipe"]["questions"].startswith("specimen logs")
    assert_shipped_opt_in_wrapper(m)
