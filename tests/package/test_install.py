"""An installed sparsecache, not the checkout: `pip install .` (a wheel, not editable) into a
fresh venv, then the main job run from another directory must find the default model and
the default dictionary (package data), and no module may come from the repository."""

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest
from support import REPO

pytestmark = pytest.mark.slow


def _venv_over_this_python(env_dir: Path) -> Path:
    """A new venv at `env_dir` that sees the packages of the Python running the tests (torch,
    transformers, the packaged models), whether that is a base interpreter or a venv: their
    site-packages are listed in a .pth file, after the new venv's own, whose packages come first.
    (`system_site_packages=True` would show the base interpreter's packages, not an active
    venv's: in a venv, nothing the user installed would be seen.) Their own .pth files are not
    read, so an editable sparsecache there does not shadow one installed here. Returns its python."""
    import sys
    import sysconfig

    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    seen = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))])
    (Path(own) / "outer-python.pth").write_text("\n".join(p for p in seen if Path(p).is_dir()) + "\n")
    return py


def test_a_wheel_install_runs_the_main_job_from_another_directory(tmp_path):
    env_dir = tmp_path / "venv"
    # the venv sees the test run's packages (torch, transformers, the packaged models) but gets
    # its own, non-editable sparsecache, which comes first on its path; built as `pip install .` builds it
    py = _venv_over_this_python(env_dir)
    exe = env_dir / "bin" / "sparsecache"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(REPO)],
                   check=True, cwd=tmp_path, timeout=600)
    work = tmp_path / "elsewhere"
    (work / "corpus").mkdir(parents=True)
    (work / "corpus" / "tea.md").write_text(
        "# Tea\n\nThe harbour town of Velmora brews its tea with smoked pine needles. "
        "Its mayor, Ilse Barkri, serves it to every visitor at noon.\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([py, "-c", "import sparsecache, sparsecache.codec.dictionary as d; "
                            "print(sparsecache.__file__); print(d.default_dictionary())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert all(Path(p).is_relative_to(env_dir) for p in where), where  # the wheel's copy, not the checkout's

    def run(*args):
        r = subprocess.run([exe, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    run("encode-corpus", "corpus", "--store", "tea.store")
    info = json.loads(run("info", "tea.store", "--json"))
    shipped = json.loads((Path(where[1]) / "dictionary.json").read_text())
    assert info["dictionary"] == shipped["fingerprint"] and info["model"]["name"] == "SmolLM2-135M-Instruct", info
    out = json.loads(run("query", "tea.store", "Who is the mayor of Velmora?", "--max-new-tokens", "12", "--json"))
    assert out["chunks"][0]["doc_id"] == "tea.md" and out["answer"].strip(), out


def _upper_bound(package: str) -> str:
    """The `<` bound pyproject.toml gives `package` ("transformers>=5.19,<5.25" → "<5.25")."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith(package + ">") or d.startswith(package + "<"))
    return "<" + spec.split("<")[1]


def test_the_newest_transformers_allowed_runs_the_model_tests_without_deprecation_warnings(tmp_path):
    """The suite runs at the lower transformers bound (vLLM's CPU build pins it); this runs the
    model, capture and family tests at the newest release below the upper bound, with our own
    deprecated calls turned into errors (5.24 renamed `past_key_values` to `cache`)."""
    py = _venv_over_this_python(tmp_path / "venv")
    spec = "transformers" + _upper_bound("transformers")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", spec], check=True, timeout=600)
    version = subprocess.run([py, "-c", "import transformers; print(transformers.__version__)"], capture_output=True,
                             text=True, check=True, timeout=120).stdout.strip()
    r = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error:.*past_key_values:FutureWarning",
                        "tests/model/test_model.py", "tests/model/test_check_model.py",
                        "tests/model/test_families.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"transformers {version}:\n{r.stdout[-3000:]}"


def test_the_plots_need_no_optional_package():
    """`bench scale` and the other benchmarks plot after minutes of work: the plotting package is
    a core dependency, so the README's install (no extras) has it and no run loses its figures."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "matplotlib" for d in deps), deps
