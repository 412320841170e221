#!/usr/bin/env bash
# Everything the project does, with its own set-up: ./dev.sh COMMAND
#   run      the main job: the embedded model (SmolLM2) answers "What is the capital of France?",
#            streamed (on the GPU when there is one, else the CPU); the book is ./dev.sh book
#   test     everything CI runs: export check, lint, pytest (CUDA simulator), PTX type check,
#            every chapter executed once (one a core), the book built from those notebooks
#            with warnings as errors, and the built pages read back (HTML check; MathJax and
#            code widths in headless Chromium)
#   book     execute every chapter (the simulator where there is no GPU), then build the
#            book into book/_build/html
#   lab      open JupyterLab (arguments go to jupyter lab); chapters open as notebooks, the
#            simulator on where there is no GPU
#   export   write tinyvllm_lib/ from the chapters;  check-export: fail if they differ
#   setup    create .venv (if missing) and install the project, editable, with test extras
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=$VENV/bin/python

setup() {
    if [ ! -x "$PY" ]; then
        echo "== creating $VENV"
        python3 -m venv "$VENV"
    fi
    local stamp=$VENV/.tinyvllm-installed want
    want=$(cat pyproject.toml | sha256sum | cut -c1-16)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "== installing the project into $VENV (editable, with test extras)"
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q -e ".[test]"
        echo "$want" > "$stamp"
    fi
}

step() {  # step NAME COMMAND...: run one stage, time it, stop on failure
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name"
    "$@"
    echo "== $name: ok ($((SECONDS - t0)) s)"
}

simulator_where_no_gpu() {  # the one place that decides: numba's CUDA simulator where there is no GPU
    if [ -z "${NUMBA_ENABLE_CUDASIM:-}" ] && ! "$PY" -c "from numba import cuda; raise SystemExit(not cuda.is_available())" 2>/dev/null; then
        export NUMBA_ENABLE_CUDASIM=1
        echo "== no CUDA GPU here: kernels run in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
    fi
}

execute_chapters() {  # every chapter once, as a notebook, one a core; fails on the first cell that raises
    unset MPLBACKEND  # the notebook kernel must keep its inline backend, or figures vanish from the pages
    simulator_where_no_gpu
    "$PY" book/execute_chapters.py "$@"
}

build_book() {  # the pages from the executed notebooks (execution off), warnings are errors
    rm -rf book/_build/html book/_build/jupyter_execute book/_build/.doctrees book/_static/mathjax
    mkdir -p book/_static
    cp -r "$("$PY" -c 'import mathjax, os; print(os.path.join(mathjax.__path__[0], "static", "mathjax", "es5"))')" book/_static/mathjax
    "$VENV/bin/jupyter-book" build . --path-output book --warningiserror --keep-going --quiet
    echo "book: $(pwd)/book/_build/html/index.html"
}

book() {
    execute_chapters
    build_book
}

read_book() {  # what a reader's browser gets: no raw roles, no tracebacks, no missing figures, math typeset
    "$PY" book/check_html.py book/_build/html
    "$VENV/bin/pytest" -q -p no:cacheprovider -rs tests/test_book_pages.py
}

lint() {  # the chapters, tests and scripts; the generated library for line length only (no page scrolls sideways)
    "$VENV/bin/ruff" check chapters tests book bench
    "$VENV/bin/ruff" check --select E501 tinyvllm_lib
}

cmd=${1:-help}
case "$cmd" in
    setup) setup ;;
    export) setup; "$PY" book/export.py ;;
    check-export) setup; "$PY" book/export.py --check ;;
    book) setup; book ;;
    lab)
        setup
        shift  # the rest goes to jupyter lab (--port 8890, --no-browser, ...)
        # open chapters/*.py as notebooks by default (jupytext's viewer)
        mkdir -p "$VENV/share/jupyter/lab/settings"
        echo '{"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"python": "Jupytext Notebook"}}}' \
            > "$VENV/share/jupyter/lab/settings/overrides.json"
        simulator_where_no_gpu  # no GPU: the chapters' kernels run in numba's CUDA simulator
        as_root=()
        [ "$(id -u)" = 0 ] && as_root=(--allow-root)  # GPU containers run as root
        exec "$VENV/bin/jupyter" lab --ServerApp.root_dir="$(pwd)" ${as_root[@]+"${as_root[@]}"} "$@" ;;
    run)
        setup
        "$PY" -m tinyvllm_lib generate "What is the capital of France?" --chat ;;
    test)
        setup
        export PYTHONUNBUFFERED=1
        total=$SECONDS
        step "library in sync with chapters" "$PY" book/export.py --check
        step "lint" lint
        # two workers, one a core; a test file's tests stay on one worker (its module fixtures are made once)
        step "pytest (CUDA simulator; PTX for sm_90 without it)" \
            env NUMBA_ENABLE_CUDASIM=1 "$VENV/bin/pytest" -q -p no:cacheprovider --durations=12 -n 2 --dist loadfile tests
        # as a user's ./dev.sh book: the simulator is chosen where there is no GPU, not set beforehand
        step "every chapter executed once, one a core (the simulator where there is no GPU)" execute_chapters
        step "the book from the executed chapters (warnings are errors)" build_book
        step "the built book read back (HTML check; pages in a browser)" read_book
        echo "== all checks passed in $((SECONDS - total)) s" ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
esac
