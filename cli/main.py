"""`sparsecache` entry point: one group; each command lives in the module of its noun."""

import click

from cli import bench, dictionary
from sparsecache import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sparsecache")
def cli():
    """Offline compressed KV-cache corpus builder for RAG.

    Learn global K/V dictionaries for a model (learn-dict) and measure them (eval-dict,
    bench omp). Encoding a corpus into a store and querying it come next.
    """


cli.add_command(dictionary.learn_dict_cmd)
cli.add_command(dictionary.eval_dict_cmd)
cli.add_command(bench.bench)
