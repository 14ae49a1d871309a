"""`serve`: answer RAG questions over HTTP (OpenAI-compatible), retrieval and KV injection in the server."""

from __future__ import annotations

import click

from sparsecache.query import cheap, methods
from sparsecache.query.config import DEFAULT_METHOD
from sparsecache.vllm.server import CPU_MAX_NUM_SEQS, KV_CACHE_SHARE, MAX_TOP_K, ServeConfig

from .options import library_errors, model_option, require_vllm


@click.command("serve", context_settings={"ignore_unknown_options": True})
@click.argument("store", metavar="STORE")  # a directory or an s3://, gs://, az:// URL
@model_option
@click.option("--host", default=ServeConfig.host, show_default=True,
              help="Address to bind; anything but 127.0.0.1 exposes the server to the network.")
@click.option("--port", default=ServeConfig.port, show_default=True, type=click.IntRange(1, 65535))
@click.option("--top-k", default=ServeConfig.top_k, show_default=True, type=click.IntRange(1, MAX_TOP_K),
              help="Chunks retrieved per request (a request may set its own).")
@click.option("--method", type=click.Choice(methods.names(connector=True)), default=None,
              help="What the connector does with the chunks' KV (as `sparsecache query`; methods that drop or "
                   "reorder chunks are query's alone): " + methods.summaries(methods.names(connector=True))
                   + f"  [default: the served version's choice for this device where `sparsecache calibrate` "
                   f"measured one (full prefill: vLLM prefills every request), else {DEFAULT_METHOD}]")
@click.option("--recompute-ratio", default=None, type=click.FloatRange(0, 1),
              help="Fraction of chunk tokens to recompute (default: what --ttft-budget buys, else the method's own, "
                   + methods.ratios(methods.names(connector=True)) + ").")
@click.option("--ttft-budget", type=click.FloatRange(0, 1, min_open=True), default=ServeConfig.ttft_budget,
              help="Recompute, where no --recompute-ratio is given, the share of chunk tokens whose predicted TTFT is "
                   "this fraction of full prefill's at each request's context length (the cost model of "
                   "`sparsecache query --ttft-budget`: `calibrate`'s refit for this device where the store has one, "
                   "else the constants measured for the device kind (sparsecache/query/measured_costs.json); "
                   "where there are none, the method's own ratio). A request may set its own.  [default: 0.5]")
@click.option("--prefill-under", type=click.IntRange(min=0), default=ServeConfig.prefill_under,
              help="Let vLLM prefill requests whose chunks hold fewer tokens, where that is cheaper than loading "
                   "them. " + cheap.rule_text())
@click.option("--api-key", default=None, envvar="SPARSECACHE_API_KEY", show_envvar=True,
              help="Require this bearer token on /v1 requests (401 without it).")
@click.option("--dtype", default=ServeConfig.dtype, show_default=True,
              help="vLLM's --dtype; auto is float32 on a CPU and vLLM's choice on a GPU.")
@click.option("--max-model-len", type=int, default=None, help="vLLM's --max-model-len (default: the model's).")
@click.option("--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=ServeConfig.kv_cache_gb,
              help="Memory for vLLM's KV cache, in GiB. Default on a CPU: room for --max-num-seqs requests "
                   f"(vLLM's default: {CPU_MAX_NUM_SEQS}) at --max-model-len, at most {KV_CACHE_SHARE:.0%} of the "
                   "memory free on the NUMA node vLLM runs on, and at least one request of that length (vLLM's "
                   "own default reserves 92% of the node's total and refuses to start where less is free). "
                   "Default on a GPU: vLLM's --gpu-memory-utilization.")
@click.option("--version-poll", type=click.FloatRange(min=0, min_open=True), default=ServeConfig.version_poll,
              show_default=True, metavar="SECONDS",
              help="How often a background thread looks for a new store version (a nightly encode-corpus "
                   "publishes one); requests move onto it once it is opened and its index fetched, and never wait "
                   "on the look itself. Each look is one LIST on an object store.")
@click.option("--store-timeout", type=click.FloatRange(min=0, min_open=True), default=ServeConfig.store_timeout,
              show_default=True, metavar="SECONDS",
              help="The most one operation on the store may take (a request's retrieval and layout is cut off at "
                   "twice it). A request the store does not answer in time gets 503 with one line, and at once "
                   "while the store is known down; chunks read before are answered from memory. /ready says "
                   "whether the store answers; the server recovers by itself.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM OPTIONS]")
@library_errors
def serve_cmd(model_path, vllm_args, **options):
    """Serve STORE over HTTP: an OpenAI-compatible API (/v1/chat/completions, /v1/completions,
    /v1/models, /health, /metrics) whose answers come from the store's chunks.

    Each request's last user message is the question: the server retrieves --top-k chunks, lays
    them out as `sparsecache query` does and vLLM's engine answers with their KV injected by
    SparsecacheConnector. The response's `sparsecache` field lists the chunks used. GET /ready
    answers 200 while the store answers and 503 while it does not (/health is vLLM's: the
    engine). Options after `--` go to vLLM's server as they are (e.g. `-- --max-num-seqs 16`).
    Needs vLLM: `bash scripts/setup.sh vllm`.
    """
    require_vllm()
    from sparsecache.vllm.server import serve

    # the options map onto ServeConfig by name; ServeConfig parses the method and ratio once
    serve(ServeConfig(model=model_path, vllm_args=tuple(a for a in vllm_args if a != "--"), **options))
