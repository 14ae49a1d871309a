"""Stores compared with each other: live chunks code by code (the fault-injection property
against a fresh encode), every version's codes exactly, and copies of a store."""

from __future__ import annotations

from pathlib import Path


import numpy as np

from sparsecache.kvstore import KVStore
from sparsecache.store import read_manifest


def copy_store(src, dst) -> str:
    """Replace the store at `dst` by a copy of the one at `src` (paths or URLs; a `src` with
    nothing in it leaves `dst` empty)."""
    from sparsecache.store import open_backend

    a, b = open_backend(src), open_backend(dst)
    b.delete_tree("")
    for key in a.list(""):
        b.put(key, a.get(key))
    return str(dst)


def live_chunks(path: Path) -> dict[tuple[str, int], tuple]:
    """(document, ordinal) → (text, tokens, K indices, K coefficients, V indices, V coefficients)."""
    s = KVStore.open(path)
    chunks = s.chunks()
    texts = s.texts([c.id for c in chunks])
    out = {}
    for c, text in zip(chunks, texts):
        codes = s.read_codes([c.id])
        key = (c.doc_id, c.ordinal)
        assert key not in out, f"chunk {key} is live twice"
        out[key] = (text, codes.tokens.tolist(), codes.k.indices, codes.k.coefficients.astype(np.float32),
                    codes.v.indices, codes.v.coefficients.astype(np.float32))
    return out


def assert_same_live_chunks(got: Path, want: Path) -> None:
    """The property, against a fresh encode. Texts and tokens are exact; codes come from model
    forwards batched differently (a document's neighbours differ), which moves KV in the last
    bit: coefficients may differ by an fp16 ulp and, very rarely, OMP may pick another atom
    in a near-tie."""
    a, b = live_chunks(got), live_chunks(want)
    assert sorted(a) == sorted(b), f"live chunks differ: only in store {sorted(set(a) - set(b))[:5]}, " \
                                   f"only in fresh {sorted(set(b) - set(a))[:5]}"
    rows = same = 0
    for key in a:
        (ta, toka, *ca), (tb, tokb, *cb) = a[key], b[key]
        assert ta == tb and toka == tokb, f"{key}: text or tokens differ"
        for idx_a, coef_a, idx_b, coef_b in ((ca[0], ca[1], cb[0], cb[1]), (ca[2], ca[3], cb[2], cb[3])):
            eq = (idx_a == idx_b).all(axis=-1)  # [G, T]: rows whose atoms agree
            rows, same = rows + eq.size, same + int(eq.sum())
            np.testing.assert_allclose(coef_a[eq], coef_b[eq], rtol=2**-9, atol=1e-6)
    assert same >= 0.995 * rows, f"only {same} of {rows} code rows chose the same atoms"
    ma, mb = read_manifest(got), read_manifest(want)
    assert {d: (x["hash"], x["count"], x["tokens"]) for d, x in ma.documents.items()} == \
           {d: (x["hash"], x["count"], x["tokens"]) for d, x in mb.documents.items()}
    s = KVStore.open(got)
    np.testing.assert_array_equal(s.index_rows(), s.live_rows())
    assert len(s.live_rows()) == len(a)


# ---------------------------------------------------------------- comparing stores code by code


def all_codes(path: Path, version=None) -> dict[str, tuple]:
    s = KVStore.open(path, version)
    out = {}
    for c in s.chunks():
        codes = s.read_codes([c.id])
        out[c.id] = (c.doc_id, codes.tokens, codes.k.indices, codes.k.coefficients, codes.v.indices,
                     codes.v.coefficients)
    return out


def assert_same_codes(a: dict, b: dict):
    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid][0] == b[cid][0]
        for x, y in zip(a[cid][1:], b[cid][1:]):
            np.testing.assert_array_equal(x, y)


OLD_READER = ("import sys\n"  # an editable install's finder would import this checkout's sparsecache instead
              "sys.meta_path = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
              "import sparsecache; assert sparsecache.__file__.startswith(sys.argv[2]), sparsecache.__file__\n"
              "from sparsecache.kvstore import KVStore\n"
              "s = KVStore.open(sys.argv[1]); c = s.chunks()\n"
              "print(s.version, len(c), len(s.load_kv([c[0].id])), s.info()['version'])")


def open_in_release(commit: str, store: Path, tmp: Path):
    """Open `store` with the sparsecache of git `commit` (its package from `git archive`, in a process of its
    own): list its chunks, decode one, read its info. The finished process (stdout: version, chunks, the
    chunks decoded, info's version); the test is skipped where the checkout has no history."""
    import subprocess
    import sys

    import pytest

    from support import REPO

    old = tmp / f"release-{commit}"
    old.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "sparsecache"], capture_output=True)
    if archive.returncode:
        pytest.skip(f"no git history to take the older reader from: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    return subprocess.run([sys.executable, "-c", OLD_READER, str(store), str(old)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(old), "PATH": "/usr/bin:/bin", "HOME": str(tmp)}, timeout=300,
                          cwd=tmp)
