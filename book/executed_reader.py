"""The book's reader for chapters: the notebook that book/execute_chapters.py ran, outputs and all.

_config.yml names `executed_reader.reads` as the reader of `.py` pages, and the book builds with
execution off: each chapter was executed once, on all cores, before the build. The reader gets a
chapter's text, finds the executed notebook whose source hash matches it (book/_build/nb/), and
returns it. A chapter with no such notebook (never executed, or edited since) is an error that says
what to run: the book never shows a page whose outputs belong to other code.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from execute_chapters import OUT, source_hash


@lru_cache(maxsize=1)
def _executed() -> dict[str, Path]:
    """source hash -> executed notebook, for every notebook that ran without error."""
    found = {}
    for path in sorted(OUT.glob("*.ipynb")):
        meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("tinyvllm", {})
        if meta.get("ok") and meta.get("source_sha256"):
            found[meta["source_sha256"]] = path
    return found


def reads(text: str, fmt: str = "py:percent"):
    """Return the executed notebook of the chapter whose source is `text`."""
    import nbformat

    path = _executed().get(source_hash(text))
    if path is None:
        first = next((line for line in text.splitlines() if line.startswith("# #")), text[:60])
        raise ValueError(
            f"no executed notebook in {OUT} matches the chapter {first.lstrip('# ')!r} "
            "(not executed, failed, or edited since): run `python book/execute_chapters.py` "
            "(./dev.sh book does) before building the book"
        )
    return nbformat.read(str(path), as_version=4)


def setup(app):
    """A Sphinx extension only so that _config.yml puts book/ on the path for `reads`."""
    return {"parallel_read_safe": True, "parallel_write_safe": True}
