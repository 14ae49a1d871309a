"""docs/tables/ttft_table.py: BENCHMARKS' TTFT tables from `bench ttft --json` rows."""

import runpy

from sparsecache.query.session import STEPS
from support import REPO

PHASES = tuple(s for s in STEPS if s != "retrieve")


def _row(k, method, ratio, cache, ttft):
    return {"k": k, "method": method, "ratio": ratio, "page_cache": cache, "context_tokens": 1000 * k,
            "recomputed_tokens": int(ratio * 1000 * k), "bytes_read": 2_500_000 * k, "ttft": ttft,
            "retrieve": 0.0, **{p: ttft / len(PHASES) for p in PHASES}}


def test_ttft_tables_put_each_method_and_k_in_its_cell():
    script = runpy.run_path(str(REPO / "docs" / "tables" / "ttft_table.py"))
    rows = [_row(2, "full", 0, "warm", 3000), _row(2, "infoflow", 0.15, "warm", 1200),
            _row(8, "full", 0, "warm", 15000), _row(8, "infoflow", 0.15, "warm", 5100),
            _row(8, "infoflow", 0.15, "cold", 6100)]
    grid = script["ttft_table"](rows).splitlines()
    assert grid[0] == "| method | k=2 | k=8 |"
    assert grid[2:] == ["| full | 3.00 s | 15.00 s |", "| infoflow | 1.20 s | 5.10 s |"]  # cold rows kept out
    lines = script["breakdown_table"](rows, [8]).splitlines()[2:]
    assert [line.split(" | ")[:3] for line in lines] == [["| 8", "full", "warm"], ["| 8", "infoflow r=0.15", "warm"],
                                                         ["| 8", "infoflow r=0.15", "cold"]]
    assert lines[1].endswith("| 20.0 MB | " + " | ".join(["729"] * len(PHASES)) + " | **5,100** |")


def test_calibration_text_splits_by_section_name_and_reads_git_docs(tmp_path):
    """scripts/calibration_text.py: sections end at paragraphs, the held-out part is fixed by
    the sections' names (≥ 10% and ≥ HELDOUT_MIN_CHARS), and git-doc's manual is read from the
    unpacked package, subfolders included, without a name clash."""
    script = runpy.run_path(str(REPO / "scripts" / "calibration_text.py"))
    para = "word " * 300
    secs = script["sections"]([("doc", "\n\n".join([para] * 40))])
    assert len(secs) > 10 and all(len(t) >= script["SECTION_CHARS"] or n.endswith(f"#{len(secs) - 1}") for n, t in secs)
    train, held = script["split"](secs)
    assert not {n for n, _ in train} & {n for n, _ in held} and len(train) + len(held) == len(secs)
    assert len(held) >= len(secs) / 10 and sum(len(t) for _, t in held) >= min(
        script["HELDOUT_MIN_CHARS"], sum(len(t) for _, t in secs))
    assert {n for n, _ in script["split"](secs[::-1])[1]} == {n for n, _ in held}  # by name, not by order
    docs = tmp_path / "usr/share/doc/git-doc"
    (docs / "howto").mkdir(parents=True)
    (docs / "git-log.txt").write_text("git-log(1)\n")
    (docs / "howto" / "git-log.txt").write_text("How to read the log.\n")
    names = [n for n, _ in script["git_docs"](tmp_path)]
    assert sorted(names) == ["git:git-log", "git:howto/git-log"]
