#!/usr/bin/env bash
# Everything the project does, with its own set-up: ./dev.sh COMMAND
#   run      the main job: the embedded model (SmolLM2) answers "What is the capital of France?",
#            streamed (on the GPU when there is one, else the CPU); the book is ./dev.sh book
#   test     everything CI runs: export check, lint, pytest (CUDA simulator), PTX type check,
#            every chapter through nbval, the book with warnings as errors, and the built
#            pages read back (HTML check; MathJax and code widths in headless Chromium)
#   book     build the book into book/_build/html
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

chapters_to_notebooks() {
    rm -rf book/_build/nb && mkdir -p book/_build/nb
    "$VENV/bin/jupytext" --quiet --to ipynb --output-dir book/_build/nb chapters/*.py 2>/dev/null \
        || for f in chapters/*.py; do "$VENV/bin/jupytext" --quiet --to ipynb -o "book/_build/nb/$(basename "${f%.py}").ipynb" "$f"; done
}

book() {
    unset MPLBACKEND  # the notebook kernel must keep its inline backend, or figures vanish from the pages
    rm -rf book/_build/html book/_build/jupyter_execute book/_build/.doctrees book/_static/mathjax
    mkdir -p book/_static
    cp -r "$("$PY" -c 'import mathjax, os; print(os.path.join(mathjax.__path__[0], "static", "mathjax", "es5"))')" book/_static/mathjax
    "$VENV/bin/jupyter-book" build . --path-output book --warningiserror --keep-going --quiet
    echo "book: $(pwd)/book/_build/html/index.html"
}

notebooks_and_book() {  # nbval and the book build each execute every chapter: side by side, one core each
    local nbval_log=book/_build/nbval.log status=0 t0=$SECONDS
    "$VENV/bin/pytest" -q -p no:cacheprovider --nbval-lax --nbval-current-env book/_build/nb > "$nbval_log" 2>&1 &
    local nbval_pid=$!
    # both are background jobs: set -e holds inside each (it would not in `book || ...`)
    book &
    local book_pid=$!
    trap 'kill "$nbval_pid" "$book_pid" 2>/dev/null' INT TERM
    wait "$book_pid" || status=$?
    echo "== the book: $((SECONDS - t0)) s (exit status $status)"
    local nbval_status=0
    wait "$nbval_pid" || nbval_status=$?
    trap - INT TERM
    echo "== chapters through nbval: $((SECONDS - t0)) s for both (exit status $nbval_status)"
    cat "$nbval_log"
    [ "$status" -eq 0 ] && [ "$nbval_status" -eq 0 ]
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
        if [ -z "${NUMBA_ENABLE_CUDASIM:-}" ] && ! "$PY" -c "from numba import cuda; raise SystemExit(not cuda.is_available())" 2>/dev/null; then
            export NUMBA_ENABLE_CUDASIM=1  # no GPU: the chapters' kernels run in numba's CUDA simulator
            echo "== no CUDA GPU here: kernels run in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
        fi
        as_root=()
        [ "$(id -u)" = 0 ] && as_root=(--allow-root)  # GPU containers run as root
        exec "$VENV/bin/jupyter" lab --ServerApp.root_dir="$(pwd)" ${as_root[@]+"${as_root[@]}"} "$@" ;;
    run)
        setup
        "$PY" -m tinyvllm_lib generate "What is the capital of France?" --chat ;;
    test)
        setup
        export NUMBA_ENABLE_CUDASIM=1 PYTHONUNBUFFERED=1
        total=$SECONDS
        step "library in sync with chapters" "$PY" book/export.py --check
        step "lint" lint
        # two workers, one a core; a test file's tests stay on one worker (its module fixtures are made once)
        step "pytest (CUDA simulator; PTX for sm_90 without it)" \
            "$VENV/bin/pytest" -q -p no:cacheprovider --durations=12 -n 2 --dist loadfile tests
        step "chapters to notebooks" chapters_to_notebooks
        step "chapters through nbval, and the book (warnings are errors), side by side" notebooks_and_book
        step "the built book read back (HTML check; pages in a browser)" read_book
        echo "== all checks passed in $((SECONDS - total)) s" ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
