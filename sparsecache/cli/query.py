"""`query`: answer a question from a store, with the TTFT breakdown."""

from __future__ import annotations

import click

from sparsecache.query import cheap, methods
from sparsecache.query.calibrate import CalibrateConfig
from sparsecache.query.config import MAX_NEW_TOKENS, METHODS, ORDERS, REORDERS, TOP_K, QueryConfig
from sparsecache.query.methods.base import GATE_MAX_RATIO

from .options import (device_option, dtype_option, emit, fields_of, json_option, library_errors, model_option,
                      resolve_device)


@click.command("query")
@click.argument("store", metavar="STORE")  # a directory or an s3://, gs://, az:// URL
@click.argument("question")
@click.option("--top-k", default=TOP_K, show_default=True, help="Chunks to retrieve.")
@click.option("--method", type=click.Choice(METHODS), default=None,
              help=methods.summaries() + f"  [default: the store's choice for this device where `sparsecache calibrate` "
              f"measured one (`info` shows it), else {QueryConfig.method}]")
@click.option("--recompute-ratio", type=float, default=None,
              help="Fraction of chunk tokens to recompute (default: what --ttft-budget buys, else the method's own, "
                   + methods.ratios() + ").")
@click.option("--ttft-budget", type=float, default=QueryConfig.ttft_budget, show_default=True,
              help="With no --recompute-ratio, recompute the share of chunk tokens whose predicted TTFT is this "
                   "fraction of full prefill's, by the context's length (a cost model measured per kind of device; "
                   "on a device with none measured, the method's own ratio). The answer says the ratio used.")
@click.option("--group-window", default=QueryConfig.group_window, show_default=True, help="CacheClip grouping window (1 = off).")
@click.option("--group-min", default=QueryConfig.group_min, show_default=True,
              help="0: recompute the windows with most score mass up to the budget; M > 0: CacheClip's rule, "
                   "windows holding at least M selected tokens.")
@click.option("--score-layer", type=int, default=None, help="Layer the scorer reads (default: a3/cacheblend 1, "
              "infoflow 3/4 of the depth).")
@click.option("--max-new-tokens", default=MAX_NEW_TOKENS, show_default=True)
@click.option("--chunks", "chunk_list", default=None, help="Comma-separated chunk ids: skip retrieval.")
@click.option("--order", type=click.Choice(ORDERS), default=QueryConfig.order, show_default=True,
              help="Context order: given (best chunk first) or reverse (best chunk next to the question; "
                   "measured better on needle tasks).")
@click.option("--reorder", type=click.Choice(REORDERS), default=QueryConfig.reorder, show_default=True,
              help="attention: order chunks by the question's attention to each (scored alone, so retrieval "
                   "rank does not bias it), most important next to the question (InfoFlow).")
@click.option("--cake-split", type=int, default=None,
              help="cake: recompute exactly this many leading chunks (default: the two threads meet where they meet).")
@click.option("--selector-model", type=click.Path(exists=True, file_okay=False), default=None,
              help="cacheclip: a small local HF model with the same tokenizer whose full-context pass picks the "
                   "tokens to recompute (default: the main model's first --selector-layers layers).")
@click.option("--selector-layers", type=int, default=None,
              help="cacheclip: layers of the selector to run (default: all of --selector-model's, or a quarter "
                   "of the main model's).")
@click.option("--paths", type=click.IntRange(min=1), default=None,
              help="superposition: chunks kept, those whose own path makes the question likeliest (default "
                   f"{methods.get('superposition').paths}; with 1 and --recompute-ratio 0 the answer continues that "
                   "path's cache).")
@click.option("--prefill-under", type=click.IntRange(min=0), default=None,
              help="Prefill contexts of fewer retrieved tokens instead of reading them from the store, where that is "
                   "cheaper (whatever --method says). " + cheap.rule_text())
@click.option("--gate-coverage", type=click.FloatRange(0, 1, min_open=True), default=QueryConfig.gate_coverage,
              help="Confidence gate: a scorer recomputes more, up to " + f"{GATE_MAX_RATIO:g}" + " times its ratio, until "
                   "its tokens hold this share of its scores over the chunks (for infoflow the question's attention). "
                   "[default: off]")
@click.option("--gate-margin", type=click.FloatRange(min=0), default=QueryConfig.gate_margin,
              help="Confidence gate: prefill instead where the blended context's first token leads the runner-up by "
                   "less than this many nats (the answer says so; its TTFT counts both). [default: off]")
@click.option("--compare", is_flag=True,
              help="Also answer by full prefill of the same chunks (no cache) and say whether the answers agree.")
@click.option("--cuda-graphs", "graphs", is_flag=True,
              help="Run the fixed passes (the question's, the scoring pass, the recompute) on a static workspace, "
                   "padded to a few sizes and captured as CUDA graphs on a GPU (experimental; a query's first "
                   "passes at a new size capture). [default: off]")
@model_option
@device_option
@dtype_option
@json_option
@library_errors
def query_cmd(store, question, top_k, max_new_tokens, chunk_list, compare, graphs, model_path, device, dtype, as_json,
              **options):
    """Answer QUESTION from STORE: retrieve, decode, restore positions, recompute, generate.

    Prints the answer, the chunks used and where the time to first token went.
    """
    from sparsecache.query.session import ask

    # the options map onto QueryConfig by name; no --method: None, the store's calibrated choice (`Session.configured`)
    cfg = QueryConfig(**fields_of(QueryConfig, options))
    chunks = [c.strip() for c in chunk_list.split(",") if c.strip()] if chunk_list else None
    a, ref = ask(store, question, cfg, model=model_path, device=resolve_device(device), dtype=dtype, top_k=top_k,
                 chunks=chunks, max_new_tokens=max_new_tokens, compare=compare, graphs=graphs)
    t = a.timings_ms
    lines = [a.answer, "", "chunks:"]
    lines += [f"  {c['id']}  {c['doc_id']}#{c['ordinal']}" + (f"  {c['score']:.3f}" if c["score"] is not None else "")
              + ("" if c["id"] in a.context_ids else "  (not used: its path scored lower)") for c in a.chunks]
    ratio = "" if a.recompute_ratio is None else f" (r = {a.recompute_ratio:g})"
    lines += ["", f"TTFT {t['ttft']:.1f} ms ({a.method}, {a.context_tokens} context tokens, "
                  f"{a.recomputed_tokens} recomputed{ratio}, {a.bytes_read:,} bytes read):",
              "  " + "  ".join(f"{k} {t[k]:.1f}" for k in t if k not in ("ttft", "generate")),
              f"  then {t['generate']:.1f} ms to generate the rest"]
    if a.prefilled_under:
        lines += [f"  (prefilled: the retrieved chunks hold fewer than {a.prefilled_under} tokens, where prefilling "
                  "costs less than the store path; --prefill-under 0 reads the store)"]
    result = a.to_dict()
    if ref is not None:
        result["full_prefill"] = {k: v for k, v in ref.items() if k != "tokens"}
        agree = round(ref["token_agreement"] * ref["tokens"])
        lines += ["", f"full prefill of the same chunks (no cache, {ref['context_tokens']} context tokens), "
                        f"TTFT {ref['ttft_ms']:.1f} ms:", ref["answer"],
                  "", "same answer as full prefill: " + ("yes" if ref["same_answer"] else "no")
                  + f"; along its answer, {agree} of {ref['tokens']} next tokens agree ({ref['token_agreement']:.0%})",
                  ttft_ratio(t["ttft"], ref["ttft_ms"])]
    emit(result, as_json, lines)


def ttft_ratio(ours_ms: float, full_ms: float) -> str:
    """How our TTFT compares with full prefill's, always as a factor >= 1 in the right direction."""
    if not ours_ms or not full_ms:
        return ""
    if ours_ms <= full_ms:
        return f"TTFT {full_ms / ours_ms:.1f}x lower than full prefill"
    return f"TTFT {ours_ms / full_ms:.1f}x higher than full prefill (slower)"


def calibrate_options(f):
    """`calibrate`'s measuring options (CalibrateConfig's defaults)."""
    for option in reversed((
        click.option("--target", type=float, default=CalibrateConfig.target, show_default=True,
                     help="The lower bound (95% Wilson interval) of kept a choice must reach: the share of the answers "
                          "full prefill gives with confidence that the configuration gives too. In (0, 1]; 1 chooses an "
                          "exact configuration."),
        click.option("--ttft-budget", type=float, default=CalibrateConfig.ttft_budget, show_default=True,
                     help="The most TTFT a choice may take, as a fraction of full prefill's on this device (full "
                          "prefill itself is 1; recomputing everything costs more)."),
        click.option("--questions", type=click.IntRange(min=1), default=CalibrateConfig.questions, show_default=True,
                     help="Cloze questions drawn from the store's documents. Reaching a target t takes at least "
                          "3.84 t / (1 - t) confident ones, all kept (73 for 0.95)."),
        click.option("--candidates", default=None,
                     help="Configurations to measure, as `bench fidelity --methods` names them (e.g. "
                          "'none,infoflow:0.1,cacheblend:0.25'); full prefill is always one.  [default: full; none; "
                          "infoflow at 0.05, 0.1, 0.15, 0.25, 0.5, at the ratio query's default TTFT budget buys "
                          f"(infoflow+ttft_budget={QueryConfig.ttft_budget:g}) and at 1.0 on a store without a "
                          "wrapper; a3, cacheblend and cacheclip at 0.15]"),
        click.option("--timing-questions", type=click.IntRange(min=1), default=CalibrateConfig.timing_questions,
                     show_default=True, help="Questions every candidate's TTFT is measured on, after one warm-up."),
        click.option("--compare-wrapper", default=None,
                     help="Also measure the store encoded the other way, on a temporary twin of the questions' "
                          "chunks (reported, never recorded: re-encode to use it): 'none' for a wrapped store's plain "
                          "variant, 'shipped' or a learn-wrapper directory for a plain store's wrapped one. Adds the "
                          "twin's encode of the questions' chunks and its measurements."),
        click.option("--accept-best", is_flag=True,
                     help="Where no candidate reaches --target, record the best one anyway (default: record nothing)."),
    )):
        f = option(f)
    return f


@click.command("calibrate")
@click.argument("store", metavar="STORE")  # a directory or an s3://, gs://, az:// URL
@calibrate_options
@click.option("--top-k", default=TOP_K, show_default=True, help="Chunks each question retrieves, as `query --top-k`.")
@model_option
@device_option
@dtype_option
@json_option
@library_errors
def calibrate_cmd(store, model_path, device, dtype, as_json, **options):
    """Measure how well each query configuration keeps full prefill's answers on STORE's own
    text, and record the cheapest that meets --target as the store's choice for this device.

    Cloze questions are drawn from the store's documents (a sentence with a distinctive span,
    the answer begun with the sentence up to it) and asked with retrieval. Full prefill answers
    each; every candidate's TTFT is measured on this device against full prefill's, and each one
    within --ttft-budget is run on the questions full prefill answers with confidence. The choice
    is the lowest-TTFT candidate whose 95% lower bound of kept reaches --target; it is published
    as a new version's calibration, which `query`, `Session` and `serve` then use whenever no
    method is named (`info` shows it). A choice is kept per kind of device: one measured on a CPU
    is not used on a GPU.

    Time: it answers every question by full prefill once, times the candidates and measures
    their fidelity, so it costs a few full-prefill queries per question; candidates that can no
    longer reach the target are dropped as it goes (the manual's "Choosing a configuration"
    page gives measured times).
    """
    from sparsecache.query.calibrate import calibrate_store, report_lines

    cfg = CalibrateConfig(**fields_of(CalibrateConfig, options))  # the options map onto CalibrateConfig by name
    result = calibrate_store(store, cfg, model_path, resolve_device(device), dtype, progress=not as_json)
    emit(result, as_json, report_lines(result))
