"""`sparsecache calibrate STORE`: fidelity to full prefill measured on the store's own text, and
the cheapest query configuration that meets a stated target, kept with the store.

How much recomputation a corpus needs to give full prefill's answers depends on the model, the
corpus and the device, so it is measured here rather than fixed once:

1. **Questions** (`measure.cloze`, style `continue`): sentences of the store's own chunks that
   hold a distinctive span (an RFC, a version, an identifier, a number); the answer is begun
   with the sentence up to the span and the model continues it. Each is asked with retrieval
   over the store (`top_k` chunks), as a user's question is. No labels are needed.
2. **The reference**: full prefill of the retrieved chunks answers every question. It is
   *confident* of an answer holding the span when, at every token of the span, its chosen token
   is at least 4x as likely as the runner-up (`measure.answers.CONFIDENT_MARGIN`, #69's rule).
3. **TTFT**: every candidate and full prefill on the first `timing_questions` questions,
   interleaved (one warm-up first), on this device; a candidate slower than `ttft_budget` x full
   prefill's cannot be chosen and is not measured further.
4. **Fidelity**: each candidate within the budget, on the questions full prefill is confident
   of (every candidate on the first LOOK of them, then only those that could still reach the
   target were they to keep every remaining one and that cost no more than one already sure to
   meet it), teacher-forced along full prefill's answer: it *keeps* the answer when its top-1 token
   equals full prefill's at every position up to the span's end (then its greedy answer is full
   prefill's up to there, span included; an answer that gets there by other words is not
   counted, so this is a lower bound on `bench fidelity`'s kept). `kept` is the share kept with
   its 95% Wilson interval; the value tokens' agreement and KL as `bench fidelity` has them.
5. **The choice**: the lowest-TTFT candidate whose lower bound of kept reaches `target`. Full
   prefill, and recomputing every token (r = 1.0) of a store without a wrapper, are exact: they
   meet every target, where the TTFT budget admits them.

6. **The other variant** (`compare_wrapper`): the same candidates and questions on a temporary
   twin of the contexts' chunks encoded the other way (plain for a wrapped store, with a wrapper
   for a plain one), reported beside the store's rows and never chosen.

The choice, with its figures and the machine, is published as a new version of the store whose
calibration (`store.calibration`) holds it under this kind of device; `query`, `Session` and
`serve` use it unless a method is named. On a GPU the GPU's choice is measured and kept beside
the CPU's.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..errors import ConfigError, StoreError
from . import methods
from .config import DTYPE, TOP_K, TTFT_BUDGET, QueryConfig, calibration_line, device_record

RATIOS = (0.05, 0.1, 0.15, 0.25, 0.5)  # the default method's (infoflow's) ratios among the candidates
OTHER_RATIO = 0.15  # the other scorers' (CacheBlend's constant): one each, so `calibrate --questions 100` fits 15 min
EXACT_RATIO = 1.0  # recomputing every token: full prefill's computation, on a store without a wrapper
MEASURE = {"prefill_under": 0}  # every query measures the method it names, not the cheap-context rule
LOOK = 20  # confident questions every candidate within the budget answers before one that cannot reach the target stops


@dataclass(frozen=True)
class CalibrateConfig:
    """What `sparsecache calibrate` measures (the CLI's defaults come from here)."""

    target: float = 0.95  # the lower bound of kept a choice must reach
    ttft_budget: float = TTFT_BUDGET  # the most TTFT a choice may take, as a fraction of full prefill's
    questions: int = 100  # cloze questions from the store's documents
    top_k: int = TOP_K  # chunks each is asked with (as `query` retrieves)
    candidates: str | None = None  # `bench fidelity --methods` syntax; None: `grid()`
    timing_questions: int = 3  # questions every candidate is timed on (after one warm-up)
    per_document: int = 6  # questions from one document at most: spread over the corpus
    max_new_tokens: int = 4  # full prefill's answer: the span's tokens and this many more
    seed: int = 0
    accept_best: bool = False  # record the best candidate when none meets the target
    # also measure the store's other variant on a twin of the questions' chunks: 'none' (a wrapped
    # store's plain variant), 'shipped' or a learn-wrapper directory (a plain store's wrapped one)
    compare_wrapper: str | None = None

    def __post_init__(self):
        if isinstance(self.target, bool) or not 0 < self.target <= 1:
            raise ConfigError(f"--target must be in (0, 1], got {self.target}")
        if not self.ttft_budget > 0:
            raise ConfigError(f"--ttft-budget must be > 0, got {self.ttft_budget}")
        if self.questions < 1 or self.timing_questions < 1 or self.per_document < 1:
            raise ConfigError("--questions, --timing-questions and --per-document must be at least 1")
        if self.timing_questions > self.questions:
            raise ConfigError(f"--timing-questions ({self.timing_questions}) is more than --questions "
                              f"({self.questions})")
        if self.top_k < 1:
            raise ConfigError("--top-k must be at least 1")


@dataclass
class Candidate:
    label: str
    settings: dict  # Session.query's settings (method, recompute_ratio, …)
    exact: bool = False  # full prefill's computation: meets every target
    ttft_ms: list = field(default_factory=list)  # timed, by timing question
    context_tokens: list = field(default_factory=list)  # of each timed query (the cost model's n)
    rows: list = field(default_factory=list)  # fidelity, one per confident question
    ratios: list = field(default_factory=list)  # with a TTFT budget in settings: the ratio it bought, by timed question


def grid(wrapped: bool) -> list[Candidate]:
    """The default candidates: full prefill; `none`; the default method (infoflow) at each of
    RATIOS and at the ratio the default TTFT budget buys (what `query` does with no calibration);
    every other method the vLLM connector can serve that recomputes at OTHER_RATIO (those still being
    measured, #94's levers, only by `--candidates`); on a store
    without a wrapper, infoflow recomputing every token (exact). Methods `serve` cannot use
    (superposition, cake) are left out, so a choice serves everywhere; `--candidates` names any
    others, and other ratios or budgets."""
    out = [Candidate("full", {"method": "full"}, exact=True)]
    for name in methods.names(connector=True, in_calibrate_grid=True):
        ratios = RATIOS if name == QueryConfig.method else (OTHER_RATIO,) if methods.get(name).recomputes else (None,)
        out += [Candidate(name if r is None else f"{name}:{r:g}",
                          {"method": name, **({} if r is None else {"recompute_ratio": r})}) for r in ratios]
        if name == QueryConfig.method:
            out.append(budget_candidate(name, TTFT_BUDGET))
    if not wrapped:
        out.append(Candidate(f"infoflow:{EXACT_RATIO:g}", {"method": "infoflow", "recompute_ratio": EXACT_RATIO},
                             exact=True))
    return out


def budget_candidate(method: str, budget: float) -> Candidate:
    """`method` at the ratio `budget` (a fraction of full prefill's TTFT) buys at each question's length."""
    return Candidate(f"{method}+ttft_budget={budget:g}", {"method": method, "ttft_budget": budget})


def parse_candidates(spec: str, wrapped: bool) -> list[Candidate]:
    """`--candidates` (`bench fidelity --methods` syntax, no `@wrapped`: the store is what it is);
    full prefill is always one."""
    from .spec import parse_methods

    if "@" in spec:
        raise ConfigError("--candidates: calibrate measures the store as it is encoded; no @wrapped")
    out = [Candidate("full", {"method": "full"}, exact=True)]
    for label, cfg in parse_methods(spec).items():
        if cfg.get("method") == "full":
            continue
        cfg = {k: v for k, v in cfg.items() if k not in ("store", "context")}
        if cfg.get("method") == "raw":
            raise ConfigError("--candidates: raw reads exact KV files, not the store; it cannot be calibrated")
        recomputes = methods.get(cfg["method"]).recomputes
        if recomputes and cfg.get("recompute_ratio") is None:  # what the query runs at, said in the record
            cfg.setdefault("ttft_budget", QueryConfig.ttft_budget)
        exact = not wrapped and recomputes and cfg.get("recompute_ratio") == 1.0
        out.append(Candidate(label, cfg, exact=exact))
    return out


def _machine(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..measure.machine import cpu_model

    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def calibrate(session, cfg: CalibrateConfig = CalibrateConfig(), progress: bool = True) -> dict:
    """Measure `cfg`'s candidates on `session`'s store (the module's steps 1-5) and return
    {questions, confident, full_ttft_ms, rows: one per candidate, chosen, best, met, device, …}.
    Records nothing (`record` does)."""
    from tqdm import tqdm

    from ..measure.answers import CONFIDENT_MARGIN, contains, value_positions, value_reference

    store = session.store
    require_documents(store)
    wrapped = store.header() is not None
    if cfg.compare_wrapper is not None and wrapped != (cfg.compare_wrapper == "none"):
        raise ConfigError("--compare-wrapper: 'none' measures a wrapped store's plain variant; a plain store's "
                          "wrapped one takes 'shipped' or a learn-wrapper directory")
    twin_wrapper = None  # the other variant's wrapper, loaded (or refused) before anything is measured
    if cfg.compare_wrapper not in (None, "none"):
        from ..wrapper.apply import load_wrapper

        twin_wrapper = load_wrapper(cfg.compare_wrapper, session.model.fingerprint())
    candidates = parse_candidates(cfg.candidates, wrapped) if cfg.candidates else grid(wrapped)
    tokenizer = session.model.tokenizer
    bar = tqdm(total=cfg.questions, desc="calibrate (questions)", unit="q", disable=not progress, file=sys.stderr)

    # 1. questions, 2. the reference: one full prefill per context, every question of it after it
    seconds, t0 = {}, time.perf_counter()
    suite = questions(session, cfg)
    refs: list = [None] * len(suite)
    for ids, members in _by_context(suite):
        for i, ref in zip(members, full_answers(session, ids, [suite[i] for i in members], cfg.max_new_tokens)):
            refs[i] = ref
            bar.update()
    for q, ref in zip(suite, refs):
        correct = contains(ref["answer"], q.truth)
        positions = value_positions(tokenizer, ref["tokens"], q.truth) if correct else []
        ref |= {"correct": correct, **value_reference(ref.pop("logprobs"), ref["tokens"], positions)}
        ref["confident"] = bool(correct and ref["margin"] is not None and ref["margin"] >= CONFIDENT_MARGIN)
    confident = [i for i, r in enumerate(refs) if r["confident"]]
    seconds["reference"], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()

    # 3. TTFT, every candidate interleaved with full prefill on the same questions
    timed = (confident + [i for i in range(len(suite)) if i not in confident])[: cfg.timing_questions]
    _time(session, suite, timed, candidates, bar)
    seconds["ttft"], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()
    full_ms = sum(candidates[0].ttft_ms) / len(candidates[0].ttft_ms)
    for c in candidates:
        c.ratio = sum(c.ttft_ms) / len(c.ttft_ms) / full_ms
    costs = machine_costs(session, candidates)

    # 4. fidelity of each candidate within the budget (and cheaper than an exact one that is)
    exact = min((c.ratio for c in candidates if c.exact and c.ratio <= cfg.ttft_budget), default=math.inf)
    measure_candidates(session, suite, refs, confident, [c for c in candidates if not c.exact and c.ratio <= min(
        cfg.ttft_budget, exact)], cfg.target, bar)
    seconds["fidelity"] = round(time.perf_counter() - t0, 1)

    # 5. the choice
    rows = [candidate_row(c, cfg, len(confident)) for c in candidates]
    chosen, best = choose(rows)
    result = {"questions": len(suite), "confident": len(confident), "full_correct": sum(r["correct"] for r in refs),
              "timing_questions": len(timed), "full_ttft_ms": round(full_ms, 1), "target": cfg.target,
              "ttft_budget": cfg.ttft_budget, "top_k": cfg.top_k, "wrapped": wrapped, "chosen": chosen, "best": best,
              "met": chosen is not None, "device": session.device.type, "machine": _machine(session.device),
              "version": store.version, "seconds": seconds, "rows": rows,
              "costs": None if costs is None else costs.to_dict()}

    # 6. the store's other variant, where asked: the same questions over a twin of their chunks
    if cfg.compare_wrapper is not None:
        t0 = time.perf_counter()
        result["other"] = other_variant(session, cfg, suite, refs, confident, timed, full_ms, bar, twin_wrapper)
        seconds["other_variant"] = round(time.perf_counter() - t0, 1)
    bar.close()
    return result


def machine_costs(session, candidates: list[Candidate]):
    """The TTFT cost model (`budget.Costs`) on this machine, from the timings just taken: full
    prefill's, and infoflow's at its fixed ratios (the method a budget sets the ratio of). The session's
    constants rescaled to them (`Costs.rescaled`), or, on a kind of device with none, fitted where
    the questions' context lengths allow; None otherwise."""
    import numpy as np

    from .budget import Costs

    full = [(n, t) for c in candidates if c.settings["method"] == "full" for n, t in zip(c.context_tokens, c.ttft_ms)]
    store = [(n, c.settings.get("recompute_ratio") or 0.0, t) for c in candidates
             if c.settings["method"] == "infoflow" and not c.exact and "ttft_budget" not in c.settings
             for n, t in zip(c.context_tokens, c.ttft_ms)]
    if not full or not store:
        return None
    base = session.costs  # the store's earlier refit, else the shipped constants
    if base is not None:
        return base.rescaled(full, store)
    try:
        return Costs.fit(full, store)
    except (ValueError, np.linalg.LinAlgError):
        return None


def require_documents(store) -> None:
    """Refuse a store with no live document: there is nothing to ask about."""
    if store.manifest.live_chunks == 0:
        raise StoreError(f"{store.backend}: the store holds no documents; encode a corpus into it first")


def _time(session, suite: list, timed: list[int], candidates: list[Candidate], bar, chunks=None) -> None:
    """Every candidate's TTFT on the questions `timed` (round by round, interleaved), after one
    untimed query per method (one-time costs are not TTFT); `chunks` maps a question's chunk ids
    (a twin store's: `other_variant`)."""
    chunks = chunks or (lambda ids: ids)
    warm = list({c.settings["method"]: c for c in candidates if c.settings["method"] != "full"}.values())
    bar.set_description("calibrate (TTFT)")
    bar.total += len(warm) + len(timed) * len(candidates)
    bar.refresh()
    for n, i in enumerate([timed[0]] + timed):
        q = suite[i]
        for c in candidates if n else warm:
            a = session.query(q.question, chunks=chunks(q.chunks), answer_prefix=q.answer_prefix or "",
                              max_new_tokens=1, **{**MEASURE, **c.settings})
            if n:
                c.ttft_ms.append(a.timings_ms["ttft"])
                c.context_tokens.append(a.context_tokens)
                if "ttft_budget" in c.settings and a.recompute_ratio is not None:
                    c.ratios.append(a.recompute_ratio)
            bar.update()


def measure_candidates(session, suite: list, refs: list, confident: list[int], measured: list[Candidate], target: float, bar,
              chunks=None) -> None:
    """`measured`'s rows on the confident questions: every candidate on the first LOOK of them,
    then only those that can still reach `target` (were every remaining question kept) and are
    no costlier than one already sure to meet it (were every remaining question lost). A
    context's questions run together and share its decoded chunks and scores (`Session.reusing`)."""
    chunks = chunks or (lambda ids: ids)
    alive = list(measured)
    bar.set_description("calibrate (fidelity)")
    bar.total += len(measured) * len(confident)
    bar.refresh()
    with session.reusing():
        for n, i in enumerate(sorted(confident, key=lambda i: suite[i].chunks)):
            q, ref = suite[i], refs[i]
            through = ref["tokens"][: max(ref["value_positions"]) + 1]  # full prefill's answer up to the span's end
            for c in alive:
                a = session.query(q.question, chunks=chunks(q.chunks), answer_prefix=q.answer_prefix or "",
                                  max_new_tokens=1, reference=through, logprobs=True, **{**MEASURE, **c.settings})
                c.rows.append({"kept": a.reference_logprobs.argmax(-1).tolist() == through,
                               **_value_figures(ref, a.reference_logprobs)})
                bar.update()
            if n + 1 >= LOOK:
                kept = {id(c): sum(r["kept"] for r in c.rows) for c in alive}
                # sure to meet it even if it lost every remaining answer: nothing costlier can be chosen
                sure = min((c.ratio for c in alive if can_reach(kept[id(c)], 0, len(confident), target)),
                           default=math.inf)
                stopped = [c for c in alive if c.ratio > sure or not can_reach(
                    kept[id(c)], len(confident) - len(c.rows), len(confident), target)]
                bar.total -= (len(confident) - n - 1) * len(stopped)
                alive = [c for c in alive if c not in stopped]
            if not alive:
                break


def other_variant(session, cfg: CalibrateConfig, suite: list, refs: list, confident: list[int], timed: list[int],
                  full_ms: float, bar, w=None) -> dict:
    """The candidates on the store's other variant (`cfg.compare_wrapper`: `none` for a wrapped
    store, the wrapper `w` for a plain one): every chunk the questions' contexts hold is encoded on its
    own, that way, into a temporary twin store, and the same questions are asked over it against
    the same full-prefill answers. Reported, never chosen: the store is what it is; the result
    says whether re-encoding it that way would meet the target at a lower TTFT."""
    import dataclasses
    import json
    import tempfile

    from ..ingest.config import EncodeOptions
    from ..ingest.encoder import encode_with
    from ..measure.suite import chunk_ids_by_doc
    from .session import Session

    store = session.store
    wrapped = store.header() is not None
    ids = sorted({c for q in suite for c in q.chunks})
    with tempfile.TemporaryDirectory(prefix="sparsecache-twin-") as tmp:
        corpus = f"{tmp}/chunks.jsonl"
        with open(corpus, "w") as f:
            for cid, text in zip(ids, store.texts(ids)):
                f.write(json.dumps({"id": cid, "text": text}) + "\n")
        bar.set_description("calibrate (encoding the other variant)")
        config = dataclasses.replace(store.config, wrapper=None if w is None else w.digest(),
                                     chunk_tokens=2 * store.config.chunk_tokens)  # one chunk per chunk
        encode_with([corpus], f"{tmp}/twin", store.dictionary, session.model, config,
                    EncodeOptions(device=str(session.device), progress=False), embedder=session.embedder, wrapper=w)
        twin = Session(f"{tmp}/twin", session.model, session.device)
        of = chunk_ids_by_doc(twin.store)

        def chunks(original: list[str]) -> list[str]:
            return [of[c] for c in original]

        suffix = "@plain" if wrapped else "@wrapped"
        candidates = [dataclasses.replace(c, label=c.label + suffix, ttft_ms=[], rows=[])
                      for c in grid(not wrapped) if not c.exact]
        _time(twin, suite, timed, candidates, bar, chunks)
        for c in candidates:
            c.ratio = sum(c.ttft_ms) / len(c.ttft_ms) / full_ms
        measure_candidates(twin, suite, refs, confident, [c for c in candidates if c.ratio <= cfg.ttft_budget], cfg.target, bar,
                  chunks)
    rows = [candidate_row(c, cfg, len(confident)) for c in candidates]
    chosen, best = choose(rows)
    return {"wrapper": cfg.compare_wrapper, "chunks": len(ids), "chosen": chosen, "best": best, "rows": rows}


def can_reach(kept: int, remaining: int, confident: int, target: float) -> bool:
    """Whether a candidate that kept `kept` so far could still reach `target` with its lower
    bound over all `confident` questions: were it to keep every one of the `remaining`."""
    from ..measure.stats import wilson

    return wilson(kept + remaining, confident, digits=None)[0] >= target


def choose(rows: list[dict]) -> tuple[str | None, str | None]:
    """(chosen, best) labels of the table `rows`: the chosen one is the lowest-TTFT row within
    the budget that meets the target (an exact one always does; None where none is); the best
    is the chosen one, else the measured row within the budget with the highest lower bound of
    kept (then kept, then the lower TTFT; None where none was measured). Marks the chosen row."""
    eligible = [r for r in rows if r["within_budget"] and r["meets_target"]]
    chosen = min(eligible, key=lambda r: r["ttft_vs_full"]) if eligible else None
    scored = [r for r in rows if r["within_budget"] and not r["exact"] and "kept_ci95" in r]
    best = chosen or (max(scored, key=lambda r: (r["kept_ci95"][0], r["kept"], -r["ttft_vs_full"])) if scored else None)
    for r in rows:
        r["chosen"] = chosen is not None and r["label"] == chosen["label"]
    return (chosen and chosen["label"]), (best and best["label"])


def questions(session, cfg: CalibrateConfig) -> list:
    """`cfg.questions` cloze questions (`cloze`, style `continue`) over the store's documents, at
    most `cfg.per_document` from one, the distinctive spans first, each with a retrieved context:
    the `top_k` chunks retrieval returns for a question about the same chunk asked before it
    (so one full prefill answers several), else for itself. A question whose chunk its own
    retrieval misses is left out (full prefill could not answer it either). Seeded."""
    import random

    from ..measure.cloze import cloze_candidates, distinctive_first
    from ..measure.suite import Question

    pool = cloze_candidates(session.store, session.model.tokenizer, "continue")
    rng = random.Random(f"calibrate-{cfg.seed}")
    rng.shuffle(pool)
    distinctive_first(pool)
    out, per_doc, contexts = [], {}, []
    for c in pool:
        if len(out) == cfg.questions:
            break
        if per_doc.get(c["doc"], 0) >= cfg.per_document:
            continue
        context = next((ids for ids in contexts if c["chunk"] in ids), None)
        if context is None:
            context = [h["id"] for h in session.retrieve(c["question"], cfg.top_k)]
            if c["chunk"] not in context:
                continue
            contexts.append(context)
        per_doc[c["doc"]] = per_doc.get(c["doc"], 0) + 1
        out.append(Question(f"cal-{len(out):03d}", c["question"], c["span"], [c["chunk"]], [], hops=1,
                            chunks=context, needed=[c["chunk"]], answer_prefix=c["answer_prefix"]))
    if len(out) < cfg.questions:
        raise ConfigError(f"the store's documents hold {len(out)} cloze questions that retrieval can answer "
                          f"({cfg.per_document} per document at most); ask for fewer with --questions")
    return out


def _by_context(suite: list) -> list[tuple[list[str], list[int]]]:
    """(chunk ids, the indices of the questions asked over them), in first-asked order."""
    groups: dict[tuple, list[int]] = {}
    for i, q in enumerate(suite):
        groups.setdefault(tuple(q.chunks), []).append(i)
    return [(list(ids), members) for ids, members in groups.items()]


def full_answers(session, ids: list[str], qs: list, extra_tokens: int) -> list[dict]:
    """Full prefill's greedy answers to the questions `qs` over the chunks `ids` (retrieval order;
    laid out as a query lays them out): the context prefilled once, then each question after it
    in turn ({tokens, answer, logprobs [len(tokens), vocab]}), its answer the span's tokens and
    `extra_tokens` more at most. What `Session.query(method="full")` answers, without prefilling
    the same context again for every question."""
    import torch

    from ..model.cache import truncate
    from ..model.generate import full_prefill, greedy_continue, prefill, question_ids
    from .methods.full import text_ids

    model = session.model
    context = text_ids(session.store, ids[::-1] if QueryConfig().order == "reverse" else ids)
    _, cache = full_prefill(context, model)
    out = []
    for q in qs:
        q_ids = question_ids(model, q.question, q.answer_prefix or "")
        logits = prefill(cache, q_ids, model)
        span = len(model.tokenizer(" " + q.truth, add_special_tokens=False)["input_ids"])
        steps = [logits.float()]
        tokens = greedy_continue(int(logits.argmax()), cache, len(context) + len(q_ids), model, span + extra_tokens,
                                 steps=steps)
        truncate(cache, len(context))
        out.append({"tokens": tokens, "answer": model.tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                    "logprobs": torch.stack(steps[: len(tokens)]).log_softmax(-1).cpu() if tokens else None})
    return out


def _value_figures(ref: dict, reference_logprobs) -> dict:
    from ..measure.answers import value_figures

    return value_figures(ref, reference_logprobs)


def candidate_row(c: Candidate, cfg: CalibrateConfig, confident: int) -> dict:
    """A candidate's line of the table: its settings, TTFT against full prefill's, and (where
    measured) kept with its interval and the value tokens' agreement and KL."""
    from ..measure.answers import summarise_values
    from ..measure.stats import wilson

    out = {"label": c.label, **c.settings, "exact": c.exact, "ttft_ms": round(sum(c.ttft_ms) / len(c.ttft_ms), 1),
           "ttft_vs_full": round(c.ratio, 3), "within_budget": c.ratio <= cfg.ttft_budget}
    if c.ratios:  # the ratios a budget bought on the timed questions
        out["recompute_ratios"] = [round(r, 4) for r in c.ratios]
    if c.exact:
        out |= {"kept": 1.0, "kept_ci95": (1.0, 1.0), "meets_target": True}
    elif c.rows:
        n, kept = len(c.rows), sum(r["kept"] for r in c.rows)
        out |= {"confident": n, "kept": round(kept / n, 4), "kept_ci95": wilson(kept, n), **summarise_values(c.rows),
                "stopped": n < confident}  # after it could no longer reach the target
        out["meets_target"] = wilson(kept, n, digits=None)[0] >= cfg.target  # unrounded: 0.79969 misses 0.8
    else:
        out["meets_target"] = False
    return out


def record_of(result: dict, label: str) -> dict:
    """What the store keeps of a calibration for `label` (a row of `result`): the configuration,
    its figures and where, when and at which version they were measured."""
    from .. import __version__

    row = next(r for r in result["rows"] if r["label"] == label)
    keep = ("method", "recompute_ratio", "label", "exact", "kept", "kept_ci95", "confident", "value_agreement",
            "value_agreement_ci95", "value_kl", "ttft_ms", "ttft_vs_full")
    # a budget choice's own budget (the one the query spends) is kept apart from the calibration's limit
    return {**{k: row[k] for k in keep if k in row}, **({"query_ttft_budget": row["ttft_budget"]}
                                                        if row.get("ttft_budget") is not None else {}),
            "confident": row.get("confident", result["confident"]),
            "met_target": bool(row["meets_target"]), "target": result["target"], "ttft_budget": result["ttft_budget"],
            "questions": result["questions"], "top_k": result["top_k"], "full_ttft_ms": result["full_ttft_ms"],
            "costs": result.get("costs"),
            "device": result["device"], "machine": result["machine"], "measured_at": result["version"],
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "sparsecache": __version__}


def record(where, result: dict, label: str) -> int:
    """Publish the store's latest version again with `label`'s record as this device's
    calibration (the other devices' kept); returns the new version."""
    from ..store import Writer

    rec = record_of(result, label)
    with Writer(where) as w:
        from ..store.calibration import read_calibration
        from ..store.versions import read_manifest

        latest = read_manifest(w.backend)
        devices = {**read_calibration(w.backend, latest.version), result["device"]: rec}
        m = w.publish_calibration(devices, note=f"calibrated ({result['device']}): {label}")
    return m.version


def table_lines(result: dict) -> list[str]:
    """Every candidate, cheapest first: TTFT against full prefill's, kept with its interval, the
    value tokens' agreement; the choice marked."""
    lines = [f"{'':2}{'candidate':<18}{'TTFT':>8}{'x full':>8}  {'kept [95% CI]':<22}{'value top-1':>12}  note"]
    for r in sorted(result["rows"], key=lambda r: r["ttft_vs_full"]):
        mark = "=>" if r.get("chosen") else ""
        if r["exact"]:
            kept, note = "exact", "full prefill's computation"
        elif "kept_ci95" in r:
            lo, hi = r["kept_ci95"]
            kept, note = f"{r['kept']:.2f} [{lo:.2f}, {hi:.2f}] of {r['confident']}", ""
        else:
            kept, note = "-", "not measured"
        if not r["within_budget"]:
            note = f"over the TTFT budget ({result['ttft_budget']:g}x)"
        elif r.get("stopped") and any(x.get("chosen") and x["ttft_vs_full"] < r["ttft_vs_full"] for x in result["rows"]):
            note = "stopped: costs more than a candidate sure to meet the target"
        elif r.get("stopped"):
            note = f"stopped: cannot reach {result['target']:g}"
        elif not r["meets_target"] and not r["exact"] and "kept_ci95" in r:
            note = f"lower bound < {result['target']:g}"
        value = f"{r['value_agreement']:.3f}" if "value_agreement" in r else "-"
        lines.append(f"{mark:2}{r['label']:<18}{r['ttft_ms']:>7.0f}ms{r['ttft_vs_full']:>7.2f}x  {kept:<22}{value:>12}  "
                     f"{note}".rstrip())
    return lines


def other_lines(result: dict) -> list[str]:
    """The other variant's table and what it says (`other_variant`), or nothing."""
    other = result.get("other")
    if not other:
        return []
    how = "--wrapper none" if other["wrapper"] == "none" else f"--wrapper {other['wrapper']}"
    lines = ["", f"the store encoded the other way ({how}; {other['chunks']} chunks encoded on their own, not recorded):",
             *table_lines({**result, "rows": other["rows"]})[1:]]
    mine = next((r for r in result["rows"] if r["label"] == result["chosen"]), None)
    theirs = next((r for r in other["rows"] if r["label"] == other["chosen"]), None)
    if theirs is not None and (mine is None or theirs["ttft_vs_full"] < mine["ttft_vs_full"]):
        lines.append(f"re-encoding the store with {how} would meet the target with {theirs['label']} at "
                     f"{theirs['ttft_vs_full']:.2f}x full prefill's TTFT")
    return lines


def summary_line(result: dict) -> str:
    """The outcome in one line."""
    head = (f"{result['questions']} cloze questions, full prefill confident on {result['confident']}, "
            f"TTFT {result['full_ttft_ms']:.0f} ms for full prefill on {result['machine']} ({result['device']})")
    if result["met"]:
        return f"{head}; chosen: {result['chosen']} (the cheapest whose lower bound of kept reaches {result['target']:g})"
    best = result["best"] or "none measured"
    need = _confident_needed(result["target"])
    return (f"{head}; no candidate within {result['ttft_budget']:g}x full prefill's TTFT reaches a lower bound of "
            f"kept of {result['target']:g} (that takes at least {need} confident questions all kept); best: {best}")


def _confident_needed(target: float, z: float = 1.96) -> int | str:
    """The fewest confident questions, all kept, whose Wilson lower bound reaches `target`."""
    if target >= 1:
        return "infinitely many"
    return math.ceil(z * z * target / (1 - target))


__all__ = ["CalibrateConfig", "Candidate", "calibrate", "calibration_line", "grid", "other_lines", "other_variant",
           "record", "record_of", "summary_line", "table_lines"]


def calibrate_store(store, cfg: CalibrateConfig = CalibrateConfig(), model: str = "default", device: str = "cpu",
                    dtype: str = DTYPE, progress: bool = True) -> dict:
    """`sparsecache calibrate`: open `store` (refused before the model loads where it holds no
    documents), measure `cfg`'s candidates (`calibrate`) and, where one meets the target (or
    `cfg.accept_best` names the best), record it (`record`): the result, with `recorded_version`
    and `recorded` where something was recorded."""
    from ..kvstore.view import KVStore
    from .session import Session

    kv = KVStore.open(store)
    require_documents(kv)  # before the model loads
    result = calibrate(Session(kv, model, device, dtype=dtype), cfg, progress=progress)
    label = result["chosen"] or (result["best"] if cfg.accept_best else None)
    if label is not None:
        result["recorded_version"] = record(store, result, label)
        result["recorded"] = record_of(result, label)
    return result


def report_lines(result: dict) -> list[str]:
    """`calibrate_store`'s result as the CLI prints it: the table, the other variant, the outcome,
    the time and what was recorded."""
    secs = result["seconds"]
    lines = table_lines(result) + other_lines(result) + [
        "", summary_line(result), f"measured in {sum(secs.values()) / 60:.1f} min (full prefill's answers "
        f"{secs['reference']:.0f} s, TTFT {secs['ttft']:.0f} s, fidelity {secs['fidelity']:.0f} s"
        + (f", the other variant {secs['other_variant']:.0f} s" if "other_variant" in secs else "") + ")"]
    if "recorded" in result:
        lines.append(f"recorded as version {result['recorded_version']} for {result['device']}: "
                     + calibration_line(result["recorded"]))
    else:
        lines.append("nothing recorded (--accept-best records the best candidate anyway)")
    return lines


def recalibrate(store, model: str = "default", device: str = "cpu", progress: bool = True) -> dict:
    """`encode-corpus --calibrate`: `calibrate_store` again with the last calibration's target,
    budget, questions and k for this kind of device (CalibrateConfig's defaults where there is none)."""
    from ..store import Store

    last = device_record(Store.open(store).calibration(), device) or {}
    cfg = CalibrateConfig(**{k: last[k] for k in ("target", "ttft_budget", "questions", "top_k") if k in last})
    return calibrate_store(store, cfg, model, device, progress=progress)
