"""`bench quality`: ratios counted by hand, memoised codes, and the command end to end (tiny model)."""

import json
import runpy

import pytest
import torch
from click.testing import CliRunner

from sparsecache.cli.main import cli
from sparsecache.bench.baselines import Kivi
from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import Dictionary
from sparsecache.bench.frontier import (Coder, FrontierConfig, Sparse, by_domain, default_choice, frontier_dictionary,
                                        pareto, ratios, series, targets, tie_band)
from support import REPO




class _Model:  # what `ratios` reads
    n_layers, m = 4, 32


def test_sparse_bytes_and_ratios_by_hand(tiny_dictionary):
    c = Coder(tiny_dictionary, "tiny")
    cfg = FrontierConfig(prefix_tokens=100, corpus_tokens=10_000)
    # 512 atoms → 9-bit indices; s = 4: 5 bytes of indices + 8 bytes of fp16 coefficients per signal
    r = ratios(Sparse(c, c), _Model, cfg)
    assert r["bytes_per_token"] == 2 * 4 * 13
    assert r["ratio"] == pytest.approx((2 * 32) / 13)
    raw_corpus = 2 * 2 * 4 * 32 * 10_000
    assert r["ratio_total"] == pytest.approx(raw_corpus / (10_000 * 2 * 4 * 13 + 2 * 32 * 512 * 4))
    assert ratios(Sparse(c, c, "float8"), _Model, cfg)["bytes_per_token"] == 2 * 4 * (5 + 4)
    with pytest.raises(ValueError, match="measured"):  # Rice sizes come from real codes only
        ratios(Sparse(c, c, "float16", "rice"), _Model, cfg)
    rice = Sparse(c, c, "float16", "rice", {"k": 6.0, "v": 7.0})
    assert ratios(rice, _Model, cfg)["bytes_per_token"] == 4 * (4 * 6 / 8 + 8) + 4 * (4 * 7 / 8 + 8)
    assert series(rice) == "sparsecache float16 + Rice" and series(Kivi(2)) == "KIVI"
    assert rice.label == "L1-s4+rice" and Sparse(c, c, "int8").label == "L1-s4-int8"
    ef = Sparse(c, c, "float8", "elias-fano")  # 4 of 512 atoms: 7 low bits + 4 + 3 upper bits each → 5 bytes
    assert ratios(ef, _Model, cfg)["bytes_per_token"] == 2 * 4 * (5 + 4)
    assert ef.label == "L1-s4-fp8+ef" and series(ef) == "sparsecache float8 + Elias–Fano"


def test_coder_memoises_and_counts_rice(tiny_dictionary):
    c = Coder(tiny_dictionary, "tiny")
    x = torch.randn(4, 20, 32)
    a = c.roundtrip(x, "k", "float16")
    assert c.rice["k"][1] == 4 * 20 * 4
    b = c.roundtrip(x, "k", "float8")  # same codes, other coefficient format: no new encode
    assert c.rice["k"][1] == 4 * 20 * 4
    assert a.shape == x.shape and not torch.equal(a, b)
    assert 0 < c.rice_bits_per_index("k") < 12
    assert ((a - x).square().sum() < x.square().sum())  # a code, not noise


@pytest.mark.parametrize("coef", ["float16", "float8"])
def test_coder_measures_what_a_store_reader_gets(tiny_dictionary, coef):
    """bench quality's roundtrip is the store codec's, per-layer scales included."""
    d = tiny_dictionary
    scaled = Dictionary(d.keys, d.values, d.config, d.model,
                        scales={k: torch.tensor([4.0, 1.0, 0.5, 2.0]) for k in "kv"})
    x = torch.randn(4, 12, 32)
    for kind in "kv":
        torch.testing.assert_close(Coder(scaled, "scaled").roundtrip(x, kind, coef),
                                   Codec(scaled, coef).roundtrip(x, kind), rtol=1e-4, atol=1e-5)


def test_the_default_model_measures_the_shipped_dictionaries():
    """For the default model `bench quality` uses the repository's dictionaries, not ones it
    learns (it once looked under sparsecache/, found none and silently learned its own)."""
    from sparsecache.codec.dictionary import MODEL_DICTIONARIES

    shipped = [p for p in (REPO / "dictionaries").iterdir()  # the default model's
               if (p / "dictionary.json").exists() and p.name not in MODEL_DICTIONARIES]
    assert shipped  # the default's (the others left the tree in #96: dictionaries/README.md)
    model = type("Default", (), {"name": "SmolLM2-135M-Instruct"})()
    for path in shipped:
        config = json.loads((path / "dictionary.json").read_text())
        d, source = frontier_dictionary(model, config["layers_per_signal"], config["sparsity"], learn_steps=0)
        assert source == f"shipped ({path.name})" and d.config.sparsity == config["sparsity"]


def test_bench_quality_end_to_end_on_tiny_model(tiny_model_dir, tmp_path):
    args = ["bench", "quality", "--model", str(tiny_model_dir), "--config", "1,4", "--config", "2,4",
            "--atoms", "64", "--learn-steps", "2", "--passages", "2", "--prefix-tokens", "48",
            "--continuation-tokens", "8", "--trials", "2", "--needle-chunks", "2", "--needle-chunk-tokens", "40",
            "--corpus-tokens", "1000", "--plot", str(tmp_path / "f.png"), "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    labels = {row["method"] for row in out["rows"]}
    assert {"fp16", "kivi-int2", "svd-r8", "xkv4-r16", "L1-s4", "L2-s4-fp8+rice", "L2-s4-fp8+ef", "L1-s4-int8"} <= labels
    fp16 = next(row for row in out["rows"] if row["method"] == "fp16")
    assert fp16["ratio"] == 1 and fp16["top1_agreement"] > 0.99 and fp16["nmse_k"] < 1e-5
    for row in out["rows"]:
        assert 0 <= row["top1_agreement"] <= 1 and set(row["needle"]) == {"none", "infoflow"}
        assert row["ratio_total"] <= row["ratio"] + 1e-9
    assert (tmp_path / "f.png").stat().st_size > 10_000
    again = CliRunner().invoke(cli, args)  # every method cached now
    assert again.exit_code == 0 and "evaluating 0" in again.stderr
    text = CliRunner().invoke(cli, [a for a in args if a != "--json"])  # the same, as the printed table
    assert text.exit_code == 0 and "L2-s4-fp8+ef" in text.stdout and "dominated by" in text.stdout
    assert json.loads(again.stdout)["rows"] == out["rows"]
    quick = CliRunner().invoke(cli, [*args[:4], "--config", "1,2", *args[4:], "--skip-needles"])
    assert quick.exit_code == 0 and "needle trials skipped for 3 methods" in quick.stderr, quick.output
    rows = {row["method"]: row for row in json.loads(quick.stdout)["rows"]}
    assert rows["L1-s2"]["needle"] is None and 0 <= rows["L1-s2"]["top1_agreement"] <= 1
    assert rows["L1-s4"]["needle"] == next(r for r in out["rows"] if r["method"] == "L1-s4")["needle"]
    # BENCHMARKS' table: one line per quality, its three index codings side by side, "not run" for skipped needles
    table = runpy.run_path(str(REPO / "docs" / "tables" / "frontier_table.py"))["table"](json.loads(quick.stdout))
    line = next(x for x in table.splitlines() if x.startswith("| L2-s4-fp8 |"))
    ef = rows["L2-s4-fp8+ef"]
    assert ef["quality"] == "L2-s4-fp8" and ef["index"] == "elias-fano" and f"{ef['ratio_total']:.2f}×" in line
    assert "| L2-s4-fp8+ef |" not in table and "| *fp16* | 1.00× |" in table
    assert next(x for x in table.splitlines() if x.startswith("| L1-s2 |")).endswith("| not run | not run |")
    # every --text is a domain: rows carry each domain's report and the worst domain's figures
    other = tmp_path / "other.txt"
    other.write_text("Der Paketmanager installiert Abhängigkeiten automatisch und prüft Signaturen. " * 60)
    domains = CliRunner().invoke(cli, [*args[:4], "--text", "builtin", "--text", str(other), *args[4:-3],
                                       "--no-baselines", "--skip-needles", "--json"])
    assert domains.exit_code == 0, domains.output
    row = next(r for r in json.loads(domains.stdout)["rows"] if r["method"] == "L1-s4")
    assert set(row["domains"]) == {"builtin", "other.txt"}
    assert row["worst_top1"] == min(d["top1_agreement"] for d in row["domains"].values()) <= row["top1_agreement"]
    worst = runpy.run_path(str(REPO / "docs" / "tables" / "frontier_table.py"))["table"](json.loads(domains.stdout))
    assert "| worst domain | its top-1 | worst ppl | worst layer NMSE K / V |" in worst
    assert "needle" not in worst  # no row has needle trials: no empty columns
    assert f"| {row['worst_domain']} | {100 * row['worst_top1']:.1f}% |" in worst


def _row(method, family, ratio, top1, ppl, needle, index=None):
    return {"method": method, "family": family, "index": index, "ratio_total": ratio, "top1_agreement": top1,
            "ppl_exact": 10.0, "ppl_reconstructed": 10.0 * (1 + ppl), "needle": {"none": needle, "infoflow": needle}}


def test_targets_are_checked_not_assumed():
    rows = [_row("fp16", "fp16", 1, 1.0, 0, 0.8), _row("kivi-int4", "kivi", 3.2, 0.97, 0.01, 0.8),
            _row("kivi-int2", "kivi", 5.3, 0.80, 0.2, 0.5), _row("xkv4-r32", "xkv", 9.2, 0.7, 0.4, 0.2),
            _row("svd-r8", "svd", 17, 0.6, 1.0, 0.0),
            _row("L1-s32", "sparsecache", 3.3, 0.955, 0.01, 0.8), _row("L1-s16+ef", "sparsecache", 10.1, 0.9, 0.05, 0.75, "elias-fano"),
            _row("L1-s16+rice", "sparsecache", 10.4, 0.9, 0.05, 0.75, "rice"),  # a bound: no store writes it
            {**_row("L1-s16-int8+ef", "sparsecache", 18, 0.99, 0.0, 0.8, "elias-fano"), "storable": False},
            {**_row("L1-k8v16-fp8+ef", "sparsecache", 18, 0.99, 0.0, 0.8, "elias-fano"), "storable": False},
            _row("L1-s64", "sparsecache", 1.9, 0.968, 0.01, 0.8)]
    t = targets({"rows": rows, "config": {"fusion": "infoflow"}})
    assert [d["dominated_by"] for d in t["dominance"]] == [["L1-s16+ef"], ["L1-s16+ef"], []]
    assert not t["dominance_met"]  # nothing of ours reaches svd-r8's 17x
    assert t["high"]["method"] == "L1-s16+ef" and t["high"]["met"]  # 0.75 / 0.8 ≥ 0.9
    low = t["low"]  # within 1 point only at a lower ratio than int4's: not met
    assert low["equal_ratio"]["method"] == "L1-s32" and low["equal_ratio"]["gap_points"] == pytest.approx(-1.5)
    assert low["any_ratio"]["method"] == "L1-s64" and low["any_ratio"]["gap_points"] == pytest.approx(-0.2)
    assert not low["met"]


def test_pareto_keeps_only_undominated_points_by_ratio():
    pts = [(2, 0.9), (4, 0.95), (8, 0.7), (8, 0.8), (16, 0.5), (3, 0.6), (16, 0.5)]
    assert pareto(pts) == [(4, 0.95), (8, 0.8), (16, 0.5)]
    assert pareto([]) == []


def test_domains_are_averaged_and_the_worst_is_kept():
    def report(top1, ppl, layer_v):
        return {"nmse_k": 0.1, "nmse_v": 0.2, "kl": 0.1, "top1_agreement": top1, "ppl_exact": 10.0,
                "ppl_reconstructed": 10.0 * (1 + ppl), "nmse_k_per_layer": [0.1, 0.1], "nmse_v_per_layer": [layer_v, 0.2]}

    r = by_domain({"docs": report(0.9, 0.05, 0.3), "german": report(0.7, 0.40, 2.6)})
    assert r["worst_domain"] == "german" and r["worst_top1"] == 0.7 and r["top1_agreement"] == pytest.approx(0.8)
    assert r["worst_ppl"] == pytest.approx(0.40) and r["worst_layer_nmse_v"] == 2.6
    assert r["ppl_reconstructed"] == pytest.approx(10 * (1.05 * 1.40) ** 0.5)  # geometric mean
    assert r["nmse_v_per_layer"] == pytest.approx([1.45, 0.2])


def test_the_default_is_chosen_on_the_worst_domain_at_20x():
    def row(method, ratio, top1, worst_top1, worst_ppl, layer_v):
        return {**_row(method, "sparsecache", ratio, top1, 0.05, 0.8), "worst_top1": worst_top1,
                "worst_ppl": worst_ppl, "worst_layer_nmse_v": layer_v}

    rows = [row("L1-s32", 3.3, 0.95, 0.93, 0.03, 0.1),  # best, but below 20x
            row("L5-s32", 24.9, 0.88, 0.71, 0.37, 2.6),  # better on average ...
            row("L5-s32-new", 24.9, 0.87, 0.86, 0.09, 0.5)]  # ... this one on its worst domain
    pick = default_choice(rows)
    assert pick["method"] == "L5-s32-new" and pick["met"]
    # int8 coefficients and mixed K/V sparsity are measured, but no store writes them
    unstorable = {**row("L5-s32-int8+ef", 24.2, 0.9, 0.9, 0.05, 0.3), "storable": False}
    assert targets({"rows": [*rows, unstorable], "config": {"fusion": "infoflow"}})["default"]["method"] == "L5-s32-new"
    assert not default_choice(rows[:2])["met"] and default_choice(rows[:1]) is None


def test_a_worst_domain_gap_inside_one_standard_error_is_a_tie_the_mean_breaks():
    def row(method, top1, worst_top1, tokens=None):
        r = {**_row(method, "sparsecache", 24.0, top1, 0.1, 0.8), "worst_top1": worst_top1, "worst_ppl": 0.1,
             "worst_layer_nmse_v": 0.3, "worst_domain": "licences"}
        return {**r, "domains": {"licences": {"scored_tokens": tokens}}} if tokens else r

    # 252 scored tokens at 81%: one standard error is 2.5 points, so 3 tokens (1.2 points) are a tie
    leader, close, far = row("s32", 0.867, 0.810, 252), row("s40", 0.871, 0.798, 252), row("L3", 0.90, 0.75, 252)
    assert tie_band(0.81, 252) == pytest.approx(0.0247, abs=1e-4)
    pick = default_choice([leader, close, far])
    assert pick["method"] == "s40" and pick["leader"] == "s32" and pick["tied"] == ["s32", "s40"]
    # the same gap over 5,000 tokens is outside the band: the worst domain decides
    assert default_choice([row("s32", 0.867, 0.810, 5000), row("s40", 0.871, 0.798, 5000)])["method"] == "s32"
    # results without token counts take them from the caller (passages x scored tokens each)
    assert default_choice([row("s32", 0.867, 0.810), row("s40", 0.871, 0.798)], 252)["method"] == "s40"
    assert default_choice([row("s32", 0.867, 0.810), row("s40", 0.871, 0.798)])["method"] == "s32"


def test_bench_quality_compares_given_dictionaries(tiny_model_dir, tiny_dictionary_dir, tmp_path):
    """--dict: a model without shipped dictionaries compares the ones learned for it, each as
    the configuration of its own L and s, with nothing learned."""
    args = ["bench", "quality", "--model", str(tiny_model_dir), "--dict", str(tiny_dictionary_dir), "--no-baselines",
            "--skip-needles", "--passages", "1", "--prefix-tokens", "48", "--continuation-tokens", "8", "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {row["method"] for row in out["rows"]} >= {"L1-s4", "L1-s4-fp8+ef"}
    assert out["dictionaries"] == {"L1-s4": f"given ({tiny_dictionary_dir})"}
    twice = CliRunner().invoke(cli, [*args, "--dict", str(tiny_dictionary_dir)])
    assert twice.exit_code == 1 and "two dictionaries for L1-s4" in twice.output and "Traceback" not in twice.output
