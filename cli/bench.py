"""`bench` commands: measurements with stable output."""

import click

from cli.options import device_option, json_option, library_errors, emit, resolve_device


@click.group()
def bench():
    """Benchmarks that print (and with --json emit) their measurements."""


@bench.command("omp")
@click.option("--dict", "dict_path", type=click.Path(exists=True), default=None,
              help="Dictionary to code with (default: normalised data samples as atoms).")
@click.option("--atoms", default=8192, show_default=True)
@click.option("--sparsity", default=16, show_default=True)
@click.option("--n", "count", default=8192, show_default=True, help="Signals coded by Batch-OMP.")
@click.option("--sklearn-n", default=64, show_default=True, help="Signals coded by scikit-learn (it is slow).")
@click.option("--kind", type=click.Choice(["k", "v"]), default="k", show_default=True)
@device_option
@json_option
@library_errors
def omp_cmd(dict_path, atoms, sparsity, count, sklearn_n, kind, device, as_json):
    """Batch-OMP vs scikit-learn's orthogonal_mp_gram on the same real KV signals (m = 192)."""
    from sparsecache.benchmark import bench_omp

    r = bench_omp(dict_path, atoms, sparsity, count, sklearn_n, kind, resolve_device(device))
    emit(r, as_json, [
        f"device {r['device']}  atoms {r['atoms']}  dim {r['dim']}  sparsity {r['sparsity']}",
        f"batch_omp  {r['vectors_per_s']:>12,.0f} signals/s",
        f"torch path {r['torch_path_vectors_per_s']:>12,.0f} signals/s   (vectorised torch ops; used on GPUs)",
        f"sklearn    {r['sklearn_vectors_per_s']:>12,.1f} signals/s   speedup {r['speedup']:,.0f}x",
        f"decode     {r['decode_vectors_per_s']:>12,.0f} signals/s",
        f"residual vs sklearn (same signals): {r['residual_ratio_vs_sklearn']:.4f} (<= 1 means ours is as good)",
    ])
