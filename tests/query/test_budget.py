"""Recomputation set by time (`query.budget`): the cost model, and queries that spend a TTFT budget."""

import dataclasses

import pytest

from sparsecache.errors import ConfigError
from sparsecache.query.budget import REFERENCE, Costs, default_costs
from sparsecache.query.config import QueryConfig
from support import REPO


def test_fit_recovers_the_lines_it_was_given():
    truth = Costs(a_full=40.0, p=2.0, a_store=150.0, s=0.5)
    full = [(n, truth.full(n)) for n in (300, 600, 1200)]
    store = [(n, r, truth.store(n, r)) for n in (300, 600, 1200) for r in (0.1, 0.3)]
    got = Costs.fit(full, store)
    for name in ("a_full", "p", "a_store", "s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    with pytest.raises(ValueError, match="two or more context lengths"):
        Costs.fit(full[:1], store)


def test_fit_keeps_every_constant_non_negative_when_noise_makes_a_longer_context_faster():
    """Two lengths timed on a busy machine, the longer one a little faster: a plain line's slope is
    negative (what the toy `bench shapes` test met in CI); no cost shrinks with the context, so the fit
    says p = 0 and keeps its level, and the store path's constants stay non-negative too."""
    got = Costs.fit([(960, 100.0), (1440, 98.8)],
                    [(960, 0.0, 50.0), (1440, 0.0, 49.0), (960, 0.1, 55.0), (1440, 0.1, 54.0)])
    assert all(v >= 0 for v in got.to_dict().values())
    assert got.p == 0 and got.full(1200) == pytest.approx(99.4, abs=1.0)


def test_fit_recovers_attention_and_the_recomputation_factor_from_four_lengths_and_two_ratios():
    truth = Costs(a_full=40.0, p=2.0, a_store=150.0, s=0.5, q=3e-4, g=1.4)
    lengths = (300, 800, 1600, 3200)
    got = Costs.fit([(n, truth.full(n)) for n in lengths],
                    [(n, r, truth.store(n, r)) for n in lengths for r in (0.1, 0.25)])
    for name in ("a_full", "p", "q", "a_store", "s", "g"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-4)
    r = got.ratio(2000, 0.5)
    assert got.store(2000, r) == pytest.approx(0.5 * got.full(2000))


def test_the_ratio_spends_the_budget_and_is_clipped():
    c = Costs(a_full=40.0, p=2.0, a_store=150.0, s=0.5)
    for n in (400, 1100, 3000):
        r = c.ratio(n, 0.5)
        assert 0 < r < 1
        assert c.store(n, r) == pytest.approx(0.5 * c.full(n))  # predicted TTFT is the budget
    assert c.ratio(1100, 0.5) < c.ratio(3000, 0.5)  # the fixed part weighs less on a longer context
    assert Costs(a_full=40.0, p=2.0, a_store=0.0, s=0.0).ratio(3000, 1.0) == 1.0  # more than everything buys
    assert c.ratio(120, 0.5) == 0.0  # the budget does not even cover the decode: nothing recomputed
    assert c.ratio(50, 0.5) is None  # full prefill is cheaper than the store path: the cheap-context case


def test_the_measured_timings_are_data_with_their_provenance(tmp_path):
    """#96 item 4: the cost model's timings live in a data file, each entry naming the machine, date, command
    and JSON it came from (the JSON in this repository), and the module reads them from there."""
    import json

    from sparsecache.query.budget import MEASURED, MEASURED_FILE, load_measured

    root = REPO
    data = json.loads(MEASURED_FILE.read_text())
    assert len(data["measured"]) == len(MEASURED) >= 4 and REFERENCE["name"] == data["reference"]
    for m in data["measured"]:
        assert m["machine"] and m["command"] and m["date"] >= "2026-11-01" and m["device"] in ("cpu", "cuda")
        assert m["json"] and all((root / j).is_file() for j in m["json"]), m["name"]
    data["measured"][0]["full"] = [[n, 2 * ms] for n, ms in data["measured"][0]["full"]]  # another machine's
    (tmp_path / "costs.json").write_text(json.dumps(data))
    entries, reference = load_measured(tmp_path / "costs.json")
    assert reference["full"][0] == (REFERENCE["full"][0][0], 2 * REFERENCE["full"][0][1])


def test_the_defaults_are_the_measured_cpu_points_and_scale_with_the_model():
    """Each measured size's constants predict its own timings (short and long contexts alike: the fit
    is on relative errors); a model gets the nearest measured size's, scaled; no GPU is measured."""
    from sparsecache.query.budget import MEASURED

    for m in MEASURED:
        c = default_costs(m["device"], m["compute_parameters"], m["kv_values"])
        for n, ms in m["full"]:
            assert c.full(n) == pytest.approx(ms, rel=0.2), (m["name"], n)
        for n, r, ms in m["store"]:
            # within a third: SmolLM2's points mix #69's 8 short chunks and bench shapes' 2-16 long ones
            assert c.store(n, r) == pytest.approx(ms, rel=0.35), (m["name"], n, r)
    c = default_costs("cpu", REFERENCE["compute_parameters"], REFERENCE["kv_values"])
    # the crossover below which prefilling is cheaper (the cheap-context rule): under the shortest context
    # measured (300 tokens) for the default model, and no earlier the more a query recomputes
    assert c.crossover(0.0) <= c.crossover(0.1) <= c.crossover(0.5) < 300
    big = default_costs("cpu", MEASURED[-1]["compute_parameters"], MEASURED[-1]["kv_values"])
    assert 0 < big.crossover(0.1) < big.crossover(0.5)  # the 3B shape: its store path's fixed costs grow with it
    near = default_costs("cpu", int(1.2 * REFERENCE["compute_parameters"]), REFERENCE["kv_values"])
    assert near.p == pytest.approx(1.2 * c.p) and near.s == pytest.approx(c.s)  # scaled from the nearest size
    largest = max(MEASURED, key=lambda m: m["compute_parameters"])
    beyond = default_costs("cpu", 2 * largest["compute_parameters"], largest["kv_values"])
    base = default_costs("cpu", largest["compute_parameters"], largest["kv_values"])
    assert beyond.p == pytest.approx(2 * base.p)
    assert default_costs("mps", 1, 1) is None  # no constants measured for the kind: no budget applies there
    # a GPU's store path has launch-bound fixed costs: not scaled down to a model under half the smallest
    # size measured there (the cheap rule's GPU_TOKENS instead); at the sizes measured, what the H100 showed
    assert default_costs("cuda", REFERENCE["compute_parameters"], REFERENCE["kv_values"]) is None
    gpu = {m["name"]: default_costs("cuda", m["compute_parameters"], m["kv_values"]) for m in MEASURED
           if m["device"] == "cuda"}
    assert gpu["Llama-3.2-3B (shape, H100)"].crossover(0.1) is None  # slower than prefill at every length
    assert gpu["Llama-3.1-8B (shape, H100)"].crossover(0.1) is not None
    assert gpu["Llama-3.1-8B (shape, H100)"].ratio(8000, 0.5) == 0.0  # r = 0 is already over half of prefill


def test_a_budget_is_a_fraction_of_full_prefill():
    assert QueryConfig().ttft_budget == 0.5  # the default since #79 item 5's rule chose it
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ConfigError, match="ttft-budget"):
            QueryConfig(ttft_budget=bad)
    assert QueryConfig(ttft_budget=0.5).ttft_budget == 0.5


def test_a_query_recomputes_what_its_budget_buys(tiny_model, tiny_dictionary, embedder, tmp_path):
    """The ratio follows the context's length through the session's costs; a given ratio overrides
    the budget; a device kind with no costs keeps the method's own ratio; the answer says which."""
    from support.corpora import write_corpus

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    encode_with([str(write_corpus(tmp_path / "corpus"))], tmp_path / "store", tiny_dictionary, tiny_model,
                StoreConfig(chunk_tokens=64), EncodeOptions(batch_tokens=512, progress=False), embedder=embedder)
    s = Session(tmp_path / "store", tiny_model)
    s._embedder = embedder
    s.costs = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)  # ~0.37 at this context's ~260 tokens
    ids = [c.id for c in s.store.chunks()][:4]
    a = s.query("What does the statement do?", chunks=ids, method="infoflow", ttft_budget=0.5, max_new_tokens=1,
                prefill_under=0)
    assert 0.2 < a.recompute_ratio == pytest.approx(s.costs.ratio(a.context_tokens, 0.5), abs=1e-4)
    assert a.to_dict()["recompute_ratio"] == a.recompute_ratio
    default = s.query("What does the statement do?", chunks=ids, max_new_tokens=1, prefill_under=0)
    assert default.method == "infoflow" and default.recompute_ratio == a.recompute_ratio  # the path users take
    assert 0 < a.recomputed_tokens <= round(a.recompute_ratio * a.context_tokens) + 8  # whole windows of 8
    given = s.query("What does the statement do?", chunks=ids, method="infoflow", ttft_budget=0.5,
                    recompute_ratio=0.3, max_new_tokens=1, prefill_under=0)
    assert given.recompute_ratio == 0.3
    s.costs = None
    own = s.query("What does the statement do?", chunks=ids, method="infoflow", ttft_budget=0.5, max_new_tokens=1,
                  prefill_under=0)
    assert own.recompute_ratio == QueryConfig(method="infoflow").ratio
    plain = s.query("What does the statement do?", chunks=ids, method="none", ttft_budget=0.5, max_new_tokens=1,
                    prefill_under=0)
    assert plain.recompute_ratio is None and plain.recomputed_tokens == 0


def test_a_session_follows_costs_calibrated_after_it_opened(tiny_model, tiny_dictionary, embedder, tmp_path):
    """No override: the shipped constants, then, once `calibrate` publishes a refit and the session moves
    to that version (as it does when its own is deleted), the refit, without reopening the session."""
    from support.corpora import write_corpus

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig, Writer

    encode_with([str(write_corpus(tmp_path / "corpus"))], tmp_path / "store", tiny_dictionary, tiny_model,
                StoreConfig(chunk_tokens=64), EncodeOptions(batch_tokens=512, progress=False), embedder=embedder)
    s = Session(tmp_path / "store", tiny_model)
    s._embedder = embedder
    m = tiny_model
    assert s.costs == default_costs("cpu", m.compute_parameters, m.n_layers * m.m)
    refit = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)
    with Writer(tmp_path / "store") as w:
        w.publish_calibration({"cpu": {"method": "none", "label": "none", "costs": refit.to_dict()}},
                              note="calibrated (cpu)")
    s.store = s.store.latest()
    ids = [c.id for c in s.store.chunks()][:4]
    a = s.query("What does the statement do?", chunks=ids, method="infoflow", ttft_budget=0.5, max_new_tokens=1,
                prefill_under=0)
    assert s.costs == refit
    assert a.recompute_ratio == pytest.approx(refit.ratio(a.context_tokens, 0.5), abs=1e-4)


def test_rescaling_to_a_machine_recovers_its_factors_from_one_context_length():
    """`calibrate` sees a store's few context lengths: the shipped shape, scaled by two factors."""
    base = Costs(a_full=40.0, p=2.0, a_store=150.0, s=0.5, q=1e-4, g=1.2)
    machine = Costs(a_full=80.0, p=4.0, a_store=450.0, s=1.5, q=2e-4, g=1.2)  # prefill x2, the rest x3
    got = base.rescaled([(1100, machine.full(1100))], [(1100, r, machine.store(1100, r)) for r in (0.1, 0.25)])
    for name in ("a_full", "p", "q", "a_store", "s", "g"):
        assert getattr(got, name) == pytest.approx(getattr(machine, name), rel=1e-6)


def test_served_requests_and_the_server_take_a_budget():
    from sparsecache.query.budget import budgeted
    from sparsecache.query.config import served_config
    from sparsecache.vllm.config import ServeConfig

    assert ServeConfig("s").blend.ttft_budget == QueryConfig().ttft_budget == 0.5  # one default, query's
    cfg = served_config({"ttft_budget": 0.5}, ServeConfig("s", ttft_budget=0.4).blend)
    assert cfg.ttft_budget == 0.5 and cfg.recompute_ratio is None
    for bad, match in (({"ttft_budget": "half"}, "ttft_budget must be"), ({"ttft_budget": 2}, "ttft-budget")):
        with pytest.raises(ConfigError, match=match):
            served_config(bad)
    with pytest.raises(ConfigError, match="ttft-budget"):
        ServeConfig("s", ttft_budget=0)
    costs = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)
    assert budgeted(cfg, 1000, costs).recompute_ratio == pytest.approx(costs.ratio(1000, 0.5), abs=1e-4)
    assert budgeted(cfg, 1000, None) is cfg  # no costs for the device: the method's own ratio
    assert budgeted(dataclasses.replace(cfg, recompute_ratio=0.3), 1000, costs).recompute_ratio == 0.3
    assert budgeted(served_config({"method": "none", "ttft_budget": 0.5}), 1000, costs).recompute_ratio is None
