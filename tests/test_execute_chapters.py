"""The step CI runs each chapter through (book/execute_chapters.py) and the book's reader of its output
(book/executed_reader.py): a chapter whose cell raises fails the step, named with its cell; a good chapter's
executed notebook carries its outputs and its source's hash; the reader refuses a chapter edited since it
ran. (CI runs the step itself on every chapter, then builds the book from what it wrote.)"""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the book's tools (not on a bare GPU machine)

ROOT = Path(__file__).resolve().parent.parent


# book/ on the path, as Sphinx puts it: executed_reader imports execute_chapters, and the step's worker
# processes import it by name
sys.path.insert(0, str(ROOT / "book"))


import execute_chapters  # noqa: E402
import executed_reader as reader  # noqa: E402

GOOD = '''# %% [markdown]
# # 99. A good chapter

# %%
x = 6 * 7
print(f"x = {x}")
'''

BAD = '''# %% [markdown]
# # 98. A chapter that breaks

# %%
y = 1

# %%
raise ValueError("planted failure")

# %%
print("never reached")
'''


def test_a_failing_cell_fails_the_step_and_is_named(tmp_path, capsys):
    (tmp_path / "98_bad.py").write_text(BAD)
    (tmp_path / "99_good.py").write_text(GOOD)
    status = execute_chapters.main(["--jobs", "2", "--keep-going", "--out", str(tmp_path / "nb"),
                                    str(tmp_path / "98_bad.py"), str(tmp_path / "99_good.py")])
    out = capsys.readouterr().out
    assert status == 1
    assert "98_bad.py, cell 2" in out and "planted failure" in out, out
    assert "chapters: 1 passed, 1 failed" in out
    bad = nbformat.read(str(tmp_path / "nb" / "98_bad.ipynb"), as_version=4)
    assert bad.metadata["tinyvllm"]["ok"] is False
    assert bad.cells[3].outputs == [] and "execution_count" not in bad.cells[3].metadata  # stopped at cell 2
    good = nbformat.read(str(tmp_path / "nb" / "99_good.ipynb"), as_version=4)
    assert good.metadata["tinyvllm"] == {"source_sha256": execute_chapters.source_hash(GOOD),
                                         "seconds": good.metadata["tinyvllm"]["seconds"], "ok": True}
    assert good.cells[1].outputs[0]["text"] == "x = 42\n"
    times = json.loads((tmp_path / "nb" / "times.json").read_text())
    assert set(times) == {"98_bad", "99_good"}


def test_without_keep_going_the_first_failure_stops_the_rest(tmp_path, capsys):
    for name in ("97_bad.py", "98_bad.py"):
        (tmp_path / name).write_text(BAD)
    status = execute_chapters.main(["--jobs", "1", "--out", str(tmp_path / "nb"), str(tmp_path / "97_bad.py"),
                                    str(tmp_path / "98_bad.py")])
    out = capsys.readouterr().out
    assert status == 1 and "0 passed, 1 failed (1 not run after the first failure)" in out, out


def test_the_reader_gives_the_executed_notebook_and_refuses_a_stale_chapter(tmp_path, monkeypatch):
    (tmp_path / "99_good.py").write_text(GOOD)
    assert execute_chapters.main(["--out", str(tmp_path / "nb"), str(tmp_path / "99_good.py")]) == 0
    monkeypatch.setattr(reader, "OUT", tmp_path / "nb")
    reader._executed.cache_clear()
    nb = reader.reads(GOOD)
    assert nb.cells[1].outputs[0]["text"] == "x = 42\n"
    assert reader.reads(GOOD.replace("\n", "\r\n") + "\n\n") is not None  # line ends do not matter
    with pytest.raises(ValueError, match="99. A good chapter.*run `python book/execute_chapters.py`"):
        reader.reads(GOOD.replace("6 * 7", "6 * 8"))


def test_widget_outputs_are_dropped(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("bar()")
    cell.outputs = [nbformat.v4.new_output("display_data", data={execute_chapters.WIDGET: {"model_id": "x"},
                                                                   "text/plain": "HBox()"}),
                    nbformat.v4.new_output("stream", name="stdout", text="kept\n")]
    nb.cells.append(cell)
    nb.metadata["widgets"] = {"state": {}}
    execute_chapters.drop_widgets(nb)
    assert [o["output_type"] for o in nb.cells[0].outputs] == ["stream"] and "widgets" not in nb.metadata
