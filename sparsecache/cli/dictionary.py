"""`check-model`, `learn-dict`, `eval-dict` and `learn-wrapper`: the per-model artifacts."""

from __future__ import annotations

import click

from sparsecache.bench.config import EvalConfig
from sparsecache.codec.codes import COEF_DTYPE_NAMES
from sparsecache.codec.config import ATOM_DTYPE_NAMES, DictConfig, TrainConfig
from sparsecache.wrapper.config import QUESTION_SOURCES, WrapperConfig

from .options import (device_option, emit, exact_omp_option, forward_dtype_option, json_option, library_errors,
                      model_option, resolve_device, screening)


@click.command("check-model")
@click.argument("model_path", default="default")
@device_option
@json_option
@library_errors
def check_model_cmd(model_path, device, as_json):
    """Check that sparsecache captures and places MODEL's K/V correctly (run it before learn-dict).

    MODEL is 'default', a packaged model's name (qwen2.5-coder-0.5b), a local HuggingFace model
    directory or a .gguf file, as --model takes. Three checks, fp32, on a short
    held-out text: (a) captured keys, rotated to their positions, and values equal the model's
    own cache; (b) per-chunk K/V at global positions with every chunk token recomputed equals
    full prefill's logits; (c) one chunk's K/V after the prefix, nothing recomputed, equals
    full prefill. Exit 1 if any fails. learn-dict and encode-corpus run it once per model; the
    result is kept in the user cache, and this command replaces it.
    """
    from sparsecache.model.check import check_model, record_check
    from sparsecache.model.kvmodel import load_model

    result = check_model(load_model(model_path, device=resolve_device(device)))
    record_check(result)
    emit(result.to_dict(), as_json, [
        f"{result.model} ({result.fingerprint['layers']} layers, m = {result.fingerprint['m']})",
        *(f"  {'ok  ' if c.passed else 'FAIL'} {c.name:<14} error {c.error:.1e} (tolerance {c.tolerance:.0e})  {c.what}"
          for c in result.checks),
        "passed" if result.passed else "FAILED: sparsecache would store this model's K/V wrongly",
    ])
    if not result.passed:
        raise SystemExit(1)


@click.command("learn-dict")
@model_option
@click.option("--text", "texts", multiple=True, default=("builtin",), show_default=True,
              help="Calibration text: files, directories of .txt/.md/.rst, or 'builtin' (Python's docs). Repeatable.")
@click.option("--atoms", type=int, default=None, help=f"Atoms per dictionary (2..65536).  [default: {DictConfig.atoms}]")
@click.option("--sparsity", type=int, default=None, help=f"Atoms per coded signal (s).  [default: {DictConfig.sparsity}]")
@click.option("--layers-per-signal", type=int, default=None,
              help=f"Consecutive layers per signal (L); must divide the layer count.  [default: {DictConfig.layers_per_signal}]")
@click.option("--init", "init_dict", type=click.Path(exists=True, file_okay=False), default=None,
              help="Continue from this dictionary (e.g. a shipped one) on your --text: its atoms, sizes and "
              "per-layer scales are kept (--sparsity may differ: a code's atom count is not part of the atoms); "
              "the result is never worse than it on the held-out part of --text.")
@click.option("--steps", default=TrainConfig.steps, show_default=True, help="Training steps (early stopping may end sooner).")
@click.option("--batch", default=TrainConfig.batch, show_default=True, help="Signals per step, per K and per V.")
@click.option("--lr", default=TrainConfig.lr, show_default=True, help="Peak learning rate of K (cosine decay).")
@click.option("--lr-v", default=TrainConfig.lr_v, show_default=True, help="Peak learning rate of V (V is noisier).")
@click.option("--max-tokens", default=TrainConfig.max_tokens, show_default=True, help="Calibration tokens to extract.")
@click.option("--seed", default=TrainConfig.seed, show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory (atoms.safetensors + dictionary.json).")
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --out.")
@click.option("--atoms-dtype", type=click.Choice(ATOM_DTYPE_NAMES), default=None,
              help="How the atoms file stores them (training is float32 either way). float16 halves the file "
                   f"at no measured cost in quality.  [default: --init's, else {TrainConfig.atoms_dtype}]")
@device_option
@library_errors
def learn_dict_cmd(model_path, texts, init_dict, out, resume, device, **settings):
    """Learn global K and V dictionaries for a model (batched OMP + gradient dictionary update).

    Checkpoints into OUT/checkpoint every validation; --resume continues from there.
    With --init, adapts an existing dictionary to --text (a few hundred steps; see docs/how-to/another-model.md).
    """
    from sparsecache.codec.dictionary import Dictionary
    from sparsecache.codec.learn import learn_config, learn_dict
    from sparsecache.model.check import ensure_checked
    from sparsecache.model.kvmodel import load_model

    init = Dictionary.load(init_dict) if init_dict else None
    config, tcfg = learn_config(init, **settings)  # DictConfig's and TrainConfig's fields, by name
    device = resolve_device(device)
    model = load_model(model_path, device=device)  # calibration KV is computed where the OMP runs
    ensure_checked(model)
    d = learn_dict(model, texts, config, tcfg, out, device, resume, init=init)
    h = d.meta["heldout_nmse"]
    click.echo(f"wrote {out}: held-out NMSE K {h['k']:.4f}  V {h['v']:.4f}")


@click.command("eval-dict")
@click.argument("dictionary", type=click.Path(exists=True))
@model_option
@click.option("--text", "texts", multiple=True, default=("builtin",), show_default=True,
              help="Evaluation text ('builtin' = the held-out split of Python's docs). Repeatable: each "
                   "--text is a domain, reported on its own; the headline figures are the worst domain's.")
@click.option("--passages", type=click.IntRange(min=1), default=EvalConfig.passages, show_default=True,
              help="Prefix/continuation passages per domain.")
@click.option("--prefix-tokens", default=EvalConfig.prefix_tokens, show_default=True)
@click.option("--continuation-tokens", default=EvalConfig.continuation_tokens, show_default=True)
@click.option("--coef", type=click.Choice(COEF_DTYPE_NAMES), default=EvalConfig.coef_dtype, show_default=True,
              help="Coefficient format the codes are rounded to (a store writes float8 by default).")
@click.option("--first-layer", type=click.Choice(["tokens", "codes"]), default=EvalConfig.first_layer,
              show_default=True, help="Layer 0's K/V as a store's reader gets it: from the tokens (exact; what queries "
                                      "do) or decoded from the codes like every other layer.")
@click.option("--record", is_flag=True, help="Also write the report into the dictionary's metadata ('eval').")
@exact_omp_option
@forward_dtype_option
@device_option
@json_option
@library_errors
def eval_dict_cmd(dictionary, model_path, texts, passages, prefix_tokens, continuation_tokens, coef, first_layer,
                  record, exact_omp, forward_dtype, device, as_json):
    """Fidelity of a dictionary: NMSE, perplexity, KL and top-1 agreement on held-out text.

    Each passage is the model's chat prefix (kept exact, as a store keeps it), then
    --prefix-tokens tokens whose K/V go through encode+decode, then --continuation-tokens
    tokens scored with the exact vs the reconstructed context.
    """
    from sparsecache.bench.evaluate import eval_dict, report_lines

    cfg = EvalConfig(passages=passages, prefix_tokens=prefix_tokens, continuation_tokens=continuation_tokens,
                     coef_dtype=coef, screening=screening(exact_omp), first_layer=first_layer,
                     forward_dtype=forward_dtype)
    r = eval_dict(dictionary, model_path, texts, cfg, record=record, device=resolve_device(device))
    emit(r, as_json, report_lines(r))


W = WrapperConfig()


@click.command("learn-wrapper")
@model_option
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory (wrapper.safetensors + wrapper.json, curve.json/.png, checkpoint, prompts).")
@click.option("--header", default=W.header, show_default=True, help="Soft tokens before every chunk.")
@click.option("--trailer", default=W.trailer, show_default=True, help="Soft tokens after every chunk.")
@click.option("--linked", is_flag=True, default=W.linked,
              help="Learn the trailer as link tokens: every query recomputes each chunk's trailer after all the "
                   "chunks before it (KVLink's, the model frozen), and learning does the same; a store encoded "
                   "with it does so whatever the method. Needs --trailer >= 1. [default: off]")
@click.option("--steps", default=W.steps, show_default=True, help="Training steps (one prompt each).")
@click.option("--lr", default=W.lr, show_default=True, help="Adam's peak learning rate (warm-up, cosine decay).")
@click.option("--k", default=W.k, show_default=True, help="Chunks per training prompt.")
@click.option("--prompts", default=W.prompts, show_default=True, help="Distinct training prompts, cycled.")
@click.option("--text-share", default=W.text_share, show_default=True,
              help="Share of prompts that continue calibration text rather than answer a question.")
@click.option("--questions", type=click.Choice(QUESTION_SOURCES), default=W.questions, show_default=True,
              help="Where question prompts come from: specimens+cloze (synthetic specimen logs from a generator no "
                   "evaluation uses, and cloze over the calibration text's train part: nothing a benchmark reads) "
                   "or fidelity-train (the fidelity suite's train split, how the first shipped wrapper was learned).")
@click.option("--eval-every", default=W.eval_every, show_default=True,
              help="Steps between learning-curve points and checkpoints.")
@click.option("--eval-questions", default=W.eval_questions, show_default=True,
              help="Dev-split questions (and up to 10 held-out text prompts) per learning-curve point.")
@click.option("--seed", default=W.seed, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --out.")
@device_option
@library_errors
def learn_wrapper_cmd(model_path, out, resume, device, **settings):
    """Learn a chunk wrapper for a model: soft tokens around every chunk, the model frozen.

    Every chunk is encoded as `prefix | header | chunk | trailer`; the header and trailer
    vectors are learned by self-distillation (KV Packet): the model reading k independently
    encoded wrapped chunks, nothing recomputed, is fitted (KL divergence on the answer's
    tokens) to the same model's full prefill of the k chunks and the question. Training
    prompts come from sources no benchmark reads (--questions) and from the built-in
    calibration text's continuations; the learning curve (dev
    split, `none` with the wrapper against full prefill) goes to OUT/curve.json and curve.png.
    Checkpoints every --eval-every steps; --resume continues.
    """
    from sparsecache.model.kvmodel import load_model
    from sparsecache.wrapper.learn import learn_wrapper

    cfg = WrapperConfig(**settings)  # the options are WrapperConfig's fields, by name
    model = load_model(model_path, device=resolve_device(device))
    w = learn_wrapper(model, out, cfg, resume=resume)
    e = w.meta["eval"]
    click.echo(f"wrote {out}: dev split, {e['final']['questions']} questions, none with the wrapper: correct vs full "
               f"{e['final']['correct_vs_full']:.2f} (without: {e['plain']['correct_vs_full']:.2f}), token agreement "
               f"{e['final']['token_agreement']:.3f} (without: {e['plain']['token_agreement']:.3f}); held-out text "
               f"perplexity {e['final']['text_ppl']:.2f} (without: {e['plain']['text_ppl']:.2f})")
