"""The library's layers, read from its source (no import, no GPU): the schedulers, and every library module
they import in turn, import no numba (nor CUDA's Python bindings) at module level. A scheduler decides which
requests run and hands out blocks; the step's types it shares with the runner live in a module neither owns
(engine.step_outputs), so nothing of the GPU comes with it.

Package __init__ files are left out: importing any submodule runs tinyvllm_lib/__init__.py, which exposes
the whole public API; this test is about what the scheduler's own code depends on."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "tinyvllm_lib"
SCHEDULERS = ["engine.scheduler", "engine.paged_scheduler", "engine.async_scheduler", "engine.block_manager"]
GPU_MODULES = ("numba", "numba_cuda", "cuda", "nvmath", "cupy")


def module_file(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def top_level_imports(name: str) -> set[str]:
    """The modules a module imports in its top-level statements (`from a.b import c` gives a.b, or a.b.c
    where c is itself a module)."""
    found = set()
    for node in ast.parse(module_file(name).read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}")}
    return found


def closure(start: str) -> dict[str, str]:
    """Every library module reachable from `start` by top-level imports -> the module that first imports it."""
    seen, todo = {start: ""}, [start]
    while todo:
        name = todo.pop()
        for imported in top_level_imports(name):
            if imported.startswith(PACKAGE + ".") and module_file(imported) and imported not in seen:
                seen[imported] = name
                todo.append(imported)
    return seen


def chain(seen: dict[str, str], name: str) -> str:
    path = [name]
    while seen[path[-1]]:
        path.append(seen[path[-1]])
    return " <- ".join(path)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_scheduler_imports_nothing_of_the_gpu(scheduler):
    seen = closure(f"{PACKAGE}.{scheduler}")
    bad = [f"{chain(seen, m)} imports {i}" for m in seen for i in top_level_imports(m)
           if i.split(".")[0] in GPU_MODULES]
    assert not bad, "\n".join(bad)
    assert f"{PACKAGE}.engine.model_runner" not in seen  # the runner is the other side of the step


def test_the_walk_finds_a_gpu_import_where_there_is_one():
    """The check can fail: the runner imports numba, through the path the walk reports."""
    seen = closure(f"{PACKAGE}.engine.model_runner")
    assert any(i.split(".")[0] == "numba" for m in seen for i in top_level_imports(m))
    assert f"{PACKAGE}.engine.step_outputs" in seen


def test_no_library_file_is_over_500_lines():
    """Files of one concept: none of the generated library's modules passes 500 lines."""
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / PACKAGE).rglob("*.py")}
    assert sizes and not {p: n for p, n in sizes.items() if n > 500}, sorted(sizes.items(), key=lambda x: -x[1])[:5]
