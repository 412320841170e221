"""Read the built book as a reader's browser would get it, and fail on what must never reach a page.

    python book/check_html.py [book/_build/html]

Per page: MyST roles or glue left raw in the prose ({glue:text}`x`, {eval}`x`, an unfilled {{name}});
TeX outside math, or TeX escapes that MathJax shows as typed (\\_ inside \\text{}/\\texttt{}); error
outputs and tracebacks; images whose files are missing; a chapter page without a Summary and
Exercises section. Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

RAW_ROLE = re.compile(r"\{(glue|eval|numref|ref|doc|math|download)(:[a-z]+)?\}`")
PLACEHOLDER = re.compile(r"\{\{\s*\w+\s*\}\}")
TEX_IN_PROSE = re.compile(r"\\(frac|texttt|text|mathrm|operatorname|cdot|qquad|sum|begin)\b")
ESCAPE_IN_TEXT = re.compile(r"\\(text|texttt|textrm|mbox)\{[^}]*\\_")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")


class Page(HTMLParser):
    """Collects a page's prose (outside code, math, scripts), its math, its images and headings."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.prose, self.math, self.images, self.h2, self.errors = [], [], [], [], []
        self.stack: list[tuple[str, str]] = []  # (tag, class)
        self.in_h2 = False

    def _inside(self, what) -> bool:
        return any(what(tag, cls) for tag, cls in self.stack)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class") or ""
        if tag == "img":
            self.images.append(a.get("src", ""))
            return
        if tag in ("br", "hr", "meta", "link", "input"):
            return
        if "traceback" in cls.split() or "error" in cls.split() and "output" in cls.split():
            self.errors.append(f"an error output (<{tag} class=\"{cls}\">)")
        self.stack.append((tag, cls))
        if tag == "h2":
            self.in_h2 = True
            self.h2.append("")

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag == "h2":
            self.in_h2 = False

    def handle_data(self, data):
        if self.in_h2:
            self.h2[-1] += data
        if self._inside(lambda t, c: t in ("script", "style", "head")):
            return
        if self._inside(lambda t, c: "math" in c.split()):
            self.math.append(data)
            return
        if self._inside(lambda t, c: t in ("pre", "code")):
            if TRACEBACK.search(data):
                self.errors.append("a traceback in an output")
            return
        self.prose.append(data)


def check_page(path: Path, root: Path) -> list[str]:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    rel = path.relative_to(root).as_posix()
    problems = [f"{rel}: {e}" for e in page.errors]
    prose = " ".join(page.prose)
    for pattern, what in ((RAW_ROLE, "a raw MyST role"), (PLACEHOLDER, "an unfilled {{name}} placeholder"),
                          (TEX_IN_PROSE, "TeX outside math")):
        for m in pattern.finditer(prose):
            context = prose[max(0, m.start() - 40): m.end() + 40].replace("\n", " ")
            problems.append(f"{rel}: {what}: ...{context}...")
    for m in ESCAPE_IN_TEXT.finditer(" ".join(page.math)):
        problems.append(f"{rel}: a TeX escape MathJax shows as typed: {m.group(0)}")
    for src in page.images:
        if src.startswith(("data:", "http:", "https:")):
            continue
        target = (path.parent / src.split("#")[0].split("?")[0]).resolve()
        if not target.is_file():
            problems.append(f"{rel}: an image that does not load: {src}")
    if re.match(r"chapters/\d\d[a-z]?_", rel) and not rel.startswith("chapters/00_"):
        titles = [re.sub(r"\W+$", "", h.strip().lower()) for h in page.h2]
        for section in ("summary", "exercises"):
            if section not in titles:
                problems.append(f"{rel}: a chapter page without a '{section.title()}' section")
    return problems


def book_pages(root: Path) -> list[Path]:
    """The book's pages: every HTML file but the theme's and the sources' copies."""
    return sorted(p for p in root.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


def check_book(root: Path) -> list[str]:
    pages = book_pages(root)
    if not pages:
        return [f"{root}: no HTML pages (build the book first: ./dev.sh book)"]
    problems = []
    for page in pages:
        problems += check_page(page, root)
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0] if args else Path(__file__).resolve().parent / "_build" / "html").resolve()
    problems = check_book(root)
    for line in problems:
        print(line)
    count = len(book_pages(root))
    print(f"{len(problems)} problem(s) in {count} pages under {root}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
