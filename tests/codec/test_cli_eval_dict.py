"""`sparsecache eval-dict`: a dictionary's reconstruction error on held-out text as a store reader
sees it (layer 0 included), per domain with the worst as the headline, at the encode forward's
dtype, and refused for another model."""

import json

from click.testing import CliRunner

from sparsecache.cli.main import cli
from sparsecache.codec.dictionary import DictConfig, Dictionary
from sparsecache.testing import unit_atoms


def test_eval_dict_json(tiny_model, tiny_model_dir, tmp_path):
    d = Dictionary(unit_atoms(32, 128, 1), unit_atoms(32, 128, 2), DictConfig(128, 32, 1), tiny_model.fingerprint())
    d.save(tmp_path / "d")
    r = CliRunner().invoke(cli, ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir), "--passages", 2,
                                 "--prefix-tokens", 64, "--continuation-tokens", 16, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # the JSON object is the only thing on stdout
    for key in ("nmse_k", "nmse_v", "ppl_exact", "ppl_reconstructed", "top1_agreement", "kl", "ratio"):
        assert key in out
    # s = m: OMP codes every signal exactly (up to fp16 coefficients), so fidelity is near perfect
    assert out["nmse_k"] < 1e-4 and out["nmse_v"] < 1e-4
    assert out["top1_agreement"] > 0.95 and abs(out["ppl_reconstructed"] / out["ppl_exact"] - 1) < 0.01
    assert len(out["nmse_k_per_layer"]) == 4
    lo, hi = out["ppl_change_ci95"]  # two passages: an interval around the measured change
    assert lo - 1e-5 <= out["ppl_reconstructed"] / out["ppl_exact"] - 1 <= hi + 1e-5  # ppl is float32
    assert out["ratio"]["theoretical_excl_dict"] < 1  # s = m costs more than fp16; honest arithmetic

    # as a store writes them: fp8 coefficients, half the coefficient bytes and a little more error
    r = CliRunner().invoke(cli, ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir), "--passages", 2,
                                 "--prefix-tokens", 64, "--continuation-tokens", 16, "--coef", "float8", "--json"])
    assert r.exit_code == 0, r.output
    fp8 = json.loads(r.stdout)
    assert fp8["config"]["coef_dtype"] == "float8"
    assert fp8["ratio"]["theoretical_excl_dict"] > out["ratio"]["theoretical_excl_dict"]
    assert fp8["nmse_v"] > out["nmse_v"]


def test_eval_dict_reads_layer_0_as_a_store_reader_does(tiny_model, tiny_model_dir, tmp_path):
    """By default layer 0 is exact, as queries recompute it from the tokens; --first-layer codes
    measures the codes' error there too."""
    d = Dictionary(unit_atoms(32, 128, 1), unit_atoms(32, 128, 2), DictConfig(128, 4, 1), tiny_model.fingerprint())
    d.save(tmp_path / "d")
    args = ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir), "--passages", 1, "--prefix-tokens", 32,
            "--continuation-tokens", 8, "--json"]
    default, codes = (json.loads(CliRunner().invoke(cli, args + extra).stdout)
                      for extra in ([], ["--first-layer", "codes"]))
    assert default["config"]["first_layer"] == "tokens" and codes["config"]["first_layer"] == "codes"
    assert default["nmse_k_per_layer"][0] == 0 and default["nmse_v_per_layer"][0] == 0
    assert codes["nmse_k_per_layer"][0] > 0.01 and codes["nmse_v_per_layer"][0] > 0.01
    assert default["nmse_k_per_layer"][1:] == codes["nmse_k_per_layer"][1:]


def test_eval_dict_for_another_model_is_refused(tiny_model_dir, tmp_path):
    fp = {"name": "other", "config_hash": "abc", "layers": 4, "m": 32}
    Dictionary(unit_atoms(32, 64), unit_atoms(32, 64), DictConfig(64, 4), fp).save(tmp_path / "d")
    r = CliRunner().invoke(cli, ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir)])
    assert r.exit_code != 0 and "learned for other" in r.output and "Traceback" not in r.output


def test_each_text_is_a_domain_and_the_headline_is_the_worst(tiny_model, tiny_model_dir, tmp_path):
    """A sparse dictionary (s = 4 of m = 32) fits one text better than another; eval-dict
    reports both and headlines the one it serves worst, and --record keeps every domain."""
    from sparsecache.text.documents import builtin_documents

    prose = tmp_path / "prose"
    prose.mkdir()
    (prose / "a.txt").write_text("\n\n".join(d.text for d in builtin_documents("heldout")[:6]))
    digits = tmp_path / "digits.txt"
    digits.write_text(" ".join(str(i * 7919 % 100003) for i in range(3000)))
    d = Dictionary(unit_atoms(32, 128, 1), unit_atoms(32, 128, 2), DictConfig(128, 4, 1), tiny_model.fingerprint())
    d.save(tmp_path / "d")
    r = CliRunner().invoke(cli, ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir), "--passages", 2,
                                 "--prefix-tokens", 64, "--continuation-tokens", 16, "--text", str(prose),
                                 "--text", str(digits), "--record", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out["domains"]) == {"prose", "digits.txt"}
    worst = min(out["domains"], key=lambda k: out["domains"][k]["top1_agreement"])
    assert out["worst_domain"] == worst and out["top1_agreement"] == out["domains"][worst]["top1_agreement"]
    for x in out["domains"].values():
        assert x["passages"] == 2 and x["worst_layer_nmse_v"] == max(x["nmse_v_per_layer"])
    assert out["passages"] == 4
    recorded = Dictionary.load(tmp_path / "d").meta["eval"]
    assert set(recorded["domains"]) == {"prose", "digits.txt"} and "nmse_v_per_layer" not in recorded["domains"]["prose"]


def test_eval_dict_codes_the_k_v_of_the_encode_forwards_dtype(tiny_model, tiny_model_dir, tmp_path):
    """--forward-dtype: the K/V coded are those the encode's forward gives in that dtype (a store
    encoded on a CPU with bfloat16 dot products holds those of a bfloat16-autocast forward), measured
    against the exact float32 K/V. With s = m the codes are exact, so bfloat16's rounding is all the
    error there is: small, and more than float32's."""
    d = Dictionary(unit_atoms(32, 128, 1), unit_atoms(32, 128, 2), DictConfig(128, 32, 1), tiny_model.fingerprint())
    d.save(tmp_path / "d")
    args = ["eval-dict", str(tmp_path / "d"), "--model", str(tiny_model_dir), "--passages", 1, "--prefix-tokens", 48,
            "--continuation-tokens", 8, "--coef", "float32", "--json"]
    f32, bf16 = (json.loads(CliRunner().invoke(cli, args + ["--forward-dtype", dt]).stdout)
                 for dt in ("float32", "bfloat16"))
    assert f32["config"]["forward_dtype"] == "float32" and bf16["config"]["forward_dtype"] == "bfloat16"
    assert f32["nmse_v"] < 1e-8 < bf16["nmse_v"] < 1e-3
    assert bf16["nmse_v_per_layer"][0] == 0  # layer 0 as a reader gets it: recomputed from the tokens, exact
