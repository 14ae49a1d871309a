"""Options shared by several commands, and the error boundary every command runs inside."""

from __future__ import annotations

import functools
import json

import click

from sparsecache.errors import SparseCacheError
from sparsecache.query.config import DTYPE, DTYPES


def model_option(f):
    from sparsecache.model.gguf import DEFAULT_NAME
    from sparsecache.model.packaged import PACKAGED

    named = ", ".join(f"'{m.name}' ({m.directory}; `{m.setup}`)" for m in PACKAGED.values())
    return click.option("--model", "model_path", default="default", show_default=True,
                        help=f"'default' ({DEFAULT_NAME}; for a command reading or re-indexing a store, the "
                             f"store's own packaged model) or a packaged model: {named}, each checked against its "
                             "pinned hashes and converted once into the user cache; or a local HuggingFace model "
                             "directory, or a .gguf file (or a directory holding one), converted once the same way.")(f)


def device_option(f):
    return click.option("--device", default="auto", show_default=True,
                        help="auto (cuda when present, else cpu), cpu, cuda or cuda:N.")(f)


def dtype_option(f):
    return click.option("--dtype", type=click.Choice(DTYPES), default=DTYPE, show_default=True,
                        help="The model's dtype for the query (decode, recomputation, prefill, generation): auto is "
                             "float32 on a CPU, bfloat16 on a GPU. The store's K/V are float32 whatever this says.")(f)


def exact_omp_option(f):
    return click.option("--exact-omp", is_flag=True,
                        help="Code with exact Batch-OMP (the reference) instead of the CPU kernel's candidate "
                             "screening (faster, at slightly higher error: BENCHMARKS.md has the figures). "
                             "Dictionaries with many more atoms than signal values code exactly anyway; GPUs always "
                             "run exact.")(f)


def forward_dtype_option(f):
    from sparsecache.dtypes import FORWARD_DTYPE, FORWARD_DTYPES

    return click.option("--forward-dtype", type=click.Choice(FORWARD_DTYPES), default=FORWARD_DTYPE, show_default=True,
                        help="The precision of the encode's forward pass (the K/V are stored float32 either way): auto "
                             "is bfloat16 autocast on a CPU with bfloat16 dot products (AVX512-BF16 or AMX), else "
                             "float32. bfloat16 is faster at a small fraction of the codec's own error (BENCHMARKS.md "
                             "has the figures).")(f)


def screening(exact_omp: bool):
    """The OMP screening an --exact-omp flag asks for (None: the dictionary's default)."""
    from sparsecache.codec.omp import EXACT

    return EXACT if exact_omp else None


def int_list(ctx, param, value: str) -> tuple[int, ...]:
    """A click callback: "2,8" -> (2, 8), or a usage error naming the option."""
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of whole numbers") from None


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object and nothing else on stdout.")(f)


def resolve_device(name: str) -> str:
    """`model.resolve_device` (auto made concrete), its ConfigError as the CLI's one line."""
    from sparsecache.model.kvmodel import resolve_device

    try:
        return resolve_device(name)
    except SparseCacheError as e:
        raise click.ClickException(str(e)) from None


def library_errors(f):
    """Turn the library's named errors into one line on stderr and exit code 1. Anything
    else is a bug and keeps its traceback."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except SparseCacheError as e:
            raise click.ClickException(str(e)) from None
        except _object_store_errors() as e:  # unreachable endpoint, bad credentials, no bucket
            raise click.ClickException(f"object storage: {str(e).splitlines()[0][:300]}") from None
    return wrapper


def require_vllm() -> None:
    """One line and exit 1 where vLLM (an optional part) is not installed, before any work starts."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.ClickException("vLLM is not installed: `bash scripts/setup.sh vllm` adds it") from None


def _object_store_errors() -> tuple:
    """obstore's exception base class where the s3 extra is installed (zarr raises it too)."""
    try:
        from obstore.exceptions import BaseError
    except ImportError:
        return ()
    return (BaseError,)


def fields_of(cls, options: dict) -> dict:
    """The click `options` named like the config dataclass `cls`'s fields, taken out of
    `options`: a command maps its options onto a config by name, never by position."""
    import dataclasses

    return {f.name: options.pop(f.name) for f in dataclasses.fields(cls) if f.init and f.name in options}


def emit(result: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(result, default=float))
    else:
        for line in lines:
            click.echo(line)
