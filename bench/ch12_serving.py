"""Chapter 12: the serving benchmark in the manner of vLLM's benchmark_serving, the server in a process of its own.

Starts `python -m tinyvllm_lib serve MODEL` on 127.0.0.1 and a free port, waits for /health, then sends the random
workload (prompts of --input-len random token ids, --output-len greedy tokens each with eos ignored) at each request
rate of --rates with Poisson arrivals, streaming every answer, and records per rate the median, mean, p90 and p99 of
TTFT, ITL, TPOT and end-to-end latency, and the output throughput, to book/data/ch12_serving.json (under the GPU's
name, or the CPU's). The defaults depend on the device:

    python bench/ch12_serving.py                 # a GPU: the Llama 3.2 1B stand-in, 256 prompts, rates 1 .. 32, inf
    python bench/ch12_serving.py --device cpu    # SmolLM2 on the NumPy backend: 32 prompts, rates 1 2 4 8 inf
"""

import argparse
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import tinyvllm_lib.measure as measure
from tinyvllm_lib.benchmark_serving import benchmark_serving, random_prompts
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.runtime import has_gpu

DEFAULTS = {  # device -> the workload and the engine's size
    "cuda": dict(model="llama-3.2-1b-standin", num_prompts=256, input_len=512, output_len=128,
                 rates=["1", "2", "4", "8", "16", "32", "inf"], max_model_len=2048, max_num_seqs=256),
    "cpu": dict(model="smollm2", num_prompts=32, input_len=64, output_len=32, rates=["1", "2", "4", "8", "inf"],
                max_model_len=512, max_num_seqs=32),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tinyvllm_lib", "serve", args.model, "--device", args.device, "--port", str(port),
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
               "--log-level", "warning"]
    print("server:", " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command)
    deadline = time.monotonic() + args.startup_timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--model")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--rates", nargs="+", help="requests per second (inf: all at once)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int)
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
    vocab_size = ModelConfig.from_folder(resolve_model(args.model)).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)

    if args.device == "cpu":  # a CPU record names the CPU (bench/ch08_decode_cpu.py)
        spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
        ch08 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ch08)
        measure.device_info = ch08.cpu_device_info
    rec = measure.Recorder("ch12_serving")
    load = os.getloadavg()[0]
    port = free_port()
    server = start_server(args, port)
    try:
        summaries = benchmark_serving(f"http://127.0.0.1:{port}", args.model, prompts, args.output_len, rates,
                                      seed=args.seed)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    shape = [args.num_prompts, args.input_len, args.output_len]
    print(f"{args.model} on {rec.device['name']}: {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out; load average {load:.1f} before")
    print(f"{'rate':>5} {'ok':>4} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'E2E p50':>9} "
          f"{'p99':>8} {'out tok/s':>9}")
    for s in summaries:
        rate = "inf" if math.isinf(s["request_rate"]) else s["request_rate"]
        print(f"{rate!s:>5} {s['completed']:>4} {s['median_ttft_ms']:>7.0f}ms {s['p99_ttft_ms']:>6.0f}ms "
              f"{s['median_itl_ms']:>6.0f}ms {s['p99_itl_ms']:>6.0f}ms {s['median_tpot_ms']:>7.0f}ms "
              f"{s['median_e2el_ms']:>7.0f}ms {s['p99_e2el_ms']:>6.0f}ms {s['output_throughput']:>9.1f}")
        if s["failed"]:
            print(f"      {s['failed']} failed: {s['errors']}")
        extra = dict(request_rate=rate, model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                     max_tokens=args.output_len, max_num_seqs=args.max_num_seqs, completed=s["completed"],
                     failed=s["failed"], duration_s=s["duration_s"], load_average=load,
                     server="python -m tinyvllm_lib serve, a process of its own")
        for name in ("ttft", "itl", "tpot", "e2el"):
            rec.add(name, shape, "ms", s[f"median_{name}_ms"], mean=s[f"mean_{name}_ms"], p90=s[f"p90_{name}_ms"],
                    p99=s[f"p99_{name}_ms"], **extra)
        rec.add("output_throughput", shape, "tok/s", s["output_throughput"],
                request_throughput=s["request_throughput"], **extra)
    if not args.no_save:
        print(f"saved {rec.save()}")


if __name__ == "__main__":
    main()
