"""sparsecache: compressed KV-cache corpus builder and store for RAG."""

import os
import sys

# OpenMP workers that sleep between parallel regions instead of spinning. A query runs
# thousands of small operations (the question's pass, the recomputed tokens' layers), each
# one parallel region; on a CPU shared with another busy process a spinning worker holds
# its core while the thread it waits for is descheduled, and each region then costs a
# scheduler tick. Measured (BENCHMARKS.md, "The query path on a busy CPU"): with one
# competing job, a k = 8 recomputation's select/recompute/question-prefill took 3.6/14/4.7 s
# with spinning workers and 0.3-0.6/5.0-5.6/0.4-0.7 s with this; quiet, the same either way.
# libgomp reads it when torch loads it, so it only takes effect if sparsecache is imported
# before torch (the CLI is); a value set by the user is kept.
OPENMP_SPINS = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ  # too late: Session warns
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

def names_from(package: str, *modules: str):
    """A package's module `__getattr__` that finds a name in `modules` (its own, in order) on first
    use, so importing the package, or a light module of it, imports none of the heavy ones."""
    import importlib

    def __getattr__(name: str):
        for module in modules:
            found = importlib.import_module(f"{package}.{module}")
            if hasattr(found, name):
                return getattr(found, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

