"""A Sphinx extension for the book: every chapter page offers its notebook (.ipynb) for download.

The chapters are jupytext percent files; when the HTML is built, each is converted to a notebook
in _notebooks/ beside the pages, and each chapter page gets a link to its own under its title."""

from pathlib import Path

LINK = ('<p class="notebook-download"><a href="../_notebooks/{name}.ipynb" download>'
        "Download this chapter as a notebook (.ipynb)</a> to run it cell by cell in JupyterLab "
        "or Colab (the preface says how).</p>")


def add_link(app, pagename, templatename, context, doctree):
    if pagename.startswith("chapters/") and "body" in context:
        name = pagename.rsplit("/", 1)[-1]
        context["body"] = context["body"].replace("</h1>", "</h1>" + LINK.format(name=name), 1)


def write_notebooks(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    import jupytext

    out = Path(app.outdir) / "_notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for source in sorted((Path(app.srcdir) / "chapters").glob("*.py")):
        jupytext.write(jupytext.read(source, fmt="py:percent"), out / f"{source.stem}.ipynb", fmt="ipynb")


def setup(app):
    app.connect("html-page-context", add_link)
    app.connect("build-finished", write_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
