"""`encode-corpus`, `info`, `verify`, `compact`, `search`: building and inspecting a store."""

from __future__ import annotations

import json

import click

from sparsecache.codec.codes import COEF_DTYPE_NAMES
from sparsecache.ingest.config import EncodeOptions
from sparsecache.kvstore.index_config import INDEX_KINDS, KIND_HELP
from sparsecache.wrapper.config import DEFAULT_WRAPPER_HELP

from .options import (device_option, emit, exact_omp_option, forward_dtype_option, json_option, library_errors,
                      model_option, resolve_device)

store_argument = click.argument("store", metavar="STORE")  # a directory or an s3://, gs://, az:// URL


@click.command("encode-corpus")
@click.argument("corpus", nargs=-1, required=True)
@click.option("--store", "store", required=True,
              help="Store directory, or object-storage URL (s3://bucket/prefix, gs://, az://; credentials and "
              "endpoint from the standard environment variables, e.g. AWS_ENDPOINT_URL). Created on first use.")
@click.option("--dict", "dictionary", default=None,
              help="Dictionary directory from learn-dict. Default: the store's own for an existing store, "
              "else the one shipped for --model (the default model's L10 s80; Gemma 3 270M's L9 s100 in a "
              "repository checkout).")
@model_option
@click.option("--chunk-tokens", type=int, default=None, help="Most tokens per chunk.  [default: 512]")
@click.option("--prefix", default=None, help="Shared prefix text every chunk is encoded after "
              "(default: the model's chat template up to the user's text).")
@click.option("--anchor", default=None, help="Text every chunk is encoded after (after the prefix), its K/V not "
              "kept: chunks then carry context a query's layout would not give them (Star Attention's anchor "
              "block; fixed when the store is created).  [default: none]")
@click.option("--encode-after", metavar="[prefix|document|neighbours]", default=None,
              help="What each chunk reads before itself when encoded, its K/V not kept (so the bytes per token do not "
              "change): prefix (nothing, as a query lays chunks out), document (the chunk before it in its document) "
              "or neighbours (its nearest chunk of another document by the store's embedder; a document is encoded "
              "again when its chunks' nearest neighbours change, so the store stays a fresh build of the corpus). "
              "Each chunk records what it read. Fixed when the store is created.  [default: an existing store's own; for "
              "a new store, neighbours]")
@click.option("--encode-after-chunks", type=click.IntRange(1, 8), default=None,
              help="How many chunks each reads with --encode-after: the ones just before it, or its nearest (the "
              "nearest next to it). Fixed when the store is created.  [default: 1]")
@click.option("--wrapper", "wrapper", default=None,
              help="A learned chunk wrapper: a `learn-wrapper` directory, 'shipped' (the one shipped for --model) or "
              "'none'. Every chunk is encoded as prefix | header | chunk | trailer, soft tokens a query lays out "
              "with it (fixed when the store is created; `query`, `serve` and the vLLM connector read it).  "
              "[default: an existing store's own; for a new store, the model's default wrapper where one ships "
              "(" + DEFAULT_WRAPPER_HELP + "), else none]")
@click.option("--delete-missing", is_flag=True, help="Tombstone documents the corpus no longer has.")
@click.option("--index", "index_kind", type=click.Choice(INDEX_KINDS), default=EncodeOptions.index_kind,
              show_default=True,
              help=f"FAISS index kind for the segments this run builds: {KIND_HELP}.")
@click.option("--embedder", default=None,
              help="'default' (all-MiniLM-L6-v2, packaged) or a local HF encoder directory.  [default: default]")
@click.option("--compressor", type=click.Choice(["none", "zstd"]), default=None,
              help="Compressor of the code arrays.  [default: none]")
@click.option("--coefficients", "coef_dtype", type=click.Choice(COEF_DTYPE_NAMES), default=None,
              help="How code coefficients are stored; see BENCHMARKS.md.  [default: float8]")
@click.option("--indices", "index_coding", type=click.Choice(["elias-fano", "packed"]), default=None,
              help="Atom indices as Elias-Fano sorted sets (10 bits each at s=32) or 13-bit packed in OMP "
              "order (the paper's layout); lossless either way.  [default: elias-fano]")
@click.option("--adapt", "adapt_steps", type=click.IntRange(min=0), default=EncodeOptions.adapt_steps,
              show_default=True,
              help="Before a new store's first encode, adapt the dictionary to a sample of CORPUS for this many "
              "steps (~100: a few minutes on a CPU; see docs/how-to/another-model.md) and keep the adapted copy in the store. "
              "0: off. An existing store keeps its dictionary.")
@click.option("--batch-tokens", default=EncodeOptions.batch_tokens, show_default=True, help="Tokens per encode batch (memory vs speed).")
@click.option("--keep", default=EncodeOptions.keep, show_default=True,
              help="Published versions to keep; older manifests and indexes are deleted (0 keeps all).")
@click.option("--workers", default=EncodeOptions.workers, show_default=True, type=click.IntRange(min=0),
              help="Encode on N Ray actors in a local Ray cluster (needs the ray extra); 0: in this process.")
@click.option("--ray-address", default=None,
              help="Encode on an existing Ray cluster ('auto' inside `ray job submit`); --workers actors "
              "(default: one per GPU with --device cuda, else 2).")
@click.option("--calibrate", "recalibrate", is_flag=True,
              help="After a publish, measure the store's query configuration again (`sparsecache calibrate`, with "
                   "the target and TTFT budget of its last calibration on this device, else calibrate's defaults) "
                   "and record it where one meets the target: the nightly job's check.")
@exact_omp_option
@forward_dtype_option
@device_option
@json_option
@library_errors
def encode_corpus_cmd(corpus, store, model_path, as_json, recalibrate, **options):
    """Encode CORPUS (directories, .txt/.md/.rst/.html files, JSONL, or 'builtin') into a store.

    Only new or changed documents are encoded; an unchanged corpus does nothing. Safe to
    kill at any point: a rerun resumes where it stopped, and readers only ever see
    published versions.

    The dictionary, chunking, prefix, anchor, encode-after, wrapper, embedder, compressor and code formats are fixed when
    a store is created: an existing store keeps its own, and an option that contradicts
    them is refused.

    The store may be an object-storage URL (s3://bucket/prefix, gs://, az://), and the
    encoding may run on Ray actors (--workers, --ray-address); the guarantees are the same.
    """
    from sparsecache.ingest.encoder import encode_corpus

    # the options map onto EncodeOptions by name
    r = encode_corpus(corpus, store, EncodeOptions(model=model_path, progress=not as_json, **options))
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in r.seconds.items())
    result = r.to_dict()
    lines = [r.message] + ([f"{r.chunks} chunks, {r.tokens} tokens, {r.tokens_per_s:.0f} tokens/s ({secs})"]
                           if r.tokens else [])
    if recalibrate and r.published:
        result["calibration"], more = recalibrate_after_publish(store, model_path, options["device"], not as_json)
        lines += ["", *more]
    elif recalibrate:
        lines.append("nothing published, so nothing to calibrate again: the store's calibration stands")
    emit(result, as_json, lines)


def recalibrate_after_publish(store, model_path: str, device: str, progress: bool) -> tuple[dict, list[str]]:
    """`encode-corpus --calibrate`: calibrate again with the last calibration's target, budget,
    questions and k for this device (calibrate's defaults where there is none)."""
    from sparsecache.query.calibrate import recalibrate, report_lines

    result = recalibrate(store, model_path, resolve_device(device), progress)
    return result, report_lines(result)


@click.command("info")
@store_argument
@click.option("--version", "version", type=int, default=None, help="A published version (default: latest).")
@json_option
@library_errors
def info_cmd(store, version, as_json):
    """Versions, sizes and compression of a store."""
    from sparsecache.query.config import calibration_line
    from sparsecache.store import Store

    r = Store.open(store, version).info()
    c = r["compression"]
    disk = r["bytes_on_disk"]
    lines = [
        f"{r['path']}  version {r['version']} of {r['versions']}  (format {r['format']}, generation {r['generation']})",
        f"model {r['model']['name']}  dictionary {r['dictionary']}  index {r['index_kind']}",
        f"{r['documents']} documents, {r['chunks']} chunks ({r['tombstoned_chunks']} tombstoned), "
        f"{r['tokens']} tokens ({r['stored_tokens']} stored)",
        f"compression = fp16 K+V bytes of the {r['stored_tokens']} stored tokens ÷ bytes of their codes:",
        f"  {c['theoretical']}x per token in the arrays (theoretical: {c['fp16_bytes_per_token']} ÷ "
        f"{c['code_bytes_per_token']} bytes)",
        f"  {c['measured_codes_only']}x on disk (code arrays' objects: chunk CRCs and the last chunk's padding included)",
        f"  {c['measured_with_dictionary']}x on disk with the dictionary copy (a fixed cost: approaches the above "
        "as the corpus grows)",
        "bytes on disk: " + ", ".join(f"{k} {v:,}" for k, v in disk.items()),
    ]
    for device, record in sorted(r.get("calibration", {}).items()):
        lines.append(f"query configuration for {device} (calibrate): " + calibration_line(record))
    if not r.get("calibration"):
        lines.append("query configuration: the default (not calibrated: `sparsecache calibrate` measures this store's)")
    after = r["config"].get("encode_after", "prefix")
    if after != "prefix":
        n = r["config"].get("encode_after_chunks", 1)
        what = "the chunk(s) before it in its document" if after == "document" else "its nearest chunk(s) of other documents"
        lines.insert(3, f"each chunk encoded after {what} (up to {n}; the chunk table's `after` column says which)")
    if "wrapper" in r:
        w = r["wrapper"]
        lines.insert(3, f"wrapper {w['digest']}: {w['header']} + {w['trailer']} soft tokens per chunk; the trailers' "
                        f"{w['trailer_tokens']} stored tokens count as overhead in the measured ratios"
                        + ("; linked: every query recomputes each chunk's trailer" if w.get("linked") else ""))
    emit(r, as_json, lines)


@click.command("verify")
@store_argument
@click.option("--version", "version", type=int, default=None, help="A published version (default: latest).")
@json_option
@library_errors
def verify_cmd(store, version, as_json):
    """Read every array chunk (CRC32C-checked) and check the manifest; exit 1 on damage."""
    from sparsecache.kvstore.view import verify

    r = verify(store, version)
    lines = [f"version {r['version']}: " + ("ok" if r["ok"] else f"{len(r['problems'])} problem(s)")]
    lines += [f"  {p}" for p in r["problems"]]
    if r["corrupt_chunks"]:
        lines.append(f"  corrupt chunks: {', '.join(r['corrupt_chunks'])}")
    emit(r, as_json, lines)
    if not r["ok"]:
        raise SystemExit(1)


@click.command("compact")
@store_argument
@click.option("--keep", default=2, show_default=True, help="Published versions to keep (older ones are deleted).")
@click.option("--index", "index_kind", type=click.Choice(INDEX_KINDS), default="auto",
              show_default=True, help="FAISS index kind of the compacted version (auto: by its size).")
@json_option
@library_errors
def compact_cmd(store, keep, index_kind, as_json):
    """Rewrite the live chunks without tombstones as a new version; then keep the newest --keep versions."""
    from sparsecache.kvstore.view import compact
    from sparsecache.store import read_manifest

    read_manifest(store)  # "no store at ..." before a writer would create one
    m = compact(store, keep, index_kind)
    emit({"version": m.version, "generation": m.generation, "chunks": m.chunks, "tokens": m.tokens}, as_json,
         [f"published version {m.version} ({m.generation}): {m.chunks} chunks, {m.tokens} tokens; kept {keep} version(s)"])


@click.command("search")
@store_argument
@click.argument("question")
@click.option("--top-k", default=5, show_default=True)
@click.option("--version", "version", type=int, default=None)
@device_option
@json_option
@library_errors
def search_cmd(store, question, top_k, version, device, as_json):
    """The chunks the store's index retrieves for QUESTION (id, document, score, text)."""
    from sparsecache.kvstore.index import Embedder
    from sparsecache.kvstore.view import KVStore

    s = KVStore.open(store, version)
    q = Embedder(s.config.embedder, resolve_device(device)).embed([question])[0]
    hits = s.search(q, top_k)
    texts = s.texts([c.id for c, _ in hits])
    rows = [{"id": c.id, "doc_id": c.doc_id, "ordinal": c.ordinal, "score": round(score, 4), "text": t}
            for (c, score), t in zip(hits, texts)]
    emit({"chunks": rows}, as_json,
         [f"{r['score']:.3f}  {r['id']}  {r['doc_id']}#{r['ordinal']}  {json.dumps(r['text'][:80])}" for r in rows])
