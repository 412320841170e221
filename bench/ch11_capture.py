"""Chapter 11: what capturing the CUDA graphs costs at start-up, the decode graphs alone and with the prefill
graphs: wall time and device memory, on the Llama 3.2 1B stand-in (max_num_seqs 256, max_num_batched_tokens
8,192, max_model_len 2,048), every kernel compiled first (one capture not timed), median of three.

    python3 bench/ch11_capture.py [--wheel TOKENIZER_WHEEL]
"""

import argparse
import gc
import os
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.cuda_graphs import CudaGraphs
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin


def capture(runner, prefill: bool) -> tuple[float, float, int]:
    """(seconds, device MiB held, graphs) of one CudaGraphs over the runner."""
    gc.collect()
    runner.stream.synchronize()
    context = cuda.current_context()
    free = context.get_memory_info().free
    t0 = time.perf_counter()
    graphs = CudaGraphs(runner, progress=False, prefill=prefill)
    runner.stream.synchronize()
    seconds = time.perf_counter() - t0
    held = (free - context.get_memory_info().free) / 2**20
    count = len(graphs.graphs) + len(graphs.argmax_graphs) + len(graphs.prefill_graphs)
    del graphs
    gc.collect()
    return seconds, held, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    args = ap.parse_args()
    rec = Recorder("ch11_capture")
    llm = LLM(prepare_llama_standin(wheel=args.wheel), device="cuda", max_model_len=2048, max_num_seqs=256,
              enforce_eager=True)
    runner = llm.llm_engine.model_runner
    capture(runner, prefill=True)  # compiles and loads every kernel a graph launches
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights)", "engine_commit": os.environ.get("ENGINE_COMMIT"),
             "max_num_seqs": 256, "max_num_batched_tokens": runner.max_num_batched_tokens, "max_model_len": 2048}
    for prefill in (False, True):
        runs = [capture(runner, prefill) for _ in range(3)]
        seconds, held = (float(np.median([r[i] for r in runs])) for i in (0, 1))
        what = "decode and prefill graphs" if prefill else "decode graphs"
        rec.add("capture", [runs[0][2]], "s", seconds, graphs=runs[0][2], memory_mib=held, what=what,
                runs=[r[0] for r in runs], **extra)
        print(f"{what}: {runs[0][2]} graphs captured in {seconds:.2f} s, {held:.0f} MiB of device memory", flush=True)
    print("saved", rec.save())


if __name__ == "__main__":
    main()
