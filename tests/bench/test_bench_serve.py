"""`sparsecache bench serve` end to end at a toy size (#96 folded scripts/experiments/bench_serve.py into
the CLI): both real servers (vLLM's CPU build, the default model) started on a free 127.0.0.1 port one
after the other, a row per server, saved as it is made, a rerun skipping what is there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sparsecache.cli.main import cli
from sparsecache.errors import ConfigError
from support.corpora import encoded_docs

pytest.importorskip("vllm")
pytest.importorskip("openai")

DOCS = {"uuid.txt": "The uuid module follows RFC 4122 and makes universally unique identifiers.",
        "json.txt": "The json module reads and writes JSON, the format of RFC 8259.",
        "zlib.txt": "The zlib module compresses data with the deflate algorithm of RFC 1951."}


def test_settings_that_cannot_measure_are_refused_before_any_server_starts():
    from sparsecache.bench.serving import ServeBench

    for bad in ({"clients": (1, 2), "requests": (4,)}, {"clients": (4,), "requests": (2,)}, {"servers": ("tgi",)}):
        with pytest.raises(ConfigError):
            ServeBench(**bad)
    from sparsecache.bench.vllm_engine import VllmBench

    for bad, match in (({"sections": ("ttft", "speed")}, "--sections"), ({"sections": ("needle",)}, "--ruler"),
                       ({"sections": ("ttft",), "ks": (0,)}, ">= 1")):
        with pytest.raises(ConfigError, match=match):
            VllmBench(**bad)
    import os
    from unittest import mock

    with mock.patch.dict(os.environ):  # the command sets vLLM's engine variables for its own process
        r = CliRunner().invoke(cli, ["bench", "vllm", "--sections", "ttft"])  # no store named: one line, exit 1
    assert r.exit_code == 1 and "a store is needed" in r.output


def test_without_vllm_the_bench_commands_say_so_in_one_line(monkeypatch, tmp_path):
    import os
    from unittest import mock

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    for args in (["bench", "serve", str(tmp_path)], ["bench", "vllm", "--store", str(tmp_path), "--sections", "ttft"]):
        with mock.patch.dict(os.environ):
            r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and len(r.output.splitlines()) == 1 and "bash scripts/setup.sh vllm" in r.output


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The three documents encoded once with the default model, as a user's encode-corpus does."""
    root = tmp_path_factory.mktemp("bench-serve")
    encoded_docs(root, DOCS)
    return root


@pytest.mark.slow
def test_both_servers_answer_a_level_and_a_rerun_skips_it(demo, tmp_path):
    args = ["bench", "serve", str(demo / "store"), "--out", str(tmp_path / "serve.json"), "--clients", "1",
            "--requests", "2", "--max-tokens", "2", "--top-k", "2", "--plot", str(tmp_path / "serve.png"), "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output[-3000:]
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [(x["server"], x["clients"], x["requests"]) for x in result["rows"]] == [("sparsecache", 1, 2),
                                                                                  ("vllm", 1, 2)]
    assert all(x["ttft_p50_ms"] > 0 and x["requests_per_s"] > 0 for x in result["rows"])
    assert result["example"]["sparsecache"]["chunks"] and (tmp_path / "serve.png").stat().st_size > 0
    r = CliRunner().invoke(cli, args)  # every row is there: no server starts
    assert r.exit_code == 0 and len(json.loads((tmp_path / "serve.json").read_text())["rows"]) == 2
    with pytest.raises(ConfigError, match="too few"):
        from sparsecache.bench.serving import ServeBench, bench_serve

        bench_serve(demo / "store", tmp_path / "x.json", ServeBench(clients=(1,), requests=(9,)))


@pytest.mark.long  # ~90 s of one worker: CI proves the engine paths in test_vllm.py and stays under 30 min
def test_bench_vllm_times_the_connector_beside_vllms_own_prefill(demo, tmp_path):
    """`sparsecache bench vllm` (#96 folded scripts/experiments/bench_vllm.py into the CLI) at a toy size,
    in its own process as a user runs it: TTFT rows for vLLM's full prefill, its warm prefix cache, the
    connector's decoded codes and a blend, each against full prefill; a rerun skips what is there. Its
    --corpus is the store's own (nothing new to encode)."""
    out = tmp_path / "vllm.json"
    cmd = [sys.executable, "-m", "sparsecache.cli.main", "bench", "vllm", "--store", str(demo / "store"),
           "--corpus", str(demo / "corpus"), "--sections", "ttft", "--k", "1,2", "--repeats", "1",
           "--configs", "full,prefix-warm,none,infoflow:0.5", "--min-chunk-tokens", "1", "--max-model-len", "2048",
           "--out", str(out), "--plot", str(tmp_path / "vllm.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(out.read_text())["ttft"]
    assert [(x["k"], x["config"]) for x in rows] == [(k, c) for k in (1, 2)
                                                     for c in ("full", "prefix-warm", "none", "infoflow:0.5")]
    for x in rows:
        assert x["ttft_ms"] > 0 and (x["config"] != "full" or x["x_full"] == 1.0)
        assert x["injected_tokens"] > 0 if x["config"] in ("none", "infoflow:0.5") else x["injected_tokens"] == 0
    assert all(x["recomputed_tokens"] > 0 for x in rows if x["config"] == "infoflow:0.5")
    assert (tmp_path / "vllm.png").stat().st_size > 0
    r = subprocess.run(cmd[:-2] + ["--json"], capture_output=True, text=True, timeout=1200)  # nothing left to time
    assert r.returncode == 0 and len(json.loads(r.stdout)["ttft"]) == len(rows)
