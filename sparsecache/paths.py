"""The user cache directory: converted models, calibration signals, checks, downloaded stores."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted models and other reusable artifacts live ($SPARSECACHE_CACHE wins)."""
    if os.environ.get("SPARSECACHE_CACHE"):
        return Path(os.environ["SPARSECACHE_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("sparsecache"))
