"""Chapter 12: one client streaming from the server against the same engine offline, at batch 1.

The same prompt (--input-len random token ids), --output-len tokens with end-of-sequence ignored, with each sampling
setting (greedy; temperature 0.6 with top_p 0.9), offline (the engine stepped in a loop, as chapter 11's
`benchmark.latency`, in a process of its own) and through `python -m tinyvllm_lib serve` in another, one streamed
`/v1/completions` request at a time from this process. Both engines have the same settings (device, max_model_len,
max_num_seqs, and the pool serve would size for them, given as num_kv_blocks since both sit on one GPU); offline and
HTTP take turns, one request each, so that other work on the machine slows both alike; each setting's first pair
warms up, then --repeats pairs; medians. Records per setting, to book/data/ch12_lone_client.json: decode tok/s (the
tokens after the first over the time after the first; for the server, from the first chunk to the last) offline and
over HTTP (its `ceiling` the offline value, so `ratio` is the share of the engine a lone client gets), end-to-end
tok/s, the server's gaps between chunks (median, p99, and tokens per chunk), and the CPU time per token of the
server's event-loop thread and of its busiest other thread, the engine's (Linux: /proc/PID/task). Each record names the engine's git
commit (`git rev-parse HEAD` where the engine's folder is a checkout, else --engine-commit) and a --label; a run
replaces the records of its device, commit and label only, so runs before a fix and after it stand side by side.

    python bench/ch12_lone_client.py                # a GPU: the Llama 3.2 1B stand-in (two engines start)
    python bench/ch12_lone_client.py --device cpu   # a tiny random Llama with SmolLM2's tokenizer (~40 s)
    python bench/ch12_lone_client.py --engine-path /tmp/before --engine-commit ce801d4 --label before

On the CPU the model is tiny on purpose (2 layers of hidden 64, SmolLM2's vocabulary and tokenizer, one BLAS thread):
a GPU makes a batch-1 decode step of the 1B model in about a millisecond, so what the server adds per token is what a
lone client feels, and the tiny model's greedy NumPy step takes about as long. (Its sampled step does not: top-p
sorts the 49,152 probabilities on the host, which takes most of the step.) --engine-path runs both engines from
another copy of the library (a folder holding tinyvllm_lib/, e.g. `git archive COMMIT tinyvllm_lib | tar -x -C DIR`).
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from server_process import ServerProcess

import tinyvllm_lib.measure as measure

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"greedy": {"temperature": 0.0}, "t0.6_p0.9": {"temperature": 0.6, "top_p": 0.9, "seed": 0}}

OFFLINE = """
import json, sys, time
from tinyvllm_lib import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["folder"], device=args["device"], max_model_len=args["max_model_len"],
          max_num_seqs=args["max_num_seqs"], num_kv_blocks=args["num_kv_blocks"])
engine = llm.llm_engine
print("READY", flush=True)
for i, line in enumerate(sys.stdin):  # a setting's sampling parameters: one request
    params = SamplingParams(max_tokens=args["output_len"], ignore_eos=True, **json.loads(line))
    start, first = time.perf_counter(), None
    engine.add_request(f"offline-{i}", args["prompt"], params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outputs):
            first = time.perf_counter()
    print(json.dumps([first - start, time.perf_counter() - start]), flush=True)
"""


def tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama of hidden 64 with SmolLM2's vocabulary and tokenizer: tests/serving_tools.py's."""
    spec = importlib.util.spec_from_file_location("serving_tools", ROOT / "tests" / "serving_tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    return tools.tiny_chat_model(folder, max_position_embeddings=4096)


def engine_commit(engine_path: Path, given: str | None) -> str:
    """The engine's git commit: --engine-commit, else the checkout's HEAD (+ '-dirty' if its library has changes)."""
    if given:
        return given
    try:
        git = ["git", "-C", str(engine_path)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "tinyvllm_lib", "bench"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (pass --engine-commit)"


class Offline:
    """The engine alone in a process of its own, which runs one request per line it is sent."""

    def __init__(self, args, env):
        spec = dict(folder=str(args.folder), device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, prompt=args.prompt,
                    output_len=args.output_len)
        self.process = subprocess.Popen([sys.executable, "-c", OFFLINE, json.dumps(spec)], env=env,
                                        cwd=args.engine_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        while (line := self.process.stdout.readline().strip()) != "READY":
            if not line and self.process.poll() is not None:
                raise SystemExit("the offline engine did not start")

    def run(self, setting: dict) -> tuple[float, float]:
        """(seconds to the first token, seconds in all) of one request."""
        self.process.stdin.write(json.dumps(setting) + "\n")
        self.process.stdin.flush()
        return tuple(json.loads(self.process.stdout.readline()))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id (Linux)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def stream_once(client: httpx.Client, url: str, body: dict, pid: int) -> dict:
    """One streamed completion: when it was sent, when each chunk with text came, the tokens it made, and the CPU
    seconds the server's event loop (its main thread) and its busiest other thread (the engine's) spent on it."""
    before = thread_cpu_seconds(pid)
    start, times, num_tokens = time.perf_counter(), [], None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now, chunk = time.perf_counter(), json.loads(line[len("data: "):])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(now)
    end, after = time.perf_counter(), thread_cpu_seconds(pid)
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    loop = spent.pop(pid, 0.0)
    return {"start": start, "end": end, "times": times, "num_tokens": num_tokens, "loop_cpu_s": loop,
            "engine_cpu_s": max(spent.values(), default=0.0)}


def measure_both(args, env) -> tuple[dict, dict]:
    """({setting: [(ttft, total), ...]} offline, {setting: [stream_once(...), ...]} over HTTP): both engines
    resident, one request at a time, offline and HTTP taking turns (a busy machine slows both alike); each
    setting's first pair warms up."""
    serve = [str(args.folder), "--device", args.device, "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks),
             "--served-model-name", "m"]
    ref, http, offline = {}, {}, Offline(args, env)
    try:
        with ServerProcess(*serve, env=env, cwd=args.engine_path) as server, httpx.Client(timeout=600) as client:
            for name, setting in SETTINGS.items():
                body = {"model": "m", "prompt": args.prompt, "max_tokens": args.output_len, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}, **setting}
                ref[name], http[name] = [], []
                for _ in range(args.repeats + 1):
                    ref[name].append(offline.run(setting))
                    http[name].append(stream_once(client, server.url, body, server.process.pid))
                ref[name], http[name] = ref[name][1:], http[name][1:]
    finally:
        offline.close()
    return ref, http


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--model", help="a folder or known name (default: the 1B stand-in; on the CPU a tiny model)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096, help="serve's default for the 1B model")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="serve's default")
    ap.add_argument("--engine-path", type=Path, default=ROOT, help="the folder whose tinyvllm_lib both engines run")
    ap.add_argument("--engine-commit", help="the engine's commit, where its folder is no git checkout")
    ap.add_argument("--label", default="after", help="what this engine is: before (the fix), after, ...")
    ap.add_argument("--no-save", action="store_true", help="print, do not record")
    args = ap.parse_args()
    from tinyvllm_lib.models.config import ModelConfig
    from tinyvllm_lib.models.llama_standin import prepare_llama_standin
    from tinyvllm_lib.models.smollm2 import resolve_model
    from tinyvllm_lib.runtime import has_gpu

    if args.device == "auto":
        args.device = "cuda" if has_gpu() else "cpu"
    scratch = tempfile.TemporaryDirectory()
    if args.model is None and args.device == "cpu":
        args.folder = tiny_model(Path(scratch.name))
        args.model = "tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer"
    elif args.model is None:
        args.folder, args.model = prepare_llama_standin(), "Llama 3.2 1B stand-in"
    else:
        args.folder = resolve_model(args.model)
    vocab_size = ModelConfig.from_folder(args.folder).vocab_size
    args.prompt = np.random.default_rng(0).integers(0, vocab_size, args.input_len).tolist()
    engine_path = args.engine_path = args.engine_path.resolve()
    # the pool serve sizes for these settings where memory allows (as many blocks as max_num_seqs sequences of
    # max_model_len need), given to both engines: two of them share the GPU
    args.num_kv_blocks = args.max_num_seqs * -(-args.max_model_len // 16)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(engine_path), os.environ.get("PYTHONPATH", "")]))
    if args.device == "cpu":  # one BLAS thread: more only spin on so small a model
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    commit = engine_commit(engine_path, args.engine_commit)
    if args.device == "cpu":  # a CPU record names the CPU (bench/ch08_decode_cpu.py)
        spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
        ch08 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ch08)
        measure.device_info = ch08.cpu_device_info
    rec = measure.Recorder("ch12_lone_client")
    load = os.getloadavg()[0]
    print(f"engine {commit} ({args.label}) from {engine_path}; {args.model} on {rec.device['name']}", flush=True)
    t0 = time.perf_counter()
    ref, http = measure_both(args, env)
    shape = [1, args.input_len, args.output_len]
    extra = dict(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                 num_kv_blocks=args.num_kv_blocks,
                 repeats=args.repeats, engine_commit=commit, label=args.label, load_average=load,
                 blas_threads=env.get("OPENBLAS_NUM_THREADS", "default"))
    for name, setting in SETTINGS.items():
        n = args.output_len
        ttft, total = np.median(np.array(ref[name]), axis=0)
        off_decode, off_e2e = (n - 1) / (total - ttft), n / total
        runs = http[name]
        if any(r["num_tokens"] != n for r in runs):
            raise SystemExit(f"{name}: the server made {[r['num_tokens'] for r in runs]} tokens, not {n}")
        decode = statistics.median((n - 1) / (r["times"][-1] - r["times"][0]) for r in runs)
        e2e = statistics.median(n / (r["end"] - r["start"]) for r in runs)
        http_ttft = statistics.median(r["times"][0] - r["start"] for r in runs)
        gaps = np.concatenate([np.diff(r["times"]) for r in runs]) * 1e3
        per_chunk = statistics.median(n / len(r["times"]) for r in runs)
        loop_ms = 1e3 * statistics.median(r["loop_cpu_s"] for r in runs) / n
        engine_ms = 1e3 * statistics.median(r["engine_cpu_s"] for r in runs) / n
        both = dict(setting=name, sampling=setting, **extra)
        rec.add("offline_decode", shape, "tok/s", off_decode, e2e_tok_s=off_e2e, ttft_ms=1e3 * ttft, **both)
        rec.add("http_decode", shape, "tok/s", decode, off_decode, e2e_tok_s=e2e, e2e_ratio=e2e / off_e2e,
                ttft_ms=1e3 * http_ttft, **both)
        rec.add("http_gap", shape, "ms", float(np.median(gaps)), p90=float(np.percentile(gaps, 90)),
                p99=float(np.percentile(gaps, 99)), max=float(gaps.max()), tokens_per_chunk=per_chunk, **both)
        rec.add("server_cpu_per_token", shape, "ms", loop_ms + engine_ms, loop_thread_ms=loop_ms,
                engine_thread_ms=engine_ms, note="CPU time per token: the server's event-loop thread, and its "
                "busiest other thread (the engine's); 10 ms ticks of /proc over the request", **both)
        print(f"{name:>10}: offline {off_decode:7.0f} tok/s decode ({off_e2e:.0f} e2e, TTFT {1e3 * ttft:.1f} ms); "
              f"HTTP {decode:7.0f} tok/s = {decode / off_decode:.0%} ({e2e:.0f} e2e = {e2e / off_e2e:.0%}, TTFT "
              f"{1e3 * http_ttft:.1f} ms); gaps median {np.median(gaps):.2f} ms, p99 {np.percentile(gaps, 99):.2f} "
              f"ms, {per_chunk:.2f} tokens a chunk; server CPU per token: loop {loop_ms:.3f} ms, engine thread "
              f"{engine_ms:.3f} ms", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s; load average {load:.1f} before")
    scratch.cleanup()
    if not args.no_save:  # replace this device's records of this commit and label only
        path = measure.DATA_DIR / "ch12_lone_client.json"
        old = json.loads(path.read_text()) if path.exists() else []
        same = (rec.device["name"], commit, args.label)
        kept = [r for r in old if (r["device"]["name"], r.get("engine_commit"), r.get("label")) != same]
        path.write_text(json.dumps(kept + rec.records, indent=1) + "\n")
        print(f"saved {path}")


if __name__ == "__main__":
    main()
