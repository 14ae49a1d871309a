"""The real Qwen2.5-Coder-0.5B-Instruct (`scripts/setup.sh qwen`, six pinned packages, ~470 MB;
skipped where they are not installed): named by `--model qwen2.5-coder-0.5b`, checked against
its pins and converted once, and passing the gate every model passes (`check-model`)."""

from __future__ import annotations

import json

import pytest

from sparsecache.model.packaged import PACKAGED

QWEN = PACKAGED["qwen2.5-coder-0.5b"]
pytest.importorskip(QWEN.parts[-1].module)
pytestmark = pytest.mark.slow


def test_check_model_passes_it_by_name():
    from conftest import invoke

    r = invoke("check-model", "qwen2.5-coder-0.5b", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["passed"], result
    assert result["model"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert result["fingerprint"]["layers"] == 24 and result["fingerprint"]["m"] == 2 * 64
    assert [c["name"] for c in result["checks"]] == ["capture", "recompute-all", "single-chunk"]
