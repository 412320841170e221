"""Execute every chapter once, as a notebook, on all cores; the book is built from what this writes.

    python book/execute_chapters.py [--jobs N] [--keep-going] [--out DIR] [CHAPTER.py ...]

Each chapter (chapters/NN_name.py, jupytext percent) is read as a notebook and run top to bottom by
its own Jupyter kernel (nbclient), with the chapters' folder as its working directory, as JupyterLab
and the book's build run it. Up to N chapters run at once (default: one a core). The first cell that
raises fails the step: it is printed (chapter, cell, traceback), the chapters still running are
stopped, and the exit status is 1 (--keep-going runs the rest and lists every failure).

Each executed notebook is written to book/_build/nb/NAME.ipynb with the SHA-256 of its source in
its metadata; the book's reader (book/executed_reader.py) renders those outputs instead of executing
again, and refuses a chapter whose source changed since it ran. Progress-bar widgets are dropped from
the outputs (the book drops stderr, where the same bars go outside a notebook). Each chapter's time
is printed, slowest first, and kept in book/_build/nb/times.json, which also orders the next run
(slowest first, so the last chapter to finish is a short one); a clean clone starts from the times
of a CI run kept in book/chapter_times.json (refresh it from times.json when chapters change).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
OUT = ROOT / "book" / "_build" / "nb"
TIMES = OUT / "times.json"
COMMITTED_TIMES = ROOT / "book" / "chapter_times.json"  # a clean clone's first order
WIDGET = "application/vnd.jupyter.widget-view+json"
CELL_TIMEOUT_S = 3600
TRACEBACK_LINES = 25  # of a failing cell's traceback, printed
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def source_hash(text: str) -> str:
    """The key that ties an executed notebook to the chapter text it ran (line ends normalised)."""
    lines = text.replace("\r\n", "\n").rstrip("\n").split("\n")
    return hashlib.sha256("\n".join(line.rstrip() for line in lines).encode()).hexdigest()


def drop_widgets(nb) -> None:
    """Remove progress-bar widget outputs: a live kernel draws them, a page cannot."""
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            cell["outputs"] = [o for o in cell.get("outputs", []) if WIDGET not in o.get("data", {})]
    nb.metadata.pop("widgets", None)


def describe_failure(nb) -> str | None:
    """'cell N: the traceback's last lines' for the cell that raised (ANSI colours off)."""
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if output.get("output_type") == "error":
                lines = ANSI.sub("", "\n".join(output.get("traceback", []))).splitlines()
                first = cell.source.strip().splitlines()[:1] or [""]
                return (f"cell {index} ({first[0][:70]!r} ...):\n  " + "\n  ".join(lines[-TRACEBACK_LINES:]))
    return None


def run_one(job: tuple[str, str]) -> dict:
    """Execute one chapter (path, output folder); return its name, seconds, and the failing
    cell if any."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path, out = Path(job[0]), Path(job[1])
    text = path.read_text(encoding="utf-8")
    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    # the kernel's own log at ERROR: ipykernel warns of its unencrypted local TCP on every start
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    result = {"chapter": path.stem, "error": None}
    try:
        client.execute()
    except CellExecutionError as e:
        result["error"] = f"{path.name}, {describe_failure(nb) or e}"
    except Exception:  # the kernel died, a timeout, ...
        result["error"] = f"{path.name}:\n{traceback.format_exc()}"
    result["seconds"] = time.perf_counter() - t0
    drop_widgets(nb)
    nb.metadata["tinyvllm"] = {"source_sha256": source_hash(text), "seconds": round(result["seconds"], 1),
                               "ok": result["error"] is None}
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(out / f"{path.stem}.ipynb"))
    return result


def slowest_first(paths: list[Path], times: Path) -> list[Path]:
    """Last run's times decide the order, longest first; on a clean clone, the times
    of a CI run kept in book/chapter_times.json (else the file's size)."""
    known = json.loads((times if times.exists() else COMMITTED_TIMES).read_text())
    return sorted(paths, key=lambda p: known.get(p.stem, p.stat().st_size / 1e3), reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chapters", nargs="*", type=Path, help="default: every chapters/*.py")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="chapters at once (default: cores)")
    ap.add_argument("--keep-going", action="store_true", help="run every chapter, then list the failures")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where executed notebooks go (default: {OUT})")
    args = ap.parse_args(argv)
    out, times_file = args.out.resolve(), args.out.resolve() / TIMES.name
    paths = slowest_first([p.resolve() for p in args.chapters] or sorted(CHAPTERS.glob("*.py")), times_file)
    out.mkdir(parents=True, exist_ok=True)
    for p in paths:  # a chapter that fails or does not run this time leaves no stale output behind
        (out / f"{p.stem}.ipynb").unlink(missing_ok=True)
    jobs = max(1, min(args.jobs, len(paths)))
    print(f"executing {len(paths)} chapters, {jobs} at a time: {', '.join(p.stem for p in paths)}", flush=True)
    t0 = time.perf_counter()
    results, failures = [], []
    # spawn: each worker starts clean (no forked threads or numba state from this process)
    with mp.get_context("spawn").Pool(jobs) as pool:
        for r in pool.imap_unordered(run_one, [(str(p), str(out)) for p in paths]):
            results.append(r)
            mark = "ok" if r["error"] is None else "FAILED"
            print(f"  {r['chapter']:<20} {r['seconds']:7.1f} s  {mark}  ({time.perf_counter() - t0:.0f} s in)",
                  flush=True)
            if r["error"] is not None:
                failures.append(r)
                print(r["error"], flush=True)
                if not args.keep_going:
                    pool.terminate()
                    break
    wall = time.perf_counter() - t0
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    times.update({r["chapter"]: round(r["seconds"], 1) for r in results})
    times_file.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    print(f"chapter times, slowest first ({wall:.0f} s wall, {sum(r['seconds'] for r in results):.0f} s of "
          f"chapters on {jobs} workers):")
    for r in sorted(results, key=lambda r: -r["seconds"]):
        print(f"  {r['seconds']:7.1f} s  {r['chapter']}")
    not_run = len(paths) - len(results)
    print(f"chapters: {len(results) - len(failures)} passed, {len(failures)} failed"
          + (f" ({not_run} not run after the first failure)" if not_run else ""))
    if failures:
        print("failed: " + ", ".join(r["chapter"] for r in failures), file=sys.stderr)
    return 1 if failures or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
