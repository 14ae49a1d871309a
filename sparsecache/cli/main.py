"""`sparsecache` entry point: one group; each command lives in the module of its noun."""

import warnings

import click

from sparsecache import __version__

from . import bench, dictionary, query, serve, store


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sparsecache")
def cli():
    """Offline compressed KV-cache corpus builder for RAG.

    Learn global K/V dictionaries for a model (learn-dict) and measure them (eval-dict,
    bench omp); learn chunk wrappers (learn-wrapper); encode a corpus into a versioned store (encode-corpus), inspect it
    (info, verify, search, compact), measure the configuration its corpus needs (calibrate), answer
    questions from it (query) and serve it over an OpenAI-compatible HTTP API (serve).
    """
    warnings.showwarning = _warning_line


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """Library warnings (bad bytes in a file, a stale lock) reach the user as one line each."""
    click.echo(f"warning: {message}", err=True)


cli.add_command(dictionary.check_model_cmd)
cli.add_command(dictionary.learn_dict_cmd)
cli.add_command(dictionary.eval_dict_cmd)
cli.add_command(dictionary.learn_wrapper_cmd)
cli.add_command(bench.bench)
for command in (store.encode_corpus_cmd, store.info_cmd, store.verify_cmd, store.compact_cmd, store.search_cmd,
                query.query_cmd, query.calibrate_cmd, serve.serve_cmd):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
