"""Helpers and fixtures the tests share, one module per purpose. The root conftest registers the
fixture modules (`pytest_plugins`); test modules import helpers from here by name
(`from support.stores import assert_same_live_chunks`)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]  # the checkout: README, docs, the package's sources

# Devices a device-agnostic test runs on: the CPU always, CUDA where a GPU is present (the
# `cuda` marker selects those: `pytest -m cuda`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]
