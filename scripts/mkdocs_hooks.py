"""MkDocs hooks: the repository's root documents are pages of the manual too.

README.md (the home page), BENCHMARKS.md, CHANGELOG.md and dictionaries/README.md live where a
reader of the repository expects them; the site reads them from there instead of keeping
copies in docs/. Every page's relative links are written for the repository (so they work when
browsing it), and each is rewritten for the site: a link to one of these documents or into
docs/ points at its page or file on the site; a link to a file the site does not hold (a
script, a test) keeps its text and loses the link; a link to nothing at all is left as it is,
for `mkdocs build --strict` to fail on.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md",
         "dictionaries/README.md": "dictionaries.md"}
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def site_target(source: str, target: str) -> str | None:
    """Where the link `target` in repository file `source` points on the site: a path relative
    to the site's root, "" for a repository file the site does not hold, None for nothing."""
    path, _, anchor = target.partition("#")
    if not path or "://" in path or path.startswith("mailto:"):
        return target
    rel = (ROOT / source).parent.joinpath(path).resolve()
    here = PAGES.get(source, source[len("docs/"):] if source.startswith("docs/") else source)
    try:
        rel_s = rel.relative_to(ROOT).as_posix()
    except ValueError:
        return None
    if rel_s in PAGES:
        rel_s = PAGES[rel_s]
    elif rel_s.startswith("docs/") and rel.exists():
        rel_s = rel_s[len("docs/"):]
    elif rel.exists():
        return ""
    else:
        return None
    depth = here.count("/")  # the link is relative to the page's own place on the site
    return "../" * depth + rel_s + (f"#{anchor}" if anchor else "")


def rewrite(source: str, text: str) -> str:
    def one(m: re.Match) -> str:
        bang, label, target = m.groups()
        where = site_target(source, target)
        if where is None:
            return m.group(0)
        if where == "":
            return label
        return f"{bang}[{label}]({where})"

    return LINK.sub(one, text)


SOURCES = {page: source for source, page in PAGES.items()}


def on_files(files: Files, config) -> Files:
    for source, page in PAGES.items():
        files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    return rewrite(SOURCES.get(uri, f"docs/{uri}"), markdown)
