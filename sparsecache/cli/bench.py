"""`bench` commands: measurements with stable output."""

import json

import click

from sparsecache.bench.config import FrontierConfig
from sparsecache.bench.fidelity import FORMATS, SPLIT
from sparsecache.bench.scale import ScaleConfig
from sparsecache.kvstore.index_config import INDEX_KINDS
from sparsecache.measure.cloze import CLOZE_CHUNK_TOKENS, CLOZE_CORPUS
from sparsecache.measure.suite import ENTITIES, FILLER_SENTENCES, SPLITS

from .options import (device_option, dtype_option, emit, int_list, json_option, library_errors, model_option,
                      require_vllm, resolve_device)


@click.group()
def bench():
    """Benchmarks that print (and with --json emit) their measurements."""


@bench.command("omp")
@click.option("--dict", "dict_path", type=click.Path(exists=True), default=None,
              help="Dictionary to code with (default: normalised data samples as atoms).")
@click.option("--atoms", default=8192, show_default=True)
@click.option("--sparsity", default=16, show_default=True)
@click.option("--n", "count", default=8192, show_default=True, help="Signals coded by Batch-OMP.")
@click.option("--sklearn-n", type=click.IntRange(min=1), default=64, show_default=True,
              help="Signals coded by scikit-learn (it is slow), for the reference check and speedup.")
@click.option("--kind", type=click.Choice(["k", "v"]), default="k", show_default=True)
@click.option("--layers-per-signal", "layers", default=1, show_default=True,
              help="Signal size L·192 when no --dict is given (a dictionary brings its own).")
@device_option
@json_option
@library_errors
def omp_cmd(dict_path, atoms, sparsity, count, sklearn_n, kind, layers, device, as_json):
    """Batch-OMP vs scikit-learn's orthogonal_mp_gram on the same real KV signals (m = L·192).

    On a GPU it also times every torch formulation (GEMM correlations in fp32/fp16/bf16,
    Gram-row Batch-OMP) and the fused CPU kernel on the same machine."""
    from sparsecache.bench.codec import bench_omp

    r = bench_omp(dict_path, atoms, sparsity, count, sklearn_n, kind, resolve_device(device), layers)
    forms = [f"  {name:<20} {f['vectors_per_s']:>12,.0f} signals/s  batch {f['batch']:>5}  "
             f"residual {f['residual_vs_gemm_fp32']:.4f} of gemm-float32" for name, f in r.get("formulations", {}).items()]
    if "cpu_kernel_vectors_per_s" in r:
        forms.append(f"  {'cpu kernel (numba)':<20} {r['cpu_kernel_vectors_per_s']:>12,.0f} signals/s")
    emit(r, as_json, [
        f"device {r['device']}  atoms {r['atoms']}  dim {r['dim']}  sparsity {r['sparsity']}",
        f"batch_omp  {r['vectors_per_s']:>12,.0f} signals/s",
        f"torch path {r['torch_path_vectors_per_s']:>12,.0f} signals/s   (vectorised torch ops; used on GPUs)",
        f"sklearn    {r['sklearn_vectors_per_s']:>12,.1f} signals/s   speedup {r['speedup']:,.0f}x",
        f"decode     {r['decode_vectors_per_s']:>12,.0f} signals/s",
        f"residual vs sklearn (same signals): {r['residual_ratio_vs_sklearn']:.4f} (<= 1 means ours is as good)",
        *index_coding_lines(r["index_coding"]),
        *(["formulations on this device:"] + forms if forms else []),
    ])


@bench.command("decode")
@click.option("--store", "store_path", default="bench-store/store", show_default=True,
              type=click.Path(file_okay=False), help="A store (bench store makes one).")
@click.option("--chunks", "n_chunks", default=32, show_default=True, help="Longest chunks decoded together.")
@device_option
@json_option
@library_errors
def decode_cmd(store_path, n_chunks, device, as_json):
    """Decode speed of retrieved chunks (codes already on the device) against a device-to-device
    copy of the same bytes; on a CPU side by side with the embedding_bag decode other devices run."""
    from sparsecache.bench.storage import bench_decode

    r = bench_decode(store_path, n_chunks, resolve_device(device))
    emit(r, as_json, [
        f"decode {r['chunks']} chunks ({r['tokens']} tokens, {r['signals']:,} signals) on {r['device']}: "
        f"{r['decode_ms']:.2f} ms = {r['signals_per_s']:,.0f} signals/s",
        f"K/V written {r['kv_bytes'] / 1e6:.0f} MB: {r['kv_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(a copy of the same bytes moves {r['copy_bytes_per_s'] / 1e9:.0f} GB/s read+write; "
        f"fp32 GEMM {r['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s)",
    ] + ([f"embedding_bag (the decode before the CPU kernel), same codes, alternating: {r['embedding_bag_ms']:.0f} ms "
          f"-> {r['speedup_vs_embedding_bag']:.1f}x; largest relative difference {r['max_rel_diff_vs_embedding_bag']:.1e}"]
         if "embedding_bag_ms" in r else []))


def index_coding_lines(ic: dict) -> list[str]:
    return ["indices (bits per index; decoded per second, numpy / torch):",
            f"  packed       {ic['packed_bits_per_index']:5.2f}  {ic['packed_indices_per_s']:>13,.0f} / "
            f"{ic['packed_torch_indices_per_s']:,.0f}",
            f"  Elias-Fano   {ic['ef_bits_per_index']:5.2f}  {ic['ef_indices_per_s']:>13,.0f} / {ic['ef_torch_indices_per_s']:,.0f}",
            f"  Rice (k={ic['rice_k']})   {ic['rice_bits_per_index']:5.2f}  {ic['rice_indices_per_s']:>13,.0f}"]


@bench.command("encode")
@click.argument("corpus", nargs=-1)
@click.option("--workdir", default="bench-encode", show_default=True, type=click.Path(file_okay=False),
              help="Where the two stores go (replaced on every run).")
@device_option
@json_option
@library_errors
def encode_cmd(corpus, workdir, device, as_json):
    """encode-corpus of CORPUS (default: builtin:heldout, the demo corpus) with exact Batch-OMP and
    with the default screening, one after the other in this run: tokens/s, phases and code error."""
    from sparsecache.bench.storage import bench_encode

    r = bench_encode(workdir, corpus or ("builtin:heldout",), resolve_device(device))
    lines = [f"{name:>8}: {x['tokens']} tokens, {x['tokens_per_s']:.1f} tokens/s; "
             + ", ".join(f"{k} {v:.1f}s" for k, v in x["seconds"].items()) for name, x in r["runs"].items()]
    lines += [f"screened / exact: {r['speedup']:.2f}x; same chunks: {r['same_chunks']}; NMSE on {r['sampled_chunks']} "
              "chunks: " + ", ".join(f"{name} K {e['k']:.4f} V {e['v']:.4f}" for name, e in r["nmse_sampled_chunks"].items())]
    emit(r, as_json, lines)


@bench.command("store")
@click.option("--workdir", default="bench-store", show_default=True, type=click.Path(file_okay=False),
              help="Where the corpus, store and raw-KV baseline go (a store there is reused).")
@click.option("--chunks", "n_chunks", default=32, show_default=True, help="Chunks of ~512 tokens read per trial.")
@click.option("--repeats", default=5, show_default=True, help="Trials per figure (the median is reported).")
@click.option("--tokens", "min_tokens", default=20_000, show_default=True, help="Corpus size to encode.")
@device_option
@json_option
@library_errors
def store_cmd(workdir, n_chunks, repeats, min_tokens, device, as_json):
    """Encode throughput (and where the time goes), then reading chunks' codes from the store vs
    their raw fp16 KV from one .safetensors file per chunk (TurboRAG/LMCache style), warm and cold."""
    from sparsecache.bench.storage import bench_store

    r = bench_store(workdir, n_chunks, repeats, resolve_device(device), min_tokens)
    e = r["encode"]
    lines = [
        f"encode: {e['tokens']} tokens in {e['seconds']['total']:.0f} s = {e['tokens_per_s']:.1f} tokens/s on {r['device']}; "
        + ", ".join(f"{k} {v:.1f}s" for k, v in e["seconds"].items() if k != "total"),
        f"read {r['chunks']} chunks ({r['tokens']} tokens): codes {r['codes_bytes'] / 1e6:.1f} MB in {r['codes_files_touched']} files, "
        f"raw fp16 {r['raw_bytes'] / 1e6:.1f} MB in {r['raw_files_touched']} files ({r['codes_vs_raw_bytes']:.1f}x smaller)",
        f"  warm: codes {r['read_codes_warm_ms']:.1f} ms   raw {r['read_raw_warm_ms']:.1f} ms",
        f"  cold: codes {r['read_codes_cold_ms']:.1f} ms   raw {r['read_raw_cold_ms']:.1f} ms   ({r['cold_method']})",
        f"  decode on cpu: {r['decode_cpu_ms']:.1f} ms",
        "layouts (same codes):",
    ] + [f"  chunk {x['zarr_chunk_tokens']:>4} shard {str(x['shard_tokens']):>5} {x['compressor']:>4}: "
         f"zarr read {x['read_zarr_warm_ms']:.1f} ms, direct read "
         + (f"{x['read_direct_warm_ms']:.1f} ms" if x["read_direct_warm_ms"] is not None else "n/a")
         + f", disk/theory {x['disk_vs_theoretical']:.4f}, {x['files']} files" for x in r["layouts"]]
    emit(r, as_json, lines)


def suite_dict_option(f):
    return click.option("--dict", "dictionary", default=None, type=click.Path(file_okay=False),
                        help="Dictionary the suite's store is encoded with.  [default: the one shipped for "
                             "--model]")(f)


def suite_wrapper_option(f):
    return click.option("--wrapper", default=None,
                        help="Also encode the suite with this learned chunk wrapper (a `learn-wrapper` directory, or "
                             "'shipped') into WORKDIR/store-wrapped; methods ending in @wrapped (none@wrapped) "
                             "answer from it.  [default: none]")(f)


@bench.command("ruler")
@click.option("--workdir", default="bench-ruler", show_default=True, type=click.Path(file_okay=False),
              help="Where the suite, its store and results.json go; a rerun resumes there.")
@click.option("--tasks", default="single,multikey,multivalue,vartrack,cwe", show_default=True,
              help="Tasks, comma-separated.")
@click.option("--trials", default=20, show_default=True, help="Trials per task.")
@click.option("--k", "k", default=8, show_default=True, help="Chunks per trial.")
@click.option("--tokens-per-chunk", default=200, show_default=True)
@click.option("--methods", default="full,raw,none,a3,infoflow,cacheblend,cacheclip,infoflow+reorder,cake",
              show_default=True, help="Labels, or method:ratio (append +reorder to reorder by attention); "
              "append @wrapped to answer from the --wrapper store.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Write accuracy vs TTFT here (PNG), one panel per task.")
@suite_wrapper_option
@model_option
@suite_dict_option
@device_option
@json_option
@library_errors
def ruler_cmd(workdir, tasks, trials, k, tokens_per_chunk, methods, plot, wrapper, model_path, dictionary, device,
              as_json):
    """A RULER-style suite over k retrieved chunks: single and multi-key needles, multi-value
    needles, variable tracking and common-words extraction, generated with a seed from
    held-out text. Every method on the same trials: accuracy with its Wilson 95% interval,
    recall, mean TTFT."""
    from sparsecache.bench.ruler import plot_suite
    from sparsecache.bench.suite import bench_ruler
    from sparsecache.query.spec import parse_methods

    r = bench_ruler(workdir, [t.strip() for t in tasks.split(",") if t.strip()], trials, k, tokens_per_chunk,
                    parse_methods(methods), resolve_device(device), model_path, dictionary, wrapper)
    if plot:
        plot_suite(r["rows"], plot)
    emit(r, as_json, [f"{x['task']:>10} {x['label']:>16}  accuracy {x['accuracy']:.2f} "
                      f"[{x['interval95'][0]:.2f}, {x['interval95'][1]:.2f}]  recall {x['recall']:.2f}  "
                      f"ttft {x['ttft_ms']:.0f} ms" for x in r["rows"]])


@bench.command("fidelity")
@click.option("--workdir", default="bench-fidelity", show_default=True, type=click.Path(file_okay=False),
              help="Where the suite, its store and results.json go; a rerun resumes there.")
@click.option("--k", "ks", default="4,8", show_default=True, callback=int_list, help="Chunks per question, comma-separated.")
@click.option("--questions", default=100, show_default=True, help="Questions per k (a fifth need two chunks).")
@click.option("--split", type=click.Choice(SPLITS), default=SPLIT, show_default=True,
              help="Which questions: dev (tune on these) or test (measure a final choice once); the two share "
                   "no names or question phrasings.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Answer only the first N questions of each k (the suite stays the same): TTFT on a CPU, "
                   "where every method on every question takes hours.")
@click.option("--methods", default=None, help="Labels (gold: full prefill of the answer's chunks alone), or method:ratio "
              "with +reorder (reorder by attention) or +field=value (a QueryConfig field: superposition:0+paths=2), "
              "and @wrapped to answer from the --wrapper store; without :ratio the method's own ratio, or what "
              "a TTFT budget buys (infoflow+ttft_budget=0.5). "
              "Default: raw, none, infoflow at r = 0.15/0.3/0.5/1.0, with reordering at 0.15/0.3, a3 and cacheblend at 0.15.")
@click.option("--format", "format", type=click.Choice(FORMATS), default="entities", show_default=True,
              help="entities: questions about generated documents (the answer's chunks at random ranks among others); "
                   "records: timetables of look-alike services (--entities families; held out: never used to learn or "
                   "choose anything); cloze: spans (RFCs, versions, identifiers, numbers) blanked out of the sentences "
                   "of --corpus. records and cloze take their context from retrieval over the suite's store.")
@click.option("--corpus", default=CLOZE_CORPUS, show_default=True, help="cloze: the corpus whose sentences are asked.")
@click.option("--chunk-tokens", type=click.IntRange(min=16), default=CLOZE_CHUNK_TOKENS, show_default=True,
              help="cloze: tokens per chunk of --corpus's store.")
@click.option("--two-chunk", type=click.Choice(["placed", "retrieval"]), default=None,
              help="entities: a two-chunk question's context holds both its chunks at fixed ranks among retrieval's "
                   "look-alikes (placed), or is what retrieval returns (retrieval, #69's suites). Default: a "
                   "workdir's own, placed for a new one.")
@click.option("--confident-only", is_flag=True,
              help="Answer with the methods only the questions full prefill answers right with confidence: what kept "
                   "and the value-token figures read, at a fraction of the time (disagreement and accuracy then "
                   "describe those questions only).")
@click.option("--entities", type=click.IntRange(min=10), default=ENTITIES, show_default=True,
              help="Entities the documents describe (each also has a person's document), or with --format records "
                   "service families (3 look-alike services each): more hold more questions.")
@click.option("--filler", type=click.IntRange(0, 20), default=FILLER_SENTENCES, show_default=True,
              help="Sentences of filler per document: its length (14: ~300 tokens; 4: ~120), so full prefill can be "
                   "measured at context lengths where it is reliable for the model.")
@click.option("--shard", default=None, metavar="I/N",
              help="Answer only the questions whose index is I modulo N, question by question (full prefill and "
                   "every method before the next), into WORKDIR/results-I-of-N.json: shards run as parallel "
                   "processes, and a run cut short leaves complete rows. A later run without --shard merges "
                   "every shard's rows and reports them.")
@click.option("--resume", is_flag=True, help="With --shard: continue the shard's results file where it exists "
              "(without it an existing one is refused).")
@click.option("--seed", "seeds", multiple=True, type=click.Path(dir_okay=False),
              help="With --shard: a results file whose rows for the shard's questions count as done (repeatable).")
@suite_wrapper_option
@model_option
@suite_dict_option
@device_option
@json_option
@library_errors
def fidelity_cmd(workdir, ks, methods, shard, resume, seeds, wrapper, model_path, dictionary, device, as_json,
                 **suite):
    """Does the compressed path give full prefill's answers? Documents about fictional entities,
    one fact per question (some need two chunks), k chunks with the answer's at a random rank.
    The reference is full prefill of the same chunks. Per method, each with a 95% interval:
    kept (the share of the questions full prefill answers right with confidence, its chosen
    value tokens each >= 4x as likely as the runner-up, that the method answers right too),
    disagreement ((gains + losses) / questions), top-1 agreement and KL at the answer's value
    tokens teacher-forced along full prefill's answer, for a method that drops chunks how often
    it kept the needed ones; then correct answers relative to full prefill's (capped at 1),
    same first sentence, accuracy, mean TTFT, and full prefill's accuracy by context length.
    The label `gold` answers from the answer's own chunks alone."""
    from sparsecache.bench.fidelity import line, parse_configs
    from sparsecache.bench.suite import Shard, bench_fidelity

    if (resume or seeds) and shard is None:
        raise click.UsageError("--resume and --seed go with --shard (a run without one resumes results.json)")
    suite["shard"] = Shard.parse(shard, resume, seeds) if shard else None

    # the suite's options (questions, split, limit, format, corpus, chunk_tokens, entities, filler) by name
    r = bench_fidelity(workdir, ks, methods=parse_configs(methods) if methods else None, device=resolve_device(device),
                       model_path=model_path, dictionary=dictionary, wrapper=wrapper, **suite)
    emit(r, as_json, [line(x["k"], x["label"], x) for x in r["rows"]]
         + [f"k={b['k']} full prefill at {b['tokens'][0]}-{b['tokens'][1]} context tokens: correct {b['correct']:.2f}, "
            f"confident {b['confident']:.2f} ({b['questions']} questions)" for b in r["full_by_context_length"]])


@bench.command("ttft")
@click.option("--store", "store_path", default="bench-store/store", show_default=True,
              type=click.Path(file_okay=False), help="A store with >= 32 chunks of 480-512 tokens (bench store makes one).")
@click.option("--k", "ks", default="2,4,8,16,32", show_default=True, callback=int_list, help="Chunk counts, comma-separated.")
@click.option("--repeats", default=2, show_default=True)
@click.option("--cold/--no-cold", default=True, show_default=True, help="Also measure the largest k with evicted files.")
@click.option("--busy", is_flag=True,
              help="Measure with another CPU-heavy process running (torch matrix products on every core).")
@click.option("--min-chunk-tokens", default=480, show_default=True,
              help="Use chunks of at least this many tokens (a store of shorter chunks measures shorter contexts).")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None, help="Write the PNG here.")
@device_option
@dtype_option
@json_option
@library_errors
def ttft_cmd(store_path, ks, repeats, cold, busy, min_chunk_tokens, plot, device, dtype, as_json):
    """TTFT breakdown of full / raw / none / a3 / infoflow / cacheblend (r = 0.15) vs chunk count."""
    from sparsecache.bench.ttft import bench_ttft, plot_ttft
    from sparsecache.query.session import STEPS

    r = bench_ttft(store_path, ks, repeats, resolve_device(device), cold, busy, min_chunk_tokens, dtype)
    if plot:
        plot_ttft(r, plot)
    emit(r, as_json, [f"k={x['k']:<3} {x['method']:>10} {x['page_cache']}: ttft {x['ttft']:.0f} ms  "
                      + " ".join(f"{s} {x[s]:.0f}" for s in STEPS) + f"  bytes {x['bytes_read']:,}"
                      for x in r["rows"]])


@bench.command("shapes")
@click.option("--shape", "shapes", default="smollm2-135m,qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b", show_default=True,
              help="Comma-separated: model shapes with random weights (toy, smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, "
                   "llama-3.2-3b, llama-3.1-8b) or packaged models with their real weights and shipped dictionary "
                   "(default, qwen2.5-coder-0.5b).")
@click.option("--k", "ks", default="4,8,16", show_default=True, callback=int_list,
              help="Chunk counts, comma-separated.")
@click.option("--repeats", default=2, show_default=True)
@click.option("--workdir", default="bench-shapes", show_default=True, type=click.Path(file_okay=False),
              help="Where each shape's store goes (a rerun reuses it) and results.json (a rerun replaces the shapes it names and keeps the others).")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of TTFT as a fraction of full prefill's against model size.")
@click.option("--cuda-graphs/--no-cuda-graphs", "graphs", default=None,
              help="Also time the store's methods with their fixed passes (the question's, the scoring pass, the "
                   "recompute) as CUDA graphs, in each result's `graphed`. Default: on a GPU.")
@device_option
@dtype_option
@json_option
@library_errors
def shapes_cmd(shapes, ks, repeats, workdir, plot, graphs, device, dtype, as_json):
    """Where the store pays, by model size: TTFT against full prefill for model shapes.

    Each shape's model is built from its config with random weights in the device's dtype (only time
    is measured, and the output says so), with a random dictionary of the codec's shape for it; a
    store of ~512-token chunks of Python's documentation is encoded once into WORKDIR/SHAPE. Then
    full prefill, `none` and `infoflow` at the default ratio and at 0.25 are timed at each k, with
    the breakdown and the machine's limits beside (decode bytes/s against memory copy bandwidth,
    prefill FLOP/s against the measured matrix-product rate), the store's bytes per token against
    fp16, and where the store path and full prefill cross.
    """
    import json
    from pathlib import Path

    from sparsecache.bench.shapes import SHAPES, bench_shape, plot_shapes
    from sparsecache.durable import write_atomic
    from sparsecache.errors import ConfigError
    from sparsecache.model.kvmodel import query_dtype
    from sparsecache.model.packaged import PACKAGED

    names = [n.strip() for n in shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES and n not in PACKAGED and n != "default"]
    if unknown:
        raise ConfigError(f"--shape: unknown {', '.join(unknown)}; shapes: {', '.join(SHAPES)}; "
                          f"real models: default, {', '.join(PACKAGED)}")
    dev = resolve_device(device)
    saved = Path(workdir) / "results.json"
    # a rerun replaces the shapes it names and keeps the others, so shapes can be run one per invocation
    kept = [r for r in json.loads(saved.read_text()) if r["shape"] not in names] if saved.exists() else []
    results = []

    def save(done):
        Path(workdir).mkdir(parents=True, exist_ok=True)
        write_atomic(saved, json.dumps(kept + done, indent=1))

    for n in names:  # results.json after each shape (and before its optional parts): a later one that fails loses none
        results.append(bench_shape(n, workdir, ks, repeats, dev, query_dtype(dtype, dev), graphs=graphs,
                                   partial=lambda r: save(results + [r])))
        save(results)
    if plot:
        plot_shapes(kept + results, plot)
    lines = []
    for r in results:
        lines.append(f"{r['shape']} ({r['weights']} weights, {r['compute_parameters'] / 1e6:.0f}M compute parameters, "
                     f"{r['ratio_vs_fp16']:.1f}x smaller than fp16; crossover "
                     + ", ".join(f"{m} {'-' if c is None else f'{c:.0f}'}" for m, c in r["crossover_tokens"].items())
                     + " tokens)")
        lines += [f"  k={f['k']:<3} {f['method']:>9}:{f['ratio']:<4} {f['context_tokens']:>6} tokens  "
                  f"ttft {f['ttft_ms']:8.0f} ms  {f['of_full']:.2f}x full" for f in r["fractions"]]
        lines += [f"  k={g['k']:<3} {g['method']:>9}:{g['ratio']:<4} graphed        ttft {g['ttft']:8.0f} ms  "
                  f"{g['of_full']:.2f}x full" for g in r.get("graphed", {}).get("rows", [])]
    emit(results, as_json, lines)


@bench.command("quality")
@model_option
@click.option("--text", "texts", multiple=True, default=("builtin",), show_default=True,
              help="Held-out text for the fidelity passages ('builtin' = the held-out split of Python's docs). "
                   "Repeatable: each --text is a domain with its own passages; rows give the mean over domains and "
                   "the worst domain, and the default is chosen on the worst.")
@click.option("--config", "configs", multiple=True, metavar="L,S",
              help="sparsecache configurations (layers per signal, sparsity); repeatable. Default: "
                   "L1 s8/16/32/64, L2 s16/32, L3 s32/64, L5 s32/40/64. Dictionaries not shipped are learned "
                   "once into the user cache (~10-40 min each on 2 CPU cores).")
@click.option("--dict", "dicts", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A dictionary to compare as it is, as the configuration of its own L and s (e.g. ones learned "
                   "for a model without shipped dictionaries); repeatable. With --dict and no --config, only these.")
@click.option("--passages", type=click.IntRange(min=1), default=FrontierConfig.passages, show_default=True,
              help="Held-out passages for NMSE/perplexity/KL/top-1.")
@click.option("--prefix-tokens", default=FrontierConfig.prefix_tokens, show_default=True,
              help="Passage (= chunk) length in tokens.")
@click.option("--continuation-tokens", default=FrontierConfig.continuation_tokens, show_default=True)
@click.option("--trials", default=FrontierConfig.trials, show_default=True, help="Needle trials per method.")
@click.option("--needle-chunks", default=FrontierConfig.needle_chunks, show_default=True,
              help="Chunks per needle trial (k).")
@click.option("--needle-chunk-tokens", default=FrontierConfig.needle_chunk_tokens, show_default=True)
@click.option("--recompute-ratio", default=FrontierConfig.recompute_ratio, show_default=True,
              help="For the recomputation (infoflow) column.")
@click.option("--corpus-tokens", default=FrontierConfig.corpus_tokens, show_default=True,
              help="Corpus size the dictionary/basis overhead is spread over in the total ratio.")
@click.option("--learn-steps", default=FrontierConfig.learn_steps, show_default=True,
              help="Training steps for a dictionary that is neither shipped nor cached (learned once, then cached).")
@click.option("--atoms", default=FrontierConfig.atoms, show_default=True,
              help="Dictionary size of the sparsecache configurations.")
@click.option("--no-baselines", is_flag=True, help="Only sparsecache configurations.")
@click.option("--skip-needles", is_flag=True,
              help="Measure fidelity only for methods not cached yet (a later run adds their needle trials).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write the Pareto chart (PNG).")
@device_option
@json_option
@library_errors
def quality_cmd(model_path, texts, configs, dicts, no_baselines, skip_needles, plot, device, as_json, **settings):
    """The compression–quality frontier: sparsecache configurations (fp16/fp8/int8 coefficients,
    packed, Elias–Fano or Rice-coded indices) against KIVI int4/int2, per-layer SVD, xKV, fp8 and raw fp16,
    all on the same held-out passages and needle trials.

    Quality results are cached per method under the user cache, so a re-run only evaluates
    what is new; dictionaries missing from dictionaries/ and the cache are learned first.
    """
    from sparsecache.bench.frontier import SPARSE_CONFIGS, plot_frontier, quality_lines, run_frontier
    from sparsecache.model.kvmodel import load_model

    parsed = tuple(tuple(int(x) for x in c.split(",")) for c in configs) or (() if dicts else SPARSE_CONFIGS)
    if any(len(c) != 2 for c in parsed):
        raise click.BadParameter("each --config is L,S (e.g. 2,32)", param_hint="--config")
    cfg = FrontierConfig(**settings)  # the options are FrontierConfig's fields, by name
    dev = resolve_device(device)
    model = load_model(model_path, device=dev)
    r = run_frontier(model, cfg, parsed, [] if no_baselines else None, texts, dev,
                     log=lambda msg: click.echo(msg, err=True), needles=not skip_needles, dictionaries=dicts)
    if plot:
        plot_frontier(r, plot)
    emit(r, as_json, quality_lines(r, cfg))


@bench.command("scale")
@click.option("--workdir", default="bench-scale", show_default=True, type=click.Path(file_okay=False),
              help="Where the synthetic stores go (each is deleted once measured); scale.json and scale.png too.")
@click.option("--sizes", default=",".join(map(str, ScaleConfig.sizes)), show_default=True, callback=int_list,
              help="Chunks per store, comma-separated (10M needs ~20 GB of disk for its embeddings).")
@click.option("--queries", default=ScaleConfig.queries, show_default=True, help="Searches timed per size.")
@click.option("--embeddings", type=click.Choice(["clustered", "random"]), default=ScaleConfig.embeddings,
              show_default=True, help="Synthetic vectors: clustered like sentence embeddings, or uniform (worst case).")
@click.option("--index", "index_kind", type=click.Choice(INDEX_KINDS), default=ScaleConfig.index,
              show_default=True, help="Index kind (auto: by the number of vectors, as encode-corpus does).")
@click.option("--resume", is_flag=True, help="Go on from the last finished phase of a size a run left in --workdir "
              "(its store and progress.json) instead of building it again.")
@json_option
@library_errors
def scale_cmd(workdir, sizes, queries, embeddings, index_kind, resume, as_json):
    """What a store's metadata and index cost as the corpus grows, with no model: per size, a
    reader's open to first search, search p50/p99 and recall@8 against exact search, a nightly
    publish changing (and one deleting) 1% of the documents and the bytes it writes, and the
    writer's and reader's peak memory (each phase in its own process)."""
    from pathlib import Path

    from sparsecache.bench.scale import plot, run

    cfg = ScaleConfig(sizes=tuple(sizes), queries=queries, embeddings=embeddings, index=index_kind)
    r = run(Path(workdir), cfg, progress=(lambda m: None) if as_json else (lambda m: click.echo(m, err=True)),
            resume=resume)
    plot(r, Path(workdir) / "scale.png")
    lines = [f"{'chunks':>11} {'open s':>7} {'p50 ms':>7} {'p99 ms':>7} {'recall@8':>8} {'publish 1% s':>12} "
             f"{'MB written':>10} {'writer GB':>9} {'reader GB':>9}"]
    lines += [f"{x['chunks']:>11,} {x['open_s']:>7.2f} {x['search_p50_ms']:>7.2f} {x['search_p99_ms']:>7.2f} "
              f"{x['recall_at_8']:>8.3f} {x['publish_1pct_s']:>12.1f} {x['publish_bytes'] / 1e6:>10.1f} "
              f"{x['writer_peak_gb']:>9.2f} {x['reader_peak_gb']:>9.2f}" for x in r["rows"]]
    lines.append(f"({r['machine']['cpu']}, {r['machine']['cores']} cores; {Path(workdir) / 'scale.json'}, scale.png)")
    emit(r, as_json, lines)


@bench.command("serve")
@click.argument("store", metavar="STORE")
@click.option("--out", default="bench-serve.json", show_default=True, type=click.Path(dir_okay=False),
              help="The results (JSON), saved row by row; a rerun with the same --out skips the rows there.")
@click.option("--clients", default="1,4,16", show_default=True, callback=int_list,
              help="Concurrent clients per level, comma-separated.")
@click.option("--requests", default="8,16,32", show_default=True, callback=int_list,
              help="Requests per level, in the same order (each level asks questions no other level asks).")
@click.option("--top-k", default=8, show_default=True, type=click.IntRange(min=1), help="Chunks per question.")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per answer.")
@click.option("--servers", default="sparsecache,vllm", show_default=True,
              help="Which servers, comma-separated: sparsecache (sparsecache serve) and vllm (vllm serve, full "
                   "prefill of the same chunks, laid out by the client).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write the PNG here.")
@json_option
@library_errors
def serve_cmd(store, out, clients, requests, top_k, max_tokens, servers, plot_path, as_json):
    """`sparsecache serve` against `vllm serve` over STORE, one server after the other on this machine:
    requests/s and the clients' TTFT (p50, p95, mean) at each level of concurrent clients, streaming
    and greedy. Needs vLLM (`bash scripts/setup.sh vllm`)."""
    from pathlib import Path

    from sparsecache.bench.serving import ServeBench, bench_serve, plot

    require_vllm()
    cfg = ServeBench(clients=tuple(clients), requests=tuple(requests), top_k=top_k, max_tokens=max_tokens,
                     servers=tuple(s.strip() for s in servers.split(",") if s.strip()))
    r = bench_serve(store, out, cfg)
    if plot_path:
        plot(r["rows"], Path(plot_path))
    emit(r, as_json, [f"{x['server']:>11} {x['clients']:>3} clients: {x['requests_per_s']:.3f} req/s, TTFT p50 "
                      f"{x['ttft_p50_ms']:.0f} ms, p95 {x['ttft_p95_ms']:.0f} ms" for x in r["rows"]]
         + [f"({r['cpu']}; {out})"])


@bench.command("vllm")
@click.option("--store", "store_path", default=None, type=click.Path(file_okay=False),
              help="The store the engine's connector serves (made or brought up to date from --corpus).")
@click.option("--corpus", default=None, type=click.Path(exists=True),
              help="Documents encoded into the store first, giving chunks of >= --min-chunk-tokens tokens for the "
                   "TTFT and throughput sections (`bench store`'s corpus is one).")
@click.option("--ruler", default=None, type=click.Path(file_okay=False),
              help="The needle section's RULER-style suite directory (made there when missing).")
@click.option("--sections", default="ttft,needle,throughput", show_default=True,
              help="Which sections, comma-separated: ttft, needle, throughput.")
@click.option("--k", "ks", default="2,8,32", show_default=True, callback=int_list, help="TTFT: chunk counts.")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(min=1), help="TTFT: timed runs each.")
@click.option("--configs", default=None,
              help="TTFT: configurations, comma-separated: full, prefix-warm (vLLM's prefix cache warm), raw, none, "
                   "METHOD:R (the connector blends). Default: all of them, five blends.")
@click.option("--no-warmup-full", is_flag=True, help="TTFT: time vLLM's full prefill once, cold.")
@click.option("--trials", default=20, show_default=True, type=click.IntRange(min=1), help="Needle: trials per task.")
@click.option("--concurrent", default=8, show_default=True, type=click.IntRange(min=1),
              help="Throughput: requests submitted at once.")
@click.option("--min-chunk-tokens", default=480, show_default=True, type=click.IntRange(min=1),
              help="TTFT and throughput: use the store's chunks of at least this many tokens.")
@click.option("--max-model-len", default=20480, show_default=True, type=click.IntRange(min=256),
              help="The engine's context length (k = 32 chunks of ~500 tokens need ~16K).")
@click.option("--fidelity", "fidelity_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Run the fidelity section alone on `bench fidelity --workdir W`'s suite and store.")
@click.option("--fidelity-k", default=8, show_default=True, help="Fidelity: the suite's k.")
@click.option("--loop-results", default="docs/benchmarks/fidelity-k8-agreement.json", show_default=True,
              type=click.Path(dir_okay=False), help="Fidelity: bench fidelity's rows, to compare answers with the loop's.")
@click.option("--ttft-questions", default=5, show_default=True, help="Fidelity: questions timed one by one.")
@click.option("--out", default="bench-vllm.json", show_default=True, type=click.Path(dir_okay=False),
              help="The results (JSON), saved as rows finish; a rerun with the same --out skips what is there.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="TTFT's PNG here.")
@json_option
@library_errors
def vllm_cmd(store_path, corpus, ruler, sections, ks, repeats, configs, no_warmup_full, trials, concurrent,
             min_chunk_tokens, max_model_len, fidelity_dir, fidelity_k, loop_results, ttft_questions, out, plot_path,
             as_json):
    """vLLM with the store's connector against what a vLLM user has without it, in one engine in this
    process: TTFT by k against vLLM's full prefill and its warm prefix cache, the RULER-style needle tasks,
    throughput of concurrent requests, or (--fidelity) answers against vLLM's own full prefill. Needs
    vLLM (`bash scripts/setup.sh vllm`)."""
    import os
    from pathlib import Path

    from sparsecache.bench.vllm_engine import CONFIGS, ENGINE_ENV, VllmBench, bench_vllm, plot

    for k, v in ENGINE_ENV.items():  # before vLLM is imported: an in-process engine, its logs on stderr
        os.environ.setdefault(k, v)
    require_vllm()
    cfg = VllmBench(sections=tuple(s.strip() for s in sections.split(",") if s.strip()),
                    corpus=Path(corpus) if corpus else None, ruler=Path(ruler) if ruler else None, ks=tuple(ks),
                    repeats=repeats, configs=tuple(c.strip() for c in configs.split(",")) if configs else CONFIGS,
                    warmup_full=not no_warmup_full, trials=trials, concurrent=concurrent,
                    min_chunk_tokens=min_chunk_tokens, max_model_len=max_model_len,
                    fidelity=Path(fidelity_dir) if fidelity_dir else None, fidelity_k=fidelity_k,
                    loop_results=Path(loop_results), ttft_questions=ttft_questions)
    r = bench_vllm(Path(store_path) if store_path else None, Path(out), cfg,
                   progress=(lambda m: None) if as_json else (lambda m: click.echo(m, err=True)))
    if plot_path and r.get("ttft"):
        plot(r["ttft"], Path(plot_path))
    lines = [f"k={x['k']:<3} {x['config']:>16} TTFT {x['ttft_ms']:8.0f} ms ({x['x_full']:.3f}x full), recomputed "
             f"{x['recomputed_tokens']}" for x in r.get("ttft", [])]
    lines += [f"{x['task']:>10} {x['config']:>16} accuracy {x['accuracy']:.2f}" for x in r.get("needle", [])]
    lines += [f"throughput {x['config']:>16} {x['requests_per_s']:.3f} req/s, mean TTFT {x['mean_ttft_ms']} ms"
              for x in r.get("throughput", [])]
    lines += [json.dumps(x) for x in r.get("fidelity_summary", [])]
    emit(r, as_json, lines + [f"({r['cpu']}; {out})"])
