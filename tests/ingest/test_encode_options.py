"""One shape per encode (#96 item 2): `EncodeOptions` travels from the CLI to the run, compatibility is
checked once where the run starts, and the progress bar costs no second tokenisation."""

from __future__ import annotations

import ast

import pytest

from sparsecache.errors import DictionaryMismatch
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import BarSize, ModelLoader, encode_with
from sparsecache.store import StoreConfig, versions
from sparsecache.text.corpus import Source
from support import REPO

INGEST = REPO / "sparsecache" / "ingest"


def test_no_encode_function_takes_more_than_eight_parameters():
    wide = []
    for path in INGEST.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > 8:
                    wide.append(f"{path.name}:{node.name} ({len(names)})")
    assert wide == []


def test_the_cli_hands_the_encode_its_options_whole(monkeypatch, corpus_dir, tmp_path, tiny_model_dir,
                                                     tiny_dictionary_dir):
    """What `encode-corpus` parsed is what the run sees: one EncodeOptions, the device resolved."""
    from click.testing import CliRunner

    import sparsecache.ingest.encoder as encoder
    from sparsecache.cli.main import cli

    seen = []
    real = encoder.encode_with

    def spy(corpus, store, dictionary, model, config, options, **kw):
        seen.append((model, options))
        return real(corpus, store, dictionary, model, config, options, **kw)

    monkeypatch.setattr(encoder, "encode_with", spy)
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus_dir), "--store", str(tmp_path / "s"), "--model",
                                 str(tiny_model_dir), "--dict", str(tiny_dictionary_dir), "--chunk-tokens", "64",
                                 "--batch-tokens", "300", "--keep", "2", "--exact-omp"])
    assert r.exit_code == 0, r.output
    (model, options), = seen
    assert isinstance(model, ModelLoader) and model.options is options
    assert options.batch_tokens == 300 and options.keep == 2 and options.exact_omp and options.device == "cpu"
    assert options.chunk_tokens == 64 and options.model == str(tiny_model_dir)


def test_a_wrong_model_is_refused_even_when_there_is_nothing_to_encode(corpus_dir, tmp_path, tiny_model,
                                                                        tiny_dictionary, embedder):
    """The one check at the run's start compares the model's fingerprint with the dictionary's and the
    store's, from the model's config alone: an idle rerun with another model is refused, not silently
    accepted until the corpus changes."""
    store, opts = tmp_path / "s", EncodeOptions(progress=False)
    encode_with([str(corpus_dir)], store, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64), opts,
                embedder=embedder)

    class Other:  # a loader of another model, never called: its fingerprint is enough to refuse it
        def fingerprint(self):
            return {**tiny_model.fingerprint(), "config_hash": "another"}

        def __call__(self):
            pytest.fail("the model was loaded")

    with pytest.raises(DictionaryMismatch):
        encode_with([str(corpus_dir)], store, tiny_dictionary, Other(), StoreConfig(chunk_tokens=64), opts)
    assert versions(store) == [1, 2]


def test_the_progress_bar_costs_no_tokenisation(monkeypatch, corpus_dir, tmp_path, tiny_model, tiny_dictionary,
                                                embedder):
    """With the bar on, the tokenizer runs exactly as often as with it off (it once tokenised the whole
    corpus a second time to size the bar)."""
    tok = type(tiny_model.tokenizer)
    calls = {"n": 0}
    real = tok.__call__

    def counted(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(tok, "__call__", counted)
    counts = []
    for progress in (False, True):
        calls["n"] = 0
        encode_with([str(corpus_dir)], tmp_path / f"s{progress}", tiny_dictionary, tiny_model,
                    StoreConfig(chunk_tokens=64), EncodeOptions(progress=progress), embedder=embedder)
        counts.append(calls["n"])
    assert counts[0] == counts[1] > 0


def test_the_bar_is_sized_by_bytes_then_by_the_rate_seen():
    docs = [Source(f"d{i}", "h", text="x" * 400) for i in range(4)]
    size = BarSize(docs)
    assert size.total(0) == round(1600 * BarSize.TOKENS_PER_BYTE)
    size.finished(docs[:2], 400)  # 800 bytes made 400 tokens: half a token a byte
    assert size.total(450) == 450 + 400  # 50 tokens of an unfinished document on the bar already
    size.finished(docs[2:], 200)  # the rate is of finished documents: 600 tokens of 1,600 bytes
    assert size.rate == 600 / 1600 and size.total(600) == 600
