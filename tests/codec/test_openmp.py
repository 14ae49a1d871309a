"""sparsecache's OpenMP default: workers that sleep between parallel regions, set before torch
loads its OpenMP runtime (a query's thousands of small operations degrade badly on a busy
CPU with spinning workers; BENCHMARKS.md, "The query path on a busy CPU")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


@pytest.mark.parametrize("first, spins", [("import sparsecache, torch", False), ("import torch, sparsecache", True)])
def test_the_default_takes_effect_only_before_torch(first, spins):
    out = _run(f"{first}\nimport os\nprint(sparsecache.OPENMP_SPINS, os.environ['OMP_WAIT_POLICY'])")
    assert out == f"{spins} PASSIVE"


def test_a_users_setting_is_kept():
    assert _run("import sparsecache, os; print(sparsecache.OPENMP_SPINS, os.environ['OMP_WAIT_POLICY'])",
                OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"


def test_the_cli_imports_sparsecache_before_torch():
    assert _run("import sys, sparsecache.cli.main, sparsecache.query.session; print(sys.modules['sparsecache'].OPENMP_SPINS)") == "False"


KERNELS = """
import sparsecache, torch
before = torch.get_num_threads()
from sparsecache.codec.omp import batch_omp, gram
D = torch.nn.functional.normalize(torch.randn(32, 256), dim=0)
batch_omp(torch.randn(64, 32), D, 4, gram(D))  # the fused CPU OMP: numba's first parallel kernel
print(before, torch.get_num_threads())
"""


def test_the_cpu_kernels_leave_the_callers_openmp_thread_count_alone():
    """numba's OpenMP pool shares torch's runtime; starting it set the starting thread's count to
    numba's own. vLLM's CPU worker (pinned to 1 CPU, OpenMP planned for 2) then ran its next
    attention with 1 thread and aborted on its own check (`numba_pool`)."""
    assert _run(KERNELS, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="2").split() == ["2", "2"]


NESTING = """
import sparsecache, torch
from sparsecache.codec import numba_pool
runtime = numba_pool.openmp_runtime()
before = (runtime.omp_get_max_active_levels(), runtime.omp_get_nested())
from sparsecache.codec.omp import batch_omp, gram
D = torch.nn.functional.normalize(torch.randn(32, 256), dim=0)
batch_omp(torch.randn(64, 32), D, 4, gram(D))  # the fused CPU OMP: numba's first parallel kernel
print(*before, runtime.omp_get_max_active_levels(), runtime.omp_get_nested())
"""


def test_the_cpu_kernels_leave_torchs_openmp_nesting_off():
    """Starting numba's pool turns nested parallelism on in the OpenMP runtime torch uses, and
    torch's forward then oversubscribed the cores (1.5x slower in bfloat16): `numba_pool` puts the
    nesting back as it was. On Linux the runtime is reachable and nesting starts off."""
    levels, nested, levels_after, nested_after = map(int, _run(NESTING).split())
    assert nested == 0
    assert (levels_after, nested_after) == (levels, nested)
