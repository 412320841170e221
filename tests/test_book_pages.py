"""The built book read back in a real browser (headless Chromium): MathJax typesets the math of two
pages, a screenshot of each is made, and no code block of any chapter page scrolls sideways in a
1,280-pixel window. Runs after the book is built (./dev.sh test runs it right after the build);
skips when the book is not built or no Chromium is installed."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book" / "_build" / "html"
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None or not (BOOK / "index.html").exists(),
                                reason="needs the built book (./dev.sh book) and Chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files",
         "--virtual-time-budget=20000", "--window-size=1280,2000"]
PAGES = ["04_rmsnorm", "08_kv_cache"]

# A wrapper page: loads a chapter page in a frame, then writes what it measured into its own DOM.
PROBE = """<html><body><div id="result"></div>
<iframe id="page" src="{src}" style="width:1280px;height:2000px;border:0"></iframe>
<script>
document.getElementById("page").addEventListener("load", function () {{
  setTimeout(function () {{
    var doc = document.getElementById("page").contentDocument, wide = [];
    doc.querySelectorAll("div.highlight pre, div.cell_output pre").forEach(function (pre) {{
      if (pre.scrollWidth > pre.clientWidth + 1) wide.push(pre.textContent.split("\\n")[0].slice(0, 60));
    }});
    var math = doc.querySelectorAll("span.math, div.math").length;
    var typeset = doc.querySelectorAll("mjx-container").length;
    document.getElementById("result").textContent = JSON.stringify({{wide: wide, math: math, typeset: typeset,
      pres: doc.querySelectorAll("pre").length}});
  }}, 8000);
}});
</script></body></html>"""


def probe(tmp_path: Path, page: str) -> dict:
    wrapper = tmp_path / f"probe_{page}.html"
    wrapper.write_text(PROBE.format(src=(BOOK / "chapters" / f"{page}.html").as_uri()))
    dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", wrapper.as_uri()], capture_output=True, text=True,
                         timeout=180).stdout
    found = re.search(r'<div id="result">(.*?)</div>', dom, re.S)
    assert found and found.group(1), f"the probe of {page} wrote nothing"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.parametrize("page", PAGES)
def test_mathjax_typesets_the_math(tmp_path, page):
    result = probe(tmp_path, page)
    print(page, result)
    assert result["math"] > 0 and result["typeset"] >= result["math"], result


@pytest.mark.parametrize("page", PAGES)
def test_screenshot(tmp_path, page):
    png = tmp_path / f"{page}.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--screenshot={png}", (BOOK / "chapters" / f"{page}.html").as_uri()],
                   capture_output=True, timeout=180)
    assert png.exists() and png.stat().st_size > 50_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_no_code_block_scrolls_sideways(tmp_path):
    pages = sorted(p.stem for p in (BOOK / "chapters").glob("*.html"))
    assert pages
    wide = {}
    for page in pages:
        result = probe(tmp_path, page)
        assert result["pres"] > 0 or page.startswith("00_"), page
        if result["wide"]:
            wide[page] = result["wide"]
    assert not wide, f"code blocks wider than the page at 1,280 pixels: {wide}"
