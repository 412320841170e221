"""The check CI runs on the built book (book/check_html.py): a good page passes, a planted bad page
fails with every fault named. (CI runs the check itself on the whole book after building it.)"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_html", ROOT / "book" / "check_html.py")
check_html = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_html)

GOOD = """<html><head><title>x</title><script>var s = "{glue:text}`x`";</script></head><body>
<h1>3. A chapter</h1><p>The copy moves 3.95 TB/s, with {braces} in prose.</p>
<span class="math notranslate nohighlight">\\(\\mathtt{max\\_model\\_len} + \\frac{a}{b}\\)</span>
<div class="cell_output"><pre>ValueError: a message the chapter prints on purpose</pre></div>
<pre><code>prose.glue("x", "{glue:text}`y` in code is fine")</code></pre>
<img src="fig.png"/><img src="data:image/png;base64,AAAA"/>
<h2>Summary<a class="headerlink" href="#summary">#</a></h2><h2>Exercises</h2></body></html>"""

BAD = """<html><body><h1>4. Another</h1>
<p>The kernel reaches {glue:text}`ch04_ratio` of the copy, and {{ch04_other}} too.</p>
<p>A formula left as text: \\frac{a}{b}.</p>
<span class="math notranslate nohighlight">\\(\\texttt{max\\_model\\_len}\\)</span>
<div class="output traceback"><pre>Traceback (most recent call last):
  ValueError: boom</pre></div>
<img src="missing.png"/>
<h2>Summary</h2></body></html>"""


@pytest.fixture
def book(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "chapters" / "03_good.html").write_text(GOOD)
    (tmp_path / "chapters" / "fig.png").write_bytes(b"\x89PNG")
    return tmp_path


def test_a_good_page_passes(book):
    assert check_html.check_book(book) == []
    assert check_html.main([str(book)]) == 0


def test_a_planted_bad_page_fails_on_every_fault(book):
    (book / "chapters" / "04_bad.html").write_text(BAD)
    problems = "\n".join(check_html.check_book(book))
    for fault in ("a raw MyST role", "an unfilled {{name}} placeholder", "TeX outside math",
                  "a TeX escape MathJax shows as typed", "an error output", "a traceback in an output",
                  "an image that does not load: missing.png", "without a 'Exercises' section"):
        assert fault in problems, fault
    assert "03_good.html" not in problems
    assert check_html.main([str(book)]) == 1


def test_no_pages_is_a_failure(tmp_path):
    assert check_html.check_book(tmp_path)
