"""What every test gets: the `cuda` marker skipped without a GPU, a cache of its own, and the
cheap-context rule off for toy models. Fixtures and helpers live in `tests/support/`, one
module per purpose (models, corpora, stores, crashes, object storage, servers, the CLI, the
vLLM engine): the fixtures below come from there, and test modules import the helpers from
there, never from each other or from a conftest. A folder's own fixtures sit in its conftest
(`tests/store/conftest.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.register_assert_rewrite("support")  # the helpers' asserts report their values, as a conftest's do

import sparsecache  # noqa: E402,F401  before torch, as the CLI does: OpenMP workers that sleep (sparsecache/__init__.py)
import torch  # noqa: E402

pytest_plugins = ["support.models", "support.corpora", "support.s3"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Signals extracted from the tiny model must not land in the user's cache; the converted
    default model may (converting it takes ~40 s, and it is the same file everywhere)."""
    from sparsecache.paths import cache_root

    real = cache_root()
    (real / "models").mkdir(parents=True, exist_ok=True)  # a fresh machine's first run converts into it too
    os.environ["SPARSECACHE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    (Path(os.environ["SPARSECACHE_CACHE"]) / "models").symlink_to(real / "models", target_is_directory=True)
    yield


TOY_PARAMETERS = 10_000_000  # below this a model is one of these tests' random 2-layer toys


@pytest.fixture(autouse=True)
def _no_cheap_rule_for_toy_models(monkeypatch):
    """The cheap-context rule (`query.cheap`) scales with the model: a toy's prefill costs
    nothing, so it would prefill every context, and a test of what a method does with a toy
    model's store would test full prefill instead. Toys get the rule off; the real models (the
    default SmolLM2, Gemma) keep it as users get it, and tests/query/test_cheap.py tests it."""
    from sparsecache.query import cheap

    real = cheap.prefill_under

    def rule(parameters, device_type, given=None, costs=None, ratio=0.0):
        if given is not None or parameters >= TOY_PARAMETERS:
            return real(parameters, device_type, given, costs, ratio)
        return 0

    monkeypatch.setattr(cheap, "prefill_under", rule)
