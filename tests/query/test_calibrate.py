"""`sparsecache calibrate`: a choice measured on the store's own text, recorded with a version,
used by `query`/`Session`/`serve` unless a method is named, per kind of device; the errors; the
calibration carried over publishes, pruned with its version, safe at every failpoint, and
invisible to a reader of the release before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparsecache.query.calibrate import CalibrateConfig, choose, grid, parse_candidates, record_of, summary_line
from sparsecache.query.config import QueryConfig
from sparsecache.cli.main import cli
from sparsecache.errors import ConfigError

TOWNS = ("Velmora", "Astrid", "Bellhaven", "Corvin", "Dunmere", "Elsing", "Farrow", "Gildemoor")


def town(name: str, i: int) -> str:
    return (f"The harbour town of {name} was founded in {1700 + 13 * i} by fishermen from the north. "
            f"Today the old town of {name} has {20 + i} stone bridges over its two rivers. "
            f"Every summer the people of {name} hold a market that lasts {11 + i} days. "
            f"The council of {name} keeps its records in the module town_{name.lower()}_records since then.")


@pytest.fixture(scope="module")
def tiny_store(tiny_model_dir, tiny_dictionary_dir, tmp_path_factory):
    """A plain store of eight town documents (four cloze sentences each), by the tiny model: no wrapper, each
    chunk after the prefix alone (format 4, which the release before calibrate reads)."""
    root = tmp_path_factory.mktemp("calibrate")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, name in enumerate(TOWNS):
        (corpus / f"{name.lower()}.txt").write_text(town(name, i))
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus), "--store", str(root / "store"), "--model",
                                 str(tiny_model_dir), "--dict", str(tiny_dictionary_dir), "--chunk-tokens", "48",
                                 "--wrapper", "none", "--encode-after", "prefix"])
    assert r.exit_code == 0, r.output
    return root


def copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def calibrate_args(store, tiny_model_dir, *more) -> list[str]:
    return ["calibrate", str(store), "--model", str(tiny_model_dir), "--device", "cpu", "--questions", "6",
            "--timing-questions", "1", *more]


def row(label, ratio, within=True, kept=None, exact=False, target=0.9):
    out = {"label": label, "ttft_vs_full": ratio, "within_budget": within, "exact": exact}
    if exact:
        out |= {"kept": 1.0, "kept_ci95": (1.0, 1.0), "meets_target": True}
    elif kept is not None:
        out |= {"kept": kept[0], "kept_ci95": kept[1:], "meets_target": kept[1] >= target}
    else:
        out["meets_target"] = False
    return out


def test_the_choice_is_the_cheapest_whose_lower_bound_meets_the_target():
    rows = [row("none", 0.2, kept=(0.5, 0.4, 0.6)), row("infoflow:0.1", 0.35, kept=(0.98, 0.92, 1.0)),
            row("infoflow:0.25", 0.45, kept=(1.0, 0.95, 1.0)), row("full", 1.0, within=False, exact=True)]
    assert choose(rows) == ("infoflow:0.1", "infoflow:0.1") and rows[1]["chosen"] and not rows[2]["chosen"]
    # nothing meets it within the budget: no choice, and the best is the highest lower bound
    rows = [row("none", 0.2, kept=(0.5, 0.4, 0.6)), row("infoflow:0.1", 0.35, kept=(0.9, 0.8, 0.95)),
            row("infoflow:0.5", 0.7, within=False, kept=(1.0, 0.96, 1.0)), row("full", 1.0, within=False, exact=True)]
    assert choose(rows) == (None, "infoflow:0.1")
    # with a budget that admits it, full prefill (exact) meets any target
    rows = [row("none", 0.2, kept=(0.5, 0.4, 0.6)), row("full", 1.0, exact=True)]
    assert choose(rows) == ("full", "full")


def test_the_outcome_says_how_many_confident_questions_a_target_takes():
    result = {"questions": 100, "confident": 40, "full_ttft_ms": 2000.0, "machine": "cpu x", "device": "cpu",
              "met": False, "best": "infoflow:0.1", "target": 0.95, "ttft_budget": 0.5}
    line = summary_line(result)
    assert "at least 73 confident questions" in line and "best: infoflow:0.1" in line and "\n" not in line


def test_a_candidate_stops_only_once_it_cannot_reach_the_target():
    from sparsecache.query.calibrate import can_reach

    assert can_reach(10, 63, 73, 0.95)  # 73 of 73 would still reach 0.95
    assert not can_reach(9, 63, 73, 0.95)  # one lost: 72 of 73 cannot
    assert not can_reach(20, 30, 50, 0.95)  # 50 confident questions cannot reach 0.95 at all
    assert can_reach(20, 15, 35, 0.9) and not can_reach(19, 15, 35, 0.9)


def test_the_grid_holds_servable_methods_and_exact_ones():
    labels = [c.label for c in grid(wrapped=False)]
    assert labels[0] == "full" and "none" in labels and "infoflow:0.1" in labels and "cacheblend:0.15" in labels
    assert not any(x.startswith(("superposition", "cake", "raw")) for x in labels)  # not servable by the connector
    assert not any(x.startswith(("chunkflow", "legolink")) for x in labels)  # #94's levers: by --candidates only
    assert [c.label for c in parse_candidates("chunkflow:0.25", wrapped=True)] == ["full", "chunkflow:0.25"]
    assert [c.label for c in grid(wrapped=False) if c.exact] == ["full", "infoflow:1"]
    assert [c.label for c in grid(wrapped=True) if c.exact] == ["full"]  # a wrapper's header: not full prefill's
    # what an uncalibrated query does (the default method at the default TTFT budget) is a candidate too
    budget = [c for c in grid(wrapped=True) if "ttft_budget" in c.settings]
    assert [(c.label, c.settings) for c in budget] == [
        ("infoflow+ttft_budget=0.5", {"method": "infoflow", "ttft_budget": QueryConfig.ttft_budget})]
    # a recomputing method named without a ratio runs at the default budget, and its settings say so
    parsed = {c.label: c.settings for c in parse_candidates("none,infoflow+score_layer=3,cacheblend:0.2", wrapped=True)}
    assert parsed["infoflow+score_layer=3"] == {"method": "infoflow", "score_layer": 3,
                                                "ttft_budget": QueryConfig.ttft_budget}
    assert "ttft_budget" not in parsed["cacheblend:0.2"] and "ttft_budget" not in parsed["none"]


def test_a_choice_made_at_a_budget_spends_that_budget_in_query_and_serve(tiny_store, tiny_model, tmp_path):
    from sparsecache.query.calibrate import Candidate, machine_costs
    from sparsecache.query.session import Session
    from sparsecache.store import Writer
    from sparsecache.vllm.server import ServeConfig, served_calibration

    store = copy(tiny_store / "store", tmp_path / "store")
    result = {"rows": [{"label": "infoflow+ttft_budget=0.3", "method": "infoflow", "ttft_budget": 0.3,
                        "exact": False, "kept": 1.0, "ttft_ms": 5.0, "ttft_vs_full": 0.3, "meets_target": True}],
              "confident": 4, "target": 0.9, "ttft_budget": 0.5, "questions": 10, "top_k": 2, "full_ttft_ms": 9.0,
              "device": "cpu", "machine": "x", "version": 2}
    rec = record_of(result, "infoflow+ttft_budget=0.3")
    assert rec["query_ttft_budget"] == 0.3 and rec["ttft_budget"] == 0.5 and "recompute_ratio" not in rec
    with Writer(store) as w:
        w.publish_calibration({"cpu": rec}, note="calibrated (cpu)")
    s = Session(store, tiny_model)
    assert s.default_config() == QueryConfig(method="infoflow", recompute_ratio=None, ttft_budget=0.3)
    # the CLI's config names no method and the default budget: the store's budget; one asked for, or a ratio, wins
    assert s.configured(QueryConfig(method=None)).ttft_budget == 0.3
    assert s.configured(QueryConfig(method=None, ttft_budget=0.2)).ttft_budget == 0.2
    assert s.configured(QueryConfig(method=None, recompute_ratio=0.25)).recompute_ratio == 0.25
    served = served_calibration({"cpu": rec}, "cpu", ServeConfig(store="x"))
    assert (served.method, served.recompute_ratio, served.ttft_budget) == ("infoflow", None, 0.3)
    assert served_calibration({"cpu": rec}, "cpu", ServeConfig(store="x", ttft_budget=0.4)).ttft_budget == 0.4
    # a budget's timings are not a fixed ratio's: the cost model is refitted from the fixed ratios alone
    fixed = Candidate("infoflow:0.1", {"method": "infoflow", "recompute_ratio": 0.1}, ttft_ms=[4.0, 6.0],
                      context_tokens=[300, 500])
    full = Candidate("full", {"method": "full"}, exact=True, ttft_ms=[8.0, 12.0], context_tokens=[300, 500])
    spent = Candidate("infoflow+ttft_budget=0.5", {"method": "infoflow", "ttft_budget": 0.5}, ttft_ms=[1e6, 1e6],
                      context_tokens=[300, 500])
    assert machine_costs(s, [full, fixed, spent]) == machine_costs(s, [full, fixed])


@pytest.mark.parametrize("fields,message", [({"target": 0}, "--target must be in"), ({"target": 1.5}, "--target"),
                                            ({"ttft_budget": 0}, "--ttft-budget"),
                                            ({"questions": 2, "timing_questions": 3}, "--timing-questions")])
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        CalibrateConfig(**fields)


def test_target_one_chooses_an_exact_method_that_query_then_uses(tiny_store, tiny_model_dir, tmp_path):
    store = copy(tiny_store / "store", tmp_path / "store")
    run = CliRunner().invoke
    r = run(cli, calibrate_args(store, tiny_model_dir, "--target", "1", "--ttft-budget", "100",
                                "--candidates", "none,infoflow:0.25,infoflow:1.0", "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["met"] and out["chosen"] in ("full", "infoflow:1.0") and out["recorded_version"] == 3
    chosen = next(x for x in out["rows"] if x["chosen"])
    assert chosen["exact"] and {x["label"] for x in out["rows"]} == {"full", "none", "infoflow:0.25", "infoflow:1.0"}
    assert all(x["ttft_ms"] > 0 for x in out["rows"])
    # `info` shows it; `query` uses it where no method is named, and a named method wins
    info = json.loads(run(cli, ["info", str(store), "--json"]).stdout)
    assert info["version"] == 3 and info["calibration"]["cpu"]["label"] == out["chosen"]
    assert out["chosen"] in run(cli, ["info", str(store)]).output
    # the TTFT cost model refitted to this machine's timings, kept with the choice, read by sessions (--ttft-budget)
    from sparsecache.query.session import Session

    assert set(out["costs"]) == {"a_full", "p", "q", "a_store", "s", "g"} and out["costs"]["p"] > 0
    assert info["calibration"]["cpu"]["costs"] == out["costs"]
    assert Session(store, str(tiny_model_dir)).costs.to_dict() == out["costs"]
    q = ["query", str(store), "When was Velmora founded?", "--model", str(tiny_model_dir), "--device", "cpu",
         "--max-new-tokens", "2", "--json"]
    got = json.loads(run(cli, q).stdout)
    named = q + ["--method", chosen["method"]] + (["--recompute-ratio", "1.0"] if chosen["method"] != "full" else [])
    assert (got["method"], got["recomputed_tokens"]) == (chosen["method"], json.loads(run(cli, named).stdout)[
        "recomputed_tokens"])
    assert json.loads(run(cli, q + ["--method", "none"]).stdout)["method"] == "none"


def test_an_unreachable_target_records_nothing_unless_told(tiny_store, tiny_model_dir, tmp_path):
    store = copy(tiny_store / "store", tmp_path / "store")
    run = CliRunner().invoke
    # a random model is confident of nothing: no measured candidate can reach a target
    r = run(cli, calibrate_args(store, tiny_model_dir, "--candidates", "none,infoflow:0.1"))
    assert r.exit_code == 0, r.output
    assert "no candidate within 0.5x" in r.output and "nothing recorded" in r.output
    assert "calibration" not in json.loads(run(cli, ["info", str(store), "--json"]).stdout)
    r = run(cli, calibrate_args(store, tiny_model_dir, "--candidates", "none", "--accept-best", "--json"))
    out = json.loads(r.stdout)
    # nothing measured (no confident question), so there is no best to accept either
    assert r.exit_code == 0 and out["best"] is None and "recorded_version" not in out


def test_a_lower_bound_just_under_the_target_misses_it():
    """60 of 67 kept: the Wilson lower bound is 0.79969, reported as 0.8, and it does not meet 0.8
    (it was compared rounded, #79)."""
    from sparsecache.measure.stats import wilson
    from sparsecache.query.calibrate import Candidate, candidate_row, can_reach

    assert wilson(60, 67)[0] == 0.8 and wilson(60, 67, digits=None)[0] < 0.8
    assert not can_reach(60, 0, 67, 0.8) and can_reach(61, 0, 67, 0.8)
    c = Candidate("infoflow:0.1", {"method": "infoflow", "recompute_ratio": 0.1})
    c.ttft_ms, c.ratio, c.rows = [1.0], 0.3, [{"kept": i < 60} for i in range(67)]
    r = candidate_row(c, CalibrateConfig(target=0.8), 67)
    assert r["kept_ci95"][0] == 0.8 and r["meets_target"] is False


def test_a_choice_that_missed_its_target_says_so_wherever_it_shows(tiny_store, tiny_model, tmp_path, caplog):
    """`calibrate --accept-best` records the best candidate when none met the target: `info`, a query
    that uses it and `serve` say it missed (#79)."""
    import logging

    from sparsecache.query.session import Session
    from sparsecache.store import Writer
    from sparsecache.vllm.server import ServeConfig, served_calibration

    store = copy(tiny_store / "store", tmp_path / "store")
    record = {"method": "cacheblend", "recompute_ratio": 0.15, "label": "cacheblend:0.15", "exact": False,
              "kept": 0.7, "kept_ci95": (0.55, 0.82), "confident": 40, "ttft_vs_full": 0.4, "met_target": False,
              "target": 0.95, "ttft_budget": 0.5, "questions": 100, "top_k": 8, "device": "cpu",
              "machine": "a test", "measured": "2026-12-04T00:00:00+00:00", "measured_at": 2}
    with Writer(store) as w:
        w.publish_calibration({"cpu": record}, note="calibrated (cpu), the best candidate")
    shown = CliRunner().invoke(cli, ["info", str(store)])
    assert shown.exit_code == 0 and "cacheblend:0.15" in shown.output and "MISSED its target" in shown.output
    with pytest.warns(UserWarning, match="cacheblend:0.15: it MISSED its target"):
        assert Session(store, tiny_model).default_config().method == "cacheblend"
    with caplog.at_level(logging.WARNING):
        assert served_calibration({"cpu": record}, "cpu", ServeConfig(store="x")).method == "cacheblend"
    assert "MISSED its target" in caplog.text
    met = CliRunner().invoke(cli, ["info", str(copy(tiny_store / "store", tmp_path / "plain"))])
    assert "MISSED" not in met.output


@pytest.mark.parametrize("args,message", [
    (["--target", "0"], "--target must be in (0, 1]"),
    (["--target", "1.2"], "--target must be in (0, 1]"),
    (["--questions", "500"], "ask for fewer"),
    (["--compare-wrapper", "/nowhere"], "is not a wrapper"),  # refused before anything is measured
])
def test_bad_input_is_one_line_and_exit_1(tiny_store, tiny_model_dir, args, message):
    r = CliRunner().invoke(cli, calibrate_args(tiny_store / "store", tiny_model_dir) + args)
    assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_an_empty_store_a_missing_one_and_another_models_are_refused(tiny_store, tiny_model_dir, default_model_dir,
                                                                      tmp_path):
    run = CliRunner().invoke
    empty = copy(tiny_store / "store", tmp_path / "empty")
    (empty / "manifests" / "v000002.json").unlink()  # as a first encode that stopped after creating the store
    for store, message in ((empty, "holds no documents"), (tmp_path / "nowhere", "no sparsecache store at")):
        r = run(cli, calibrate_args(store, tiny_model_dir))
        assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = run(cli, ["calibrate", str(tiny_store / "store"), "--device", "cpu"])  # the default model: not this store's
    assert r.exit_code == 1 and "model" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_choice_is_used_only_on_its_kind_of_device_and_follows_publishes(tiny_store, tiny_model, tiny_model_dir,
                                                                          tmp_path):
    from sparsecache.query.config import QueryConfig
    from sparsecache.query.session import Session
    from sparsecache.store import Store, Writer

    store = copy(tiny_store / "store", tmp_path / "store")
    record = {"method": "cacheblend", "recompute_ratio": 0.15, "label": "cacheblend:0.15"}
    with Writer(store) as w:
        assert w.publish_calibration({"cuda": record}, note="calibrated (cuda)").version == 3
    with pytest.warns(UserWarning, match="calibrated on cuda, not on cpu"):
        assert Session(store, tiny_model).default_config() == QueryConfig()
    with Writer(store) as w:
        w.publish_calibration({"cuda": record, "cpu": {**record, "recompute_ratio": 0.05}}, note="calibrated (cpu)")
    s = Session(store, tiny_model)
    # a fixed ratio was measured, so no budget goes with it
    assert s.default_config() == QueryConfig(method="cacheblend", recompute_ratio=0.05, ttft_budget=None)
    assert s.query("When was Velmora founded?", max_new_tokens=1).method == "cacheblend"
    assert s.query("When was Velmora founded?", max_new_tokens=1, method="none").method == "none"
    assert s.configured(QueryConfig(method=None, recompute_ratio=0.25)).recompute_ratio == 0.25  # a ratio given wins
    # a nightly publish carries it forward; pruning deletes the versions' own
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "extra.txt").write_text(town("Hollin", 9))
    r = CliRunner().invoke(cli, ["encode-corpus", str(tiny_store / "corpus"), str(tmp_path / "more"), "--store",
                                 str(store), "--keep", "2", "--model", str(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    new = Store.open(store)
    assert new.version == 5 and new.calibration()["cpu"]["recompute_ratio"] == 0.05
    assert sorted(p.name for p in (store / "calibration").iterdir()) == ["v000004.json", "v000005.json"]


def test_the_served_choice(tiny_store):
    from sparsecache.vllm.server import PREFILL_ALL, ServeConfig, served_calibration

    cfg = ServeConfig(store="x")
    assert cfg.method is None and cfg.blend.method == "infoflow"  # the fallback where nothing was measured
    full = served_calibration({"cpu": {"method": "full"}}, "cpu", cfg)
    assert full.prefill_under == PREFILL_ALL  # full prefill: vLLM's own, for every request
    got = served_calibration({"cpu": {"method": "cacheblend", "recompute_ratio": 0.1}}, "cpu", cfg)
    assert (got.method, got.ratio) == ("cacheblend", 0.1)
    assert served_calibration({"cpu": {"method": "superposition"}}, "cpu", cfg) is None  # query's alone
    ratio_given = served_calibration({"cpu": {"method": "cacheblend", "recompute_ratio": 0.1}}, "cpu",
                                     ServeConfig(store="x", recompute_ratio=0.3))
    assert (ratio_given.method, ratio_given.ratio) == ("cacheblend", 0.3)  # as `query --recompute-ratio` alone
    assert served_calibration({"cuda": {"method": "none"}}, "cpu", cfg) is None  # another device's


def test_a_crash_at_every_failpoint_leaves_the_store_as_it_was_or_calibrated(tiny_store, tmp_path):
    from sparsecache.failpoints import Crash, crash_at, record as trace
    from sparsecache.kvstore import verify
    from sparsecache.store import Store, Writer

    devices = {"cpu": {"method": "none", "label": "none"}}
    src = copy(tiny_store / "store", tmp_path / "src")
    with trace() as points:
        with Writer(src) as w:
            w.publish_calibration(devices, note="calibrated")
    assert {p.split(":")[0] for p in points} >= {"calibrate", "publish"}
    for n, point in enumerate(points):
        name, hit = point.split(":")
        store = copy(tiny_store / "store", tmp_path / f"s{n}")
        with pytest.raises(Crash), crash_at(name, int(hit)):
            with Writer(store) as w:
                w.publish_calibration(devices, note="calibrated")
        s = Store.open(store)
        assert (s.version, s.calibration()) in ((2, {}), (3, devices)), point
        # the next publish starts from what is there: a version never shows a calibration it was not given
        with Writer(store) as w:
            m = w.publish_calibration({}, note="again")
        assert Store.open(store).calibration() == {} and m.version == s.version + 1, point
        assert verify(store)["ok"], point


BEFORE = "b521556"  # the last commit before calibrations existed


def test_a_calibrated_store_opens_in_the_release_before_calibrate(tiny_store, tmp_path):
    """The older reader, from git, opens the calibrated store, lists its versions and reads chunks."""
    from sparsecache.store import Writer
    from support.stores import open_in_release

    store = copy(tiny_store / "store", tmp_path / "store")
    with Writer(store) as w:
        w.publish_calibration({"cpu": {"method": "none", "label": "none"}}, note="calibrated (cpu)")
    out = open_in_release(BEFORE, store, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    version, chunks, decoded, info_version = out.stdout.split()
    assert (version, info_version, decoded) == ("3", "3", "1") and int(chunks) >= 8


def test_on_object_storage_and_after_a_nightly_publish(tiny_store, tiny_model_dir, tiny_dictionary_dir, s3_url,
                                                       tmp_path):
    """calibrate on an s3:// store (moto), then `encode-corpus --calibrate` measures it again
    after a publish, with the last calibration's target and budget."""
    run = CliRunner().invoke
    encode = ["encode-corpus", str(tiny_store / "corpus"), "--store", s3_url, "--model", str(tiny_model_dir),
              "--dict", str(tiny_dictionary_dir), "--chunk-tokens", "48", "--wrapper", "none"]
    assert run(cli, encode).exit_code == 0
    r = run(cli, ["calibrate", s3_url, "--model", str(tiny_model_dir), "--device", "cpu", "--questions", "4",
                  "--timing-questions", "1", "--target", "1", "--ttft-budget", "100", "--candidates", "none", "--json"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    assert first["recorded_version"] == 3 and first["recorded"]["target"] == 1.0
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "hollin.txt").write_text(town("Hollin", 9))
    r = run(cli, encode[:2] + [str(tmp_path / "more")] + encode[2:] + ["--calibrate", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    again = out["calibration"]
    # published version 4, then calibrated again at 4 with the recorded target: version 5
    assert out["version"] == 4 and again["recorded_version"] == 5 and again["target"] == 1.0
    info = json.loads(run(cli, ["info", s3_url, "--json"]).stdout)
    assert info["version"] == 5 and info["calibration"]["cpu"]["measured_at"] == 4


def test_reusing_a_contexts_decode_and_scores_changes_no_answer(tiny_store, tiny_model):
    """`Session.reusing` (calibrate's fidelity pass): many configurations over one context share
    its decoded chunks and a question's scores, and each gives what it gives alone."""
    import torch

    from sparsecache.query.session import Session

    s = Session(tiny_store / "store", tiny_model)
    ids = [c.id for c in s.store.chunks()[:4]]
    configs = [{"method": "none"}, {"method": "infoflow", "recompute_ratio": 0.1},
               {"method": "infoflow", "recompute_ratio": 0.25}, {"method": "cacheblend", "recompute_ratio": 0.15},
               # the same method over exact K/V scores its own context, not the codes' (their scores differ)
               {"method": "infoflow", "recompute_ratio": 0.25, "source": "raw"}]
    questions = ("When was Velmora founded?", "How many bridges has Corvin?")
    alone = [s.query(q, chunks=ids, max_new_tokens=1, prefill_under=0, **c).logits for q in questions for c in configs]
    with s.reusing():
        shared = [s.query(q, chunks=ids, max_new_tokens=1, prefill_under=0, **c).logits for q in questions
                  for c in configs]
    for a, b in zip(alone, shared):
        torch.testing.assert_close(a, b)


def test_the_other_variant_is_measured_on_a_twin_and_never_recorded(tiny_store, tiny_model_dir, tiny_model,
                                                                     tmp_path):
    """A plain store's wrapped variant (`--compare-wrapper DIR`): every chunk of the questions'
    contexts encoded on its own with the wrapper into a temporary twin, the same questions timed
    (and, where confident, measured) there, reported beside the store's own rows."""
    from sparsecache.wrapper.apply import initial_wrapper

    initial_wrapper(tiny_model, 3, 2).save(tmp_path / "wrapper")
    store = copy(tiny_store / "store", tmp_path / "store")
    run = CliRunner().invoke
    r = run(cli, calibrate_args(store, tiny_model_dir, "--candidates", "none", "--compare-wrapper",
                                str(tmp_path / "wrapper"), "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    other = out["other"]
    assert other["chunks"] >= 1 and {x["label"] for x in other["rows"]} >= {"none@wrapped", "infoflow:0.1@wrapped"}
    assert all(x["ttft_ms"] > 0 for x in other["rows"]) and "recorded_version" not in out
    r = run(cli, calibrate_args(store, tiny_model_dir, "--compare-wrapper", "none"))  # a plain store has no plain twin
    assert r.exit_code == 1 and "--compare-wrapper: 'none' measures a wrapped store's" in r.output, r.output



def test_the_fidelity_pass_stops_only_candidates_that_can_no_longer_be_chosen(monkeypatch):
    """After LOOK answers, a candidate stops once it cannot reach the target, or once a cheaper one
    is sure to meet it even losing every remaining answer; the rest answer every confident
    question (a scripted session: which candidate loses which question is given)."""
    import contextlib
    from types import SimpleNamespace

    import torch

    import sparsecache.query.calibrate as cal
    from sparsecache.measure.suite import Question

    n = 80
    suite = [Question(f"q{i}", f"question {i}", "x", [], [], 1, chunks=[f"c{i % 7}"], needed=[]) for i in range(n)]
    refs = [{"tokens": [1, 2], "value_positions": [1]} for _ in range(n)]
    loses = {"cheap-bad": set(range(0, n, 2)), "good": set(), "dear": set()}  # the questions each gets wrong
    asked = {m: 0 for m in loses}

    class Scripted:
        @contextlib.contextmanager
        def reusing(self):
            yield self

        def query(self, question, *, method, reference, **_):
            asked[method] += 1
            wrong = int(question.split()[1]) in loses[method]
            lp = torch.full((len(reference), 4), -5.0)
            for p, t in enumerate(reference):
                lp[p, (t + 1) % 4 if wrong else t] = 0.0
            return SimpleNamespace(reference_logprobs=lp)

    monkeypatch.setattr(cal, "_value_figures", lambda ref, lp: {})
    candidates = []
    for name, ratio in (("cheap-bad", 0.1), ("good", 0.2), ("dear", 0.4)):
        c = cal.Candidate(name, {"method": name})
        c.ratio = ratio
        candidates.append(c)
    bar = SimpleNamespace(set_description=lambda *a: None, refresh=lambda: None, update=lambda: None, total=0)
    cal.measure_candidates(Scripted(), suite, refs, list(range(n)), candidates, 0.9, bar)
    # half lost: it cannot reach 0.9 from the first check on; `good` keeps all and is sure to meet 0.9 once
    # its kept alone give a lower bound of 0.9 over 80 (at 73 of 80), so `dear` (costlier) stops there
    assert asked["cheap-bad"] == cal.LOOK and asked["good"] == n
    assert cal.LOOK < asked["dear"] < n and cal.can_reach(asked["dear"], 0, n, 0.9)
    assert not cal.can_reach(asked["dear"] - 1, 0, n, 0.9)
