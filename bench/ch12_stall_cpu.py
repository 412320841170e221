"""Chapter 12 on the CPU: does one client's 5 MB prompt stall the others? The server (`serve smollm2 --device cpu`,
default limits, max_model_len 4096) streams one long answer; then a 5 MB prompt is sent from a process of its own
(completions, then chat), which the server must refuse (far more than 4096 tokens). Meanwhile /health is asked every
20 ms, from when the big request goes out until its refusal is back and at least 0.35 s (the issue's probe came 0.3 s
after it), and the stream's gaps between chunks are kept. A control follows each refusal: the same stream and probes
as long, with no big request, for what this machine does anyway. Targets: /health under 100 ms, the largest gap under
twice the median. It runs twice, the server's NumPy with OpenBLAS's own number of threads and with one
(`OPENBLAS_NUM_THREADS=1`): on two cores, a decode step split over two BLAS threads is what any third busy thread
(the server reading a body, the client sending it) disturbs. Prints and records (book/data/ch12_stall.json, under the
CPU's name) /health's slowest answer and the stream's largest gap against its median, per refusal and control.
Bounded: loopback only, a fixed number of requests, each with a timeout.

    python bench/ch12_stall_cpu.py [--prompt-bytes 5000000] [--repeats 3] [--blas-threads default 1] [--no-save]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from server_process import ServerProcess

import tinyvllm_lib.measure as measure

STREAM = {"model": "smollm2", "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
          "temperature": 0, "stream": True}


def read_stream(url: str, times: list, stop: threading.Event) -> None:
    """Stream one long answer, keeping when each chunk came, until `stop` (closing it aborts the request)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
            if stop.is_set():
                return


def health_ms(url: str) -> float:
    t0 = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    return (time.perf_counter() - t0) * 1e3


SENDER = """
import sys, time, httpx
url, path = sys.argv[1], sys.argv[2]
body = open(path, "rb").read()
print("ready", flush=True)
sys.stdin.readline()  # go
print(time.perf_counter(), flush=True)
r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=300)
print(time.perf_counter(), r.status_code, r.json()["error"]["message"][:80], flush=True)
"""


def one_refusal(url: str, path: str | None, body_file: Path, seconds: float = 1.0) -> dict:
    """The big request (from a process of its own: the client's GIL is not the server's) while a stream runs:
    /health latencies and the stream's gaps meanwhile. path None: the same without the big request, `seconds`
    long (the control)."""
    times, stop = [], threading.Event()
    reader = threading.Thread(target=read_stream, args=(url, times, stop))
    reader.start()
    deadline = time.monotonic() + 300
    while len(times) < 30 and time.monotonic() < deadline:  # the stream is well under way
        time.sleep(0.01)
    if path is not None:  # started (Python, httpx, the body read) before the stream's gaps count
        command = [sys.executable, "-c", SENDER, f"{url}{path}", str(body_file)]
        sender = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sender.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        start = float(sender.stdout.readline())  # it is about to send
    else:
        sender, start = None, time.perf_counter()
    latencies, end = [], start + max(seconds, 0.35)  # until 0.3 s after at least (the probe)
    while (sender is not None and sender.poll() is None) or time.perf_counter() < end:
        latencies.append(health_ms(url))
        time.sleep(0.02)
    status, error, finish = None, "", time.perf_counter()
    if sender is not None:
        finish, status, error = sender.communicate(timeout=300)[0].split(" ", 2)
        finish, status = float(finish), int(status)
    time.sleep(0.5)  # a few more chunks after the refusal
    stop.set()
    reader.join(timeout=120)
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    # the gaps that overlap the refusal (from sending the body to reading the answer)
    during = [(b - a) * 1e3 for a, b in zip(times, times[1:]) if b >= start and a <= finish]
    return {"status": status, "error": error.strip(), "refusal_s": finish - start, "health_ms": latencies,
            "max_gap_ms": max(during, default=0.0), "median_gap_ms": statistics.median(gaps),
            "num_chunks": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-bytes", type=int, default=5_000_000)
    ap.add_argument("--repeats", type=int, default=3, help="refusals per endpoint (each with its control)")
    ap.add_argument("--blas-threads", nargs="+", default=["default", "1"],
                    help="OpenBLAS threads of the server, a run each (default: OpenBLAS's choice)")
    ap.add_argument("--no-save", action="store_true", help="print, do not record")
    args = ap.parse_args()
    text = "hello world " * (args.prompt_bytes // 12)
    bodies = {
        "completions": {"model": "smollm2", "prompt": text, "max_tokens": 4},
        "chat/completions": {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
    }
    spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
    ch08 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ch08)
    measure.device_info = ch08.cpu_device_info  # a CPU record names the CPU
    rec = measure.Recorder("ch12_stall")
    for threads in args.blas_threads:
        env = dict(os.environ)
        if threads != "default":
            env["OPENBLAS_NUM_THREADS"] = threads
        load = os.getloadavg()[0]
        runs = []  # (endpoint, the refusal, its control)
        with tempfile.TemporaryDirectory() as tmp, ServerProcess("smollm2", "--device", "cpu", env=env) as server:
            idle = [health_ms(server.url) for _ in range(20)]
            for endpoint, body in bodies.items():
                body_file = Path(tmp) / "body.json"
                body_file.write_bytes(json.dumps(body).encode())
                for _ in range(args.repeats):
                    refusal = one_refusal(server.url, f"/v1/{endpoint}", body_file)
                    # the control: the same stream and probes as long, and no big request
                    runs.append((endpoint, refusal, one_refusal(server.url, None, body_file, refusal["refusal_s"])))
        report(rec, runs, idle, threads, load, len(text))
    if not args.no_save:
        print(f"saved {rec.save()}")


def report(rec, runs: list, idle: list, threads: str, load: float, num_bytes: int) -> None:
    """Print one server's runs and add them to the records."""
    print(f"\n{rec.device['name']}, OpenBLAS threads: {threads}; load average {load:.1f} before; a prompt of "
          f"{num_bytes:,} bytes; /health idle: median {statistics.median(idle):.0f} ms, max {max(idle):.0f} ms")
    print("endpoint             answer    /health slowest   stream's largest gap / median   (control: /health, gap)")
    common = dict(prompt_bytes=num_bytes, load_average=load, model="smollm2", max_model_len=4096,
                  blas_threads=threads)
    rec.add("health_idle", [len(idle)], "ms", statistics.median(idle), max_ms=max(idle), **common)
    for endpoint, refusal, control in runs:
        line = []
        for kind, r in (("refusal", refusal), ("control", control)):
            worst, ratio = max(r["health_ms"]), r["max_gap_ms"] / r["median_gap_ms"]
            line.append((worst, r["max_gap_ms"], r["median_gap_ms"], ratio))
            extra = dict(endpoint=endpoint, kind=kind, status=r["status"], seconds=r["refusal_s"], **common)
            rec.add("health_slowest", [len(r["health_ms"])], "ms", worst, **extra)
            rec.add("stream_gap_ratio", [r["num_chunks"]], "x median", ratio, max_gap_ms=r["max_gap_ms"],
                    median_gap_ms=r["median_gap_ms"], **extra)
        (worst, gap, median, ratio), (c_worst, _, _, c_ratio) = line
        print(f"{endpoint:<18} {refusal['status']} in {refusal['refusal_s']:.2f} s  {worst:>6.0f} ms        "
              f"{gap:>5.0f} / {median:>4.0f} ms = {ratio:4.2f}x          ({c_worst:.0f} ms, {c_ratio:.2f}x)")
    worst = [max(r["health_ms"]) for _, r, _ in runs]
    ratios = [r["max_gap_ms"] / r["median_gap_ms"] for _, r, _ in runs]
    print(f"over {len(runs)} refusals: /health's slowest {max(worst):.0f} ms (median {statistics.median(worst):.0f}; "
          f"target < 100); the stream's largest gap {max(ratios):.2f}x its median (median {statistics.median(ratios):.2f}x; "
          f"target < 2x)")
    assert all(r["status"] == 400 for _, r, _ in runs)


if __name__ == "__main__":
    main()
