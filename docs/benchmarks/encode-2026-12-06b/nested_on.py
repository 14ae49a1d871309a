"""Run a script with numba's nesting left on, as before 9bb7c56 (the A/B's old side)."""
import runpy, sys
import sparsecache  # noqa: F401
from sparsecache.codec import numba_pool as p
_start = p.start
def start():
    _start(); p.openmp_runtime().omp_set_nested(1)
p.start = start
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
