"""`sparsecache query` through the CLI on a tiny store."""

from __future__ import annotations

import json

from click.testing import CliRunner

from sparsecache.cli.main import cli


def test_query_json_and_text(corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    store = tmp_path / "store"
    run = CliRunner().invoke
    r = run(cli, ["encode-corpus", str(corpus_dir), "--store", str(store), "--model", str(tiny_model_dir),
                  "--dict", str(tiny_dictionary_dir), "--chunk-tokens", "64"])
    assert r.exit_code == 0, r.output
    base = ["query", str(store), "What does the global statement do?", "--model", str(tiny_model_dir),
            "--max-new-tokens", "3", "--device", "cpu"]
    r = run(cli, base + ["--top-k", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) >= {"answer", "chunks", "timings_ms", "recomputed_tokens", "bytes_read"}
    assert len(out["chunks"]) == 3 and out["chunks"][0]["doc_id"] == "global.txt"
    t = out["timings_ms"]
    steps = ("retrieve", "read", "transfer", "reconstruct", "select", "recompute", "prefill", "first_token")
    assert abs(t["ttft"] - sum(t[s] for s in steps)) < 0.01 and out["recomputed_tokens"] > 0
    assert out["bytes_read"] > 0
    # the default (infoflow) keeps every retrieved chunk: --compare prefills the same context
    assert out["method"] == "infoflow" and len(out["context_ids"]) == 3
    r = run(cli, base + ["--top-k", "3", "--compare", "--json"])
    ref = json.loads(r.stdout)["full_prefill"]
    assert ref["context_tokens"] == out["context_tokens"]
    # superposition (2 paths) drops a chunk: --compare reads all three, and the text says which
    r = run(cli, base + ["--top-k", "3", "--method", "superposition", "--compare", "--json"])
    sup = json.loads(r.stdout)
    assert sup["method"] == "superposition" and len(sup["context_ids"]) == 2
    assert sup["full_prefill"]["context_tokens"] > sup["context_tokens"]
    r = run(cli, base + ["--top-k", "3", "--method", "superposition"])
    assert r.output.count("(not used: its path scored lower)") == 1, r.output

    ids = ",".join(c["id"] for c in out["chunks"][:2])
    r = run(cli, base + ["--chunks", ids, "--method", "full"])
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "(full," in r.output and "0 recomputed" in r.output
    r = run(cli, base + ["--chunks", ids, "--method", "full", "--compare", "--json"])  # full against itself
    ref = json.loads(r.stdout)["full_prefill"]
    assert ref["same_answer"] is True and ref["answer"] == json.loads(r.stdout)["answer"]
    assert ref["token_agreement"] == 1.0  # full prefill predicts its own greedy answer
    r = run(cli, base + ["--chunks", ids, "--method", "none", "--compare"])
    assert r.exit_code == 0 and "full prefill of the same chunks" in r.output
    assert "same answer as full prefill: yes" in r.output or "same answer as full prefill: no" in r.output
    assert "next tokens agree" in r.output

    # a context under --prefill-under is prefilled, and the output says so (the rule: tests/query/test_cheap.py)
    r = run(cli, base + ["--chunks", ids, "--method", "none", "--prefill-under", "100000"])
    assert r.exit_code == 0 and "(full," in r.output and "prefilled: the retrieved chunks hold fewer than 100000" \
        in r.output, r.output
    r = run(cli, base + ["--chunks", ids, "--method", "none", "--prefill-under", "100000", "--json"])
    assert json.loads(r.stdout)["method"] == "full" and json.loads(r.stdout)["prefilled_under"] == 100000

    # the levers' options reach the method they belong to
    r = run(cli, base + ["--chunks", ids, "--method", "superposition", "--paths", "1", "--recompute-ratio", "0",
                         "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["context_ids"]) == 1 and json.loads(r.stdout)["recomputed_tokens"] == 0
    r = run(cli, base + ["--chunks", ids, "--method", "none", "--paths", "2"])
    assert r.exit_code == 1 and "--paths applies to --method superposition" in r.output

    r = run(cli, base + ["--chunks", "nope"])
    assert r.exit_code == 1 and "no live chunk 'nope'" in r.output
    r = run(cli, base + ["--recompute-ratio", "2"])
    assert r.exit_code == 1 and "--recompute-ratio must be in [0, 1]" in r.output
    r = run(cli, ["query", str(store), "q", "--device", "cpu"])  # the default model is not the tiny one
    assert r.exit_code == 1 and "was encoded with model" in r.output and "pass that model with --model" in r.output


def test_a_bug_keeps_its_traceback_and_a_library_error_is_one_line(tmp_path, monkeypatch):
    """The error boundary turns the library's own errors into one line, never a real bug:
    a bare ValueError from inside the library must reach the user with its traceback."""
    import sparsecache.query.session as session
    from sparsecache.errors import StoreError

    def broken(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(session, "Session", broken)
    r = CliRunner().invoke(cli, ["query", str(tmp_path), "q", "--device", "cpu"])
    assert isinstance(r.exception, ValueError) and r.exit_code != 0
    assert r.exc_info[2] is not None and "an internal invariant broke" in str(r.exception)

    def refused(*args, **kwargs):
        raise StoreError("no store here")

    monkeypatch.setattr(session, "Session", refused)
    r = CliRunner().invoke(cli, ["query", str(tmp_path), "q", "--device", "cpu"])
    assert r.exit_code == 1 and r.output.strip() == "Error: no store here"


def test_help_does_not_import_torch():
    """`sparsecache --help` is instant: the CLI imports torch and transformers only in the
    command that needs them."""
    import subprocess
    import sys

    code = "import sys, sparsecache.cli.main; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_compare_states_the_ttft_ratio_the_right_way_round():
    from sparsecache.cli.query import ttft_ratio

    assert ttft_ratio(100.0, 330.0) == "TTFT 3.3x lower than full prefill"
    assert ttft_ratio(330.0, 100.0) == "TTFT 3.3x higher than full prefill (slower)"  # printed "0.3x lower" before
    assert ttft_ratio(0.0, 100.0) == ""
