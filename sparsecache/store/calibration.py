"""Where a store keeps its measured query configuration (`sparsecache calibrate`), per version.

A calibration is one small JSON object per published version, `calibration/vNNNNNN.json`,
beside the manifest it belongs to rather than inside it: a reader of an older sparsecache
refuses manifest fields it does not know, and this object it never looks at, so a calibrated
store still opens there. It holds one record per kind of device ({"cpu": {...}, "cuda":
{...}}): a choice measured on a CPU is not used on a GPU, or the other way round.

The writer keeps it with the versions: before a manifest is created, the new version gets the
calibration of the version it was built on (carried forward: `measured_at` still names the
version it was measured on), or none, so an object a crashed run left for that version
number never outlives it; pruning a version deletes its calibration. The object is written
before the manifest, so a reader that sees a version sees its calibration.
"""

from __future__ import annotations

import json

from ..errors import StoreCorrupt
from .backend import Backend

FOLDER = "calibration"
FORMAT = 1


def calibration_key(version: int) -> str:
    return f"{FOLDER}/v{version:06d}.json"


def read_calibration(backend: Backend, version: int) -> dict:
    """{device kind: record} of `version` ({} when it was never calibrated)."""
    try:
        raw = backend.get(calibration_key(version))
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(raw)
        if doc.get("format", 0) > FORMAT:
            return {}  # written by a newer sparsecache: not understood, so not used
        return dict(doc["devices"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise StoreCorrupt(f"{backend}: {calibration_key(version)} is unreadable ({type(e).__name__})") from e


def write_calibration(backend: Backend, version: int, devices: dict) -> None:
    """Set `version`'s calibration to `devices` ({} removes it). Only the writer, holding the
    lock, calls this, and only for a version it is about to publish."""
    if devices:
        backend.put(calibration_key(version), json.dumps({"format": FORMAT, "devices": devices},
                                                         indent=1, sort_keys=True).encode())
    elif backend.exists(calibration_key(version)):
        backend.delete(calibration_key(version))
