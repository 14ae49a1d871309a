"""`sparsecache bench shapes`: TTFT by model shape, random weights, at a toy size on the CPU."""

import json

import pytest

from click.testing import CliRunner

from sparsecache.cli.main import cli


def test_a_toy_shape_is_timed_beside_the_machines_limits(tmp_path):
    work = tmp_path / "shapes"
    r = CliRunner().invoke(cli, ["bench", "shapes", "--shape", "toy", "--k", "2,3", "--repeats", "1",
                                 "--workdir", str(work), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    (out,) = json.loads(r.stdout)
    assert out["weights"] == "random" and "only time" in out["note"]
    assert out["store_bytes_per_token"] > 0 and out["ratio_vs_fp16"] == out["fp16_kv_bytes_per_token"] / out[
        "store_bytes_per_token"]
    assert out["gemm_flops_per_s"] > 0 and out["copy_bytes_per_s"] > 0
    methods = {(x["method"], x["ratio"]) for x in out["rows"]}
    assert methods == {("full", 0.0), ("none", 0.0), ("infoflow", 0.1), ("infoflow", 0.25)}
    assert {x["k"] for x in out["rows"]} == {2, 3}
    for x in out["rows"]:
        assert x["ttft"] > 0 and x["context_tokens"] >= 2 * 480
        if x["method"] == "full":
            assert 0 < x["prefill_of_peak"]
        else:
            assert x["decode_bytes_per_s"] > 0 and x["decode_of_copy_bandwidth"] > 0
            assert (x["recomputed_tokens"] > 0) == (x["method"] == "infoflow")
            assert x["first_token_ms_per_layer"] > 0  # the fixed passes per layer (#95 item 2's before and after)
            if x["method"] == "infoflow":
                assert x["select_ms_per_layer"] > 0 and x["recompute_ms_per_layer"] > 0
    assert len(out["fractions"]) == 6 and all(f["of_full"] > 0 for f in out["fractions"])
    assert set(out["crossover_tokens"]) == {"none:0.0", "infoflow:0.1", "infoflow:0.25"}
    costs = out["costs"]  # the TTFT cost model fitted to these rows, and what it predicts for each
    # a busy machine can time k = 3 no slower than k = 2, so only what holds under any load is asserted:
    # a fit with no negative constant, and the shipped CPU constants, scaled, beside it
    assert all(v >= 0 for v in costs["fitted"].values()) and costs["defaults"] is not None
    assert len(costs["predictions"]) == 6 and all(x["fitted_ms"] is not None for x in costs["predictions"])
    assert json.loads((work / "results.json").read_text())[0]["shape"] == "toy"
    # a rerun reuses the shape's store (the encode report is the first run's), replaces the shapes it names in
    # results.json and keeps the others: shapes can be run one per invocation
    other = {**out, "shape": "another"}
    (work / "results.json").write_text(json.dumps([other, out]))
    # (and with --cuda-graphs the store's methods run again with their fixed passes on a graph workspace:
    # off CUDA uncaptured, which is the path a GPU captures; on a CPU by default not at all)
    assert "graphed" not in out
    again = CliRunner().invoke(cli, ["bench", "shapes", "--shape", "toy", "--k", "2", "--repeats", "1",
                                     "--workdir", str(work), "--cuda-graphs", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)[0]["encode"] == out["encode"]
    graphed = json.loads(again.stdout)[0]["graphed"]
    # two queries per method (warm-up, timed): none one pass (the question's), infoflow two (scoring, recompute)
    assert graphed["captured"] == graphed["replays"] == 0 and graphed["passes"] == 2 * (1 + 2 + 2)
    assert {(x["method"], x["ratio"]) for x in graphed["rows"]} == methods - {("full", 0.0)}
    assert all(x["of_full"] > 0 and x["first_token_ms_per_layer"] > 0 for x in graphed["rows"])
    saved = json.loads((work / "results.json").read_text())
    assert [r["shape"] for r in saved] == ["another", "toy"] and {x["k"] for x in saved[1]["rows"]} == {2}
    # a GPU's decodes (the gather, the dense and CSR products, the Triton kernel), timed side by side: here on
    # the CPU, where Triton's kernel cannot run outside its interpreter and says why
    from sparsecache.bench.shapes import time_decodes

    ways = time_decodes(work / "toy" / "store", "cpu", 2, repeats=1, copy=out["copy_bytes_per_s"])
    assert ways["tokens"] >= 2 * 480
    for way in ("gather", "dense", "csr"):
        assert ways[f"{way}_ms"] > 0 and ways[f"{way}_bytes_per_s"] > 0 and ways[f"{way}_of_copy_bandwidth"] > 0
    assert ways["dense_max_rel_diff"] < 1e-2 and ways["csr_max_rel_diff"] < 1e-2
    assert ("triton_ms" in ways) != ("triton_error" in ways)
    assert ways["fastest"] in ("gather", "dense", "csr", "triton")


def test_an_unknown_shape_is_refused_with_the_names_there_are(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "shapes", "--shape", "llama-70b", "--workdir", str(tmp_path)])
    assert r.exit_code != 0
    assert "unknown llama-70b" in r.output and "llama-3.2-1b" in r.output and "qwen2.5-coder-0.5b" in r.output


def test_the_crossover_follows_full_prefills_parabola_not_a_line():
    """Rows timed at long contexts only: lines through them would cross far too late (full prefill's
    attention bends its curve up); the cost model's parabola puts the crossover where the truth has it."""
    from sparsecache.bench.shapes import crossover
    from sparsecache.query.budget import Costs

    truth = Costs(a_full=40.0, p=2.0, a_store=150.0, s=0.5, q=2e-4, g=1.0)
    lengths = (1000, 2000, 4000, 8000)
    rows = [{"method": "full", "ratio": 0.0, "context_tokens": n, "ttft": truth.full(n)} for n in lengths]
    rows += [{"method": "infoflow", "ratio": r, "context_tokens": n, "ttft": truth.store(n, r)}
             for n in lengths for r in (0.1, 0.25)]
    fitted = Costs.fit([(x["context_tokens"], x["ttft"]) for x in rows if x["method"] == "full"],
                       [(x["context_tokens"], x["ratio"], x["ttft"]) for x in rows if x["method"] == "infoflow"])
    # store(n, 0.1) = full(n): 0.9 (2n + 2e-4 n^2) - 0.5 n = 110 -> n ~ 84
    assert crossover(rows, "infoflow", 0.1, fitted) == pytest.approx(84, abs=2)
    assert crossover(rows, "infoflow", 0.1, None) is None
    # recomputing everything, plus a fixed and a per-token cost of its own: never cheaper than full prefill
    whole = [{"method": "cacheblend", "ratio": 1.0, "context_tokens": n, "ttft": truth.full(n) + 100 + 0.3 * n}
             for n in lengths]
    assert crossover(whole, "cacheblend", 1.0, fitted) is None
