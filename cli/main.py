"""`sparsecache` entry point: one group, commands registered from their modules."""

import click

from sparsecache import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sparsecache")
def cli():
    """Offline compressed KV-cache corpus builder for RAG.

    Learn global K/V dictionaries for a model (learn-dict), measure them (eval-dict,
    bench omp), and (later) encode a corpus into a store and query it.
    """


from cli import bench, dictionary  # noqa: E402  (commands attach themselves to `cli`)

cli.add_command(dictionary.learn_dict_cmd)
cli.add_command(dictionary.eval_dict_cmd)
cli.add_command(bench.bench)
