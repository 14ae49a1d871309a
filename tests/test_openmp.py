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
    assert _run("import sys, sparsecache.cli.main, sparsecache.session; print(sys.modules['sparsecache'].OPENMP_SPINS)") == "False"
