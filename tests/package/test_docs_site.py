"""The manual builds as a site with nothing broken: `mkdocs build --strict` fails on a broken
link, a page missing from the navigation or a docstring reference that does not resolve; the
CLI reference is generated from the click commands, so it lists every command."""

import shutil
import subprocess
import sys

import pytest
from support import REPO


pytest.importorskip("mkdocs", reason="the docs extra (setup.sh test installs it)")
pytest.importorskip("mkdocs_click")
pytest.importorskip("mkdocstrings")


def test_the_manual_builds_strict_and_its_cli_reference_lists_every_command(tmp_path):
    from test_cli_docs import command_paths

    from sparsecache.cli.main import cli

    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for path in command_paths(cli):
        assert path.split(" ", 1)[1] in cli_page, path
    home = (tmp_path / "site" / "index.html").read_text()
    assert "sparsecache encode-corpus builtin:heldout" in home and 'href="concepts/pipeline/"' in home


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "repo"
    shutil.copytree(REPO / "docs", docs / "docs", ignore=shutil.ignore_patterns("benchmarks"))
    for name in ("mkdocs.yml", "README.md", "BENCHMARKS.md", "CHANGELOG.md"):
        shutil.copy(REPO / name, docs / name)
    (docs / "dictionaries").mkdir()
    shutil.copy(REPO / "dictionaries" / "README.md", docs / "dictionaries" / "README.md")
    (docs / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "mkdocs_hooks.py", docs / "scripts" / "mkdocs_hooks.py")
    page = docs / "docs" / "how-to" / "nightly.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=docs,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "no-such-page.md" in r.stderr
