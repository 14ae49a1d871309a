"""The CLI in-process (click's runner)."""

from __future__ import annotations



from click.testing import CliRunner

from sparsecache.cli.main import cli


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def cli_encode(corpus, store, model_dir, dict_dir, *extra):
    return invoke("encode-corpus", corpus, "--store", store, "--model", model_dir, "--dict", dict_dir,
                  "--chunk-tokens", 64, "--device", "cpu", *extra)
