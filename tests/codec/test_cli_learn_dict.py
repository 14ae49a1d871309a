"""`sparsecache learn-dict` through the CLI: a loadable dictionary written, bad input in one line,
per-layer scales for grouped signals, and a run continued from a dictionary."""

import json

import pytest
import torch

from click.testing import CliRunner

from sparsecache.cli.main import cli
from sparsecache.codec.dictionary import Dictionary


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_learn_dict_writes_a_loadable_dictionary(tiny_model, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "dict"
    r = run("learn-dict", "--model", tiny_model_dir, "--text", text_file, "--atoms", 64, "--sparsity", 4,
            "--layers-per-signal", 2, "--steps", 6, "--batch", 128, "--max-tokens", 3000, "--out", out)
    assert r.exit_code == 0, r.output
    assert "held-out NMSE" in r.output
    d = Dictionary.load(out)
    d.check_model(tiny_model.fingerprint())
    meta = json.loads((out / "dictionary.json").read_text())
    for key in ("atoms", "sparsity", "layers_per_signal", "model", "heldout_nmse", "data", "library_version",
                "fingerprint", "train", "normalisation"):
        assert key in meta
    assert meta["layers_per_signal"] == 2 and d.keys.shape == (64, 64)
    assert meta["data"]["train"]["tokens"] > 0 and (out / "checkpoint" / "state.json").exists()
    r = run("learn-dict", "--model", tiny_model_dir, "--text", text_file, "--atoms", 64, "--sparsity", 4,
            "--layers-per-signal", 2, "--steps", 6, "--batch", 128, "--max-tokens", 3000, "--out", out, "--resume")
    assert r.exit_code == 0, r.output


def one_line_error(r, fragment):
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    assert fragment in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_bad_input_is_one_line(tiny_model_dir, text_file, tmp_path):
    base = ["learn-dict", "--model", tiny_model_dir, "--out", tmp_path / "o", "--steps", 1, "--layers-per-signal", 1]
    one_line_error(run(*base, "--text", text_file, "--layers-per-signal", 3), "must divide")
    one_line_error(run(*base, "--text", text_file, "--atoms", 70000), "65536")
    one_line_error(run(*base, "--text", text_file, "--layers-per-signal", 1, "--sparsity", 65),
                   "exceeds the signal size")
    one_line_error(run(*base, "--text", tmp_path / "missing.txt"), "not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    one_line_error(run(*base, "--text", empty), "no text")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    one_line_error(run(*base, "--text", binary), "binary")
    one_line_error(run("learn-dict", "--model", tmp_path, "--out", tmp_path / "o"), "no config.json")


def test_grouped_signals_get_per_layer_scales_and_init_continues_from_a_dictionary(tiny_model, tiny_model_dir,
                                                                                  text_file, tmp_path):
    first = tmp_path / "first"
    base = ["--model", tiny_model_dir, "--text", text_file, "--batch", 128, "--max-tokens", 3000]
    r = run("learn-dict", *base, "--atoms", 64, "--sparsity", 4, "--layers-per-signal", 2, "--steps", 4,
            "--out", first)
    assert r.exit_code == 0, r.output
    d = Dictionary.load(first)
    assert set(d.scales) == {"k", "v"} and d.scales["v"].shape == (tiny_model.n_layers,)
    assert json.loads((first / "dictionary.json").read_text())["format_version"] == 2

    r = run("learn-dict", *base, "--init", first, "--steps", 4, "--out", tmp_path / "second")
    assert r.exit_code == 0, r.output
    e = Dictionary.load(tmp_path / "second")
    assert d.atoms_dtype == e.atoms_dtype == "float16"
    assert e.config == d.config and all(torch.equal(e.scales[k], d.scales[k]) for k in "kv")
    assert e.meta["started_from"]["fingerprint"] == d.fingerprint()
    # the bar is the starting dictionary's own held-out NMSE: adaptation never makes it worse there
    start = e.meta["started_from"]["heldout_nmse"]
    assert all(e.meta["heldout_nmse"][k] <= start[k] for k in "kv")
    # resumed from its checkpoint, the record still names the starting dictionary's NMSE
    r = run("learn-dict", *base, "--init", first, "--steps", 8, "--resume", "--out", tmp_path / "second")
    assert r.exit_code == 0, r.output
    resumed = Dictionary.load(tmp_path / "second").meta
    assert resumed["history"][-1]["step"] == 8
    assert resumed["started_from"]["heldout_nmse"] == pytest.approx(start, rel=1e-4)

    # the sparsity is a coding choice, not part of the atoms: continuing at another s is allowed,
    # and the bar is the starting atoms coded at the new s (more atoms per code: a lower error)
    r = run("learn-dict", *base, "--init", first, "--sparsity", 8, "--steps", 4, "--out", tmp_path / "s8")
    assert r.exit_code == 0, r.output
    s8 = Dictionary.load(tmp_path / "s8")
    assert (s8.config.sparsity, s8.config.atoms, s8.config.layers_per_signal) == (8, 64, 2)
    assert s8.meta["started_from"]["sparsity"] == 4
    assert all(s8.meta["started_from"]["heldout_nmse"][k] < d.meta["heldout_nmse"][k] for k in "kv")
    # float32 atoms on request, and a continuation keeps its starting dictionary's
    r = run("learn-dict", *base, "--init", first, "--steps", 2, "--atoms-dtype", "float32", "--out", tmp_path / "h")
    assert r.exit_code == 0, r.output
    assert Dictionary.load(tmp_path / "h").atoms_dtype == "float32"
    r = run("learn-dict", *base, "--init", tmp_path / "h", "--steps", 2, "--out", tmp_path / "h2")
    assert r.exit_code == 0, r.output
    assert Dictionary.load(tmp_path / "h2").atoms_dtype == "float32"
    one_line_error(run("learn-dict", *base, "--init", first, "--atoms", 32, "--out", tmp_path / "x"),
                   "--atoms 32 (it has 64)")
