"""The cheap-context rule (#69): contexts too short for the store to pay are prefilled."""

from __future__ import annotations

import pytest
import torch

from sparsecache.errors import ConfigError
from sparsecache.query import cheap
from sparsecache.query.config import QueryConfig, served_config
from test_blend import QUESTION, chunk_ids, session  # noqa: F401  (fixtures)


def test_the_rule_is_the_cost_models_crossover_and_a_given_threshold_overrides_it():
    """With costs (a CPU's), the length from which the store path at the ratio in effect is predicted
    faster than full prefill; without (a GPU never calibrated), the GPU rule scaled by parameters."""
    from sparsecache.query.budget import Costs, default_costs

    ref = cheap.REFERENCE_PARAMS
    costs = default_costs("cpu", ref, 30 * 192)
    at = cheap.prefill_under(ref, "cpu", costs=costs, ratio=0.1)
    assert at == costs.crossover(0.1) and at < 300  # the store path was faster at every length measured (>= 300)
    assert all(costs.store(n, 0.1) < costs.full(n) for n in range(at + 1, 20_000, 97))
    if at > 1:
        assert costs.store(at - 2, 0.1) > costs.full(at - 2)
    dear = Costs(a_full=10.0, p=1.0, a_store=200.0, s=0.1)
    assert cheap.prefill_under(ref, "cpu", costs=dear, ratio=0.5) > cheap.prefill_under(ref, "cpu", costs=dear,
                                                                                           ratio=0.1) > 0
    assert cheap.prefill_under(ref, "cuda") == cheap.GPU_TOKENS
    assert cheap.prefill_under(80 * ref, "cuda") == cheap.GPU_TOKENS // 80
    dearer = Costs(a_full=10.0, p=1.0, a_store=20.0, s=0.1, g=2.0)  # recomputing a token costs twice prefilling it
    assert cheap.prefill_under(ref, "cpu", costs=dearer, ratio=0.6) == cheap.PREFILL_ALL  # never faster: prefill all
    assert cheap.prefill_under(ref, "cpu", given=0, costs=costs) == 0
    assert cheap.prefill_under(ref, "cuda", given=100) == 100
    default_at = cheap.prefill_under(ref, "cpu", costs=costs, ratio=cheap.rule_ratio(QueryConfig()))
    assert cheap.rule_ratio(QueryConfig()) == 0.0  # the default's TTFT budget: the rule at r = 0
    assert default_at >= 0 and "measured_costs.json" in cheap.rule_text() and "0 never" in cheap.rule_text()


def test_compute_parameters_count_what_a_forward_pass_multiplies(tiny_model):
    from sparsecache.model.gguf import default_model_dir
    from sparsecache.model import compute_parameters
    from transformers import AutoConfig

    assert compute_parameters(AutoConfig.from_pretrained(default_model_dir())) == cheap.REFERENCE_PARAMS
    hf = tiny_model.hf
    counted = sum(p.numel() for p in hf.parameters()) - hf.get_input_embeddings().weight.numel()
    if not hf.config.tie_word_embeddings:
        counted -= hf.get_output_embeddings().weight.numel()
    assert tiny_model.compute_parameters == counted


def test_a_context_under_the_threshold_is_prefilled_and_says_so(session, chunk_ids):  # noqa: F811
    length = session.plan(QueryConfig(method="none", prefill_under=0), chunk_ids).chunk_tokens
    full = session.query(QUESTION, chunks=chunk_ids, method="full", max_new_tokens=4, prefill_under=0)
    cheap_answer = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=4,
                                 prefill_under=length + 1)
    assert cheap_answer.method == "full" and cheap_answer.prefilled_under == length + 1
    assert cheap_answer.answer == full.answer and cheap_answer.recomputed_tokens == 0
    assert torch.allclose(cheap_answer.logits, full.logits, atol=1e-4)
    assert cheap_answer.to_dict()["prefilled_under"] == length + 1
    at = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=1, prefill_under=length)
    assert at.method == "none" and at.prefilled_under is None and "prefilled_under" not in at.to_dict()
    never = session.query(QUESTION, chunks=chunk_ids, max_new_tokens=1, prefill_under=0)
    assert never.method == QueryConfig.method


def test_the_session_applies_the_rule_for_its_model_and_device(session, monkeypatch):  # noqa: F811
    seen = []
    monkeypatch.setattr(cheap, "prefill_under", lambda p, d, given=None, costs=None, ratio=0.0:
                        seen.append((p, d, given, costs, ratio)) or 7)
    assert session.prefill_under() == 7 and session.prefill_under(QueryConfig(prefill_under=3)) == 3
    assert session.prefill_under(QueryConfig(method="none")) == 7
    assert session.prefill_under(QueryConfig(method="infoflow", recompute_ratio=0.3)) == 7
    # the default has a TTFT budget (0.5): the rule at r = 0, the budget's own cheap case; a given ratio at it
    assert seen == [(session.model.compute_parameters, "cpu", None, session.costs, 0.0),
                    (session.model.compute_parameters, "cpu", None, session.costs, 0.0),
                    (session.model.compute_parameters, "cpu", None, session.costs, 0.3)]


def test_a_bad_threshold_is_refused_in_one_line(tmp_path):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    with pytest.raises(ConfigError, match="--prefill-under must be a number of tokens >= 0"):
        QueryConfig(prefill_under=-1)
    assert served_config({"prefill_under": 0}).prefill_under == 0
    with pytest.raises(ConfigError, match="prefill_under must be a number or null"):
        served_config({"prefill_under": "many"})
    r = CliRunner().invoke(cli, ["query", str(tmp_path), "q", "--prefill-under", "-5"])
    assert r.exit_code == 2 and "-5 is not in the range x>=0" in r.output
    text = " ".join(CliRunner().invoke(cli, ["query", "--help"]).output.split())
    assert "prefill contexts shorter than the length from which the TTFT cost model predicts the store path faster" in text
    text = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    assert "--prefill-under" in text and "tokens for a model of SmolLM2-135M" in text


def test_benchmarks_measure_the_method_they_name():
    from sparsecache.bench.ruler import query_settings

    assert query_settings({"method": "none"})["prefill_under"] == 0
    assert query_settings({"method": "none", "prefill_under": 512})["prefill_under"] == 512
