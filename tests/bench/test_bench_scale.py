"""`sparsecache bench scale` end to end at a tiny size: every field the issue names is there, a
nightly publish writes a small part of what the store holds, and the search finds what exact
search finds (a flat index at this size)."""

import json

from click.testing import CliRunner

from sparsecache.cli.main import cli

FIELDS = ("chunks", "open_s", "search_p50_ms", "search_p99_ms", "recall_at_8", "publish_1pct_s", "publish_bytes",
          "reader_peak_gb", "writer_peak_gb")


def test_bench_scale_measures_every_field_at_a_small_size(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "scale", "--workdir", str(tmp_path), "--sizes", "3000", "--queries", "5",
                                 "--json"])
    assert r.exit_code == 0, r.output
    row, = json.loads(r.output)["rows"]
    assert all(f in row for f in FIELDS) and row["chunks"] == 3000 and row["search_warm_p99_ms"] > 0
    assert row["warm_up_s"] >= 0 and row["search_warmed_p99_ms"] > 0 and row["after_search_warmed_p99_ms"] > 0
    assert 0 < row["search_warmed_index_ms_p50"] <= row["search_warmed_index_ms_p99"] and row["search_warmed_rows_ms_p99"] > 0
    assert row["recall_at_8"] == 1.0 and row["after_recall_at_8"] == 1.0 and row["after_live_chunks"] == 2970
    assert 0 < row["publish_bytes"] < row["store_bytes"] / 5 and row["publish_delete_1pct_bytes"] < row["publish_bytes"]
    assert (tmp_path / "scale.json").exists() and (tmp_path / "scale.png").exists()
    assert not (tmp_path / "n3000").exists()  # the synthetic store is removed once measured


def test_a_stopped_run_resumes_from_the_phase_after_the_last_finished(tmp_path, monkeypatch):
    import pytest

    from sparsecache.bench import scale

    calls, killed, real = [], [], scale.in_fresh_process

    def child(fn, *args):
        calls.append(fn.__name__)
        if fn.__name__ == "_nightly" and not killed:
            killed.append(fn)
            raise RuntimeError("killed in the first nightly publish")
        return real(fn, *args)

    monkeypatch.setattr(scale, "in_fresh_process", child)
    cfg = scale.ScaleConfig(sizes=(2000,), queries=3)
    with pytest.raises(RuntimeError, match="killed"):
        scale.run(tmp_path, cfg)
    calls.clear()
    row, = scale.run(tmp_path, cfg, resume=True)["rows"]
    assert "build_store" not in calls and calls.count("_nightly") == 2  # built once; both publishes measured
    assert all(f in row for f in FIELDS) and "_phases" not in row and row["after_live_chunks"] == 1980
