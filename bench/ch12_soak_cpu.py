"""Chapter 12's server soaked on the CPU: a mixed load for a bounded time, then nothing may be left behind.

`serve smollm2 --device cpu` in a process of its own (127.0.0.1 only). First a few long prompts write every block of
its KV pool once (np.zeros: memory becomes resident where tokens are written, so an untouched pool would grow the
process for a while), and every good request is sent alone, for its reference answer (greedy, log-probs as token
ids). Then --clients concurrent clients send, until --seconds have
passed or --max-requests were sent: good requests, streamed and not (each must equal its reference, token for token),
streams that the client leaves after a few chunks and whole answers it stops waiting for (aborted), bad requests (each
must get its 4xx and OpenAI's error JSON), and a few large ones (a 5 MB prompt: 400; a 9 MB body: 413). No 5xx, no
request without an answer in its timeout. Afterwards: the /metrics gauges at zero (nothing running or waiting, no KV
block held: every block free or cached), the server's resident memory grown by at most --max-rss-growth-mb since
--warm-seconds, and the good requests, alone again, still equal to their references. Prints the figures, records them
(book/data/ch12_soak.json, under the CPU's name) unless --no-save, exits 1 on any failure. CI runs it for a minute.

    python bench/ch12_soak_cpu.py [--seconds 600] [--clients 6] [--num-kv-blocks 256] [--no-save]
"""

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from server_process import ServerProcess

import tinyvllm_lib.measure as measure

# greedy answers with no near tie in their first 20 tokens (so batching cannot part them from the request alone)
COMPLETIONS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n",
               "The largest planet in the solar system is", "The sun rises in the", "for i in range(10):",
               "The opposite of hot is"]
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Who wrote Hamlet?", "What color is the sky?",
             "What is the largest ocean?", "Name a primary color."]
MAX_MODEL_LEN = 1024
CHAT = {"model": "smollm2", "max_tokens": 4}
COMPLETE = {"model": "smollm2", "prompt": "Hi", "max_tokens": 4}
SURROGATE = b'{"model": "smollm2", "prompt": "x \\ud800 y", "max_tokens": 4}'
BAD = [  # (path, body: dict, or bytes sent as they are, the status it must get)
    ("/v1/completions", b'{"model": "smollm2", "prompt": ', 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/completions", SURROGATE, 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"messages": [{"role": "\ud800", "content": "x"}]}).encode(), 400),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/completions", COMPLETE | {"model": "gpt-4o"}, 404),
    ("/v1/completions", COMPLETE | {"max_tokens": 0}, 400),
    ("/v1/completions", COMPLETE | {"top_p": 2}, 400),
    ("/v1/completions", COMPLETE | {"n": 2}, 400),
    ("/v1/completions", COMPLETE | {"prompt": [42] * (MAX_MODEL_LEN + 1)}, 400),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi " * 2000}]}, 400),
    ("/v1/completions", COMPLETE | {"presence_penalty": 3.0}, 400),  # OpenAI's range is [-2, 2]
    ("/v1/completions", COMPLETE | {"stream": True, "temperature": -1}, 400),
    ("/v1/embeddings", COMPLETE, 404),
]
KINDS = {"good": 0.3, "good_stream": 0.3, "leaves": 0.15, "bad": 0.25}  # and every LARGE_EVERY-th request: large
LARGE_EVERY = 40
TIE = 0.05  # a reference whose two best tokens come closer than this somewhere is not used (batching may part them)


def good_requests() -> list[tuple[str, dict]]:
    """(path, body) of every good request: greedy, short, with log-probs as token ids."""
    out = []
    for i, prompt in enumerate(COMPLETIONS):
        out.append(("/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 8 + 2 * i,
                                        "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True}))
    for i, question in enumerate(QUESTIONS):
        out.append(("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": question}],
                                             "max_tokens": 8 + 2 * i, "temperature": 0, "logprobs": True,
                                             "top_logprobs": 2, "return_tokens_as_token_ids": True}))
    return out


def ids_of(tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def answer_of(path: str, reply: dict) -> dict:
    """The text, token ids and the narrowest top-2 margin of a whole answer."""
    choice = reply["choices"][0]
    if path.endswith("chat/completions"):
        entries = choice["logprobs"]["content"]
        ids = ids_of(e["token"] for e in entries)
        tops = [[t["logprob"] for t in e["top_logprobs"]] for e in entries]
        text = choice["message"]["content"]
    else:
        ids = ids_of(choice["logprobs"]["tokens"])
        tops = [sorted(step.values(), reverse=True) for step in choice["logprobs"]["top_logprobs"]]
        text = choice["text"]
    margin = min((t[0] - t[1] for t in tops if len(t) > 1), default=float("inf"))
    return {"text": text, "ids": ids, "margin": margin}


def streamed_answer(path: str, events: list[str]) -> dict:
    """The text and token ids of a stream's chunks; its usage."""
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    text, ids, usage = "", [], None
    for c in chunks:
        if "error" in c:
            raise AssertionError(f"an error event: {c['error']}")
        usage = c.get("usage") or usage
        if not c["choices"]:
            continue
        choice = c["choices"][0]
        if path.endswith("chat/completions"):
            text += choice["delta"].get("content", "")
            ids += ids_of(e["token"] for e in (choice["logprobs"] or {}).get("content", []))
        else:
            text += choice["text"]
            ids += ids_of((choice["logprobs"] or {}).get("tokens", []))
    return {"text": text, "ids": ids, "usage": usage}


def check_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, f"{r.status_code} (wanted {status}): {r.text[:200]}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


class Soak:
    def __init__(self, url: str, args, goods: list):
        self.url, self.args, self.goods = url, args, goods  # [(path, body, its reference)]
        self.counts, self.failures, self.latencies = Counter(), [], []
        self.num_sent = 0
        self.large_bodies = [("/v1/completions", json.dumps({"model": "smollm2", "prompt": "hello world " * 416_666,
                                                      "max_tokens": 4}).encode(), 400),
                      ("/v1/completions", b'{"prompt": "' + b"x" * 9_000_000 + b'"}', 413)]

    async def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.args.request_timeout) as client:
            while time.monotonic() < deadline and self.num_sent < self.args.max_requests:
                self.num_sent += 1
                kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
                if self.num_sent % LARGE_EVERY == 1:
                    kind = "large"
                t0 = time.perf_counter()
                try:
                    await getattr(self, kind)(client, rng)
                    self.counts[kind] += 1
                except Exception as err:  # a failed check, a 5xx, a timeout: all failures
                    self.counts[f"{kind} failed"] += 1
                    self.failures.append(f"{kind}: {type(err).__name__}: {str(err)[:300]}")
                self.latencies.append(time.perf_counter() - t0)

    async def good(self, client, rng) -> None:
        path, body, want = rng.choice(self.goods)
        r = await client.post(path, json=body)
        assert r.status_code == 200, f"{r.status_code}: {r.text[:200]}"
        got = answer_of(path, r.json())
        assert (got["ids"], got["text"]) == (want["ids"], want["text"]), f"{got} != {want} ({body})"

    async def good_stream(self, client, rng) -> None:
        path, body, want = rng.choice(self.goods)
        body = body | {"stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.status_code
            events = [line async for line in r.aiter_lines() if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        got = streamed_answer(path, events)
        assert (got["ids"], got["text"]) == (want["ids"], want["text"]), f"{got} != {want} ({body})"
        assert got["usage"]["completion_tokens"] == len(want["ids"])

    async def leaves(self, client, rng) -> None:
        body = {"model": "smollm2", "prompt": rng.choice(COMPLETIONS), "max_tokens": 300, "ignore_eos": True}
        if rng.random() < 0.7:  # a stream left after a few chunks
            async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                assert r.status_code == 200, r.status_code
                wanted, n = rng.randint(1, 6), 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
                    if n == wanted:
                        break  # closing the stream closes the connection mid-answer
        else:  # a whole answer the client stops waiting for
            try:
                await client.post("/v1/completions", json=body, timeout=rng.uniform(0.2, 2.0))
            except httpx.TimeoutException:
                pass

    async def bad(self, client, rng) -> None:
        path, body, status = rng.choice(BAD)
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        check_error(r, status)

    async def large(self, client, rng) -> None:
        path, body, status = self.large_bodies[self.num_sent // LARGE_EVERY % 2]
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        check_error(r, status)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("tinyvllm:"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return out


async def sample_rss(server: ServerProcess, samples: list, stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - t0, server.rss_bytes()))
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except TimeoutError:
            pass


async def run_load(server: ServerProcess, args, goods: list) -> tuple[Soak, list, float]:
    soak, samples, stop = Soak(server.url, args, goods), [], asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_rss(server, samples, stop, t0))
    workers = [soak.worker(args.seed + i, t0 + args.seconds) for i in range(args.clients)]
    await asyncio.wait_for(asyncio.gather(*workers), args.seconds + 2 * args.request_timeout)
    duration = time.monotonic() - t0
    stop.set()
    await sampler
    return soak, samples, duration


def touch_every_block(url: str, num_blocks: int, timeout: float) -> None:
    """Write every KV block once, with long prompts of distinct token ids: the pool is np.zeros, whose pages become
    resident only where tokens are written, so that memory would otherwise grow for as long as unused blocks are
    left (a pool filling up, not a leak)."""
    rng = random.Random(1)
    block_tokens = MAX_MODEL_LEN - 16
    for _ in range(-(-num_blocks * 16 // block_tokens) + 1):  # more than the pool: all of it is written
        prompt = [rng.randrange(100, 49_000) for _ in range(block_tokens)]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=timeout)
        assert r.status_code == 200, r.text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--num-kv-blocks", type=int, default=256,
                    help="the pool, in blocks of 16 tokens: room for every client's longest request at once")
    ap.add_argument("--warm-seconds", type=float, help="memory is compared with this point (default: 60, or a third)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=50)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the summary to this file")
    ap.add_argument("--no-save", action="store_true", help="print, do not record")
    args = ap.parse_args()
    warm = args.warm_seconds if args.warm_seconds is not None else min(60.0, args.seconds / 3)
    load = os.getloadavg()[0]
    serve = ["smollm2", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
             "--num-kv-blocks", str(args.num_kv_blocks), "--max-waiting", "64", "--request-timeout",
             str(args.request_timeout)]
    problems, t0 = [], time.monotonic()
    with ServerProcess(*serve) as server:
        print(f"server up in {time.monotonic() - t0:.0f} s", flush=True)
        touch_every_block(server.url, args.num_kv_blocks, args.request_timeout)
        print(f"every KV block written at {time.monotonic() - t0:.0f} s", flush=True)
        goods, dropped = [], []
        for path, body in good_requests():  # each alone: its reference
            r = httpx.post(f"{server.url}{path}", json=body, timeout=args.request_timeout)
            assert r.status_code == 200, r.text
            answer = answer_of(path, r.json())
            (goods if answer["margin"] >= TIE else dropped).append((path, body, answer))
        print(f"{len(goods)} good requests, their references made alone at {time.monotonic() - t0:.0f} s", flush=True)
        for path, body, answer in dropped:
            print(f"  left out, a near tie ({answer['margin']:.3f}): {body.get('prompt') or body['messages']}")
        soak, samples, duration = asyncio.run(run_load(server, args, goods))
        deadline = time.monotonic() + 120  # the aborts and the last steps drain
        while True:
            m = metrics(server.url)
            gauges = {k: m[f"tinyvllm:{k}"] for k in ("num_requests_running", "num_requests_waiting",
                                                       "kv_cache_usage_perc")}
            if not any(gauges.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        rss_end = server.rss_bytes()
        print(f"load over and drained at {time.monotonic() - t0:.0f} s", flush=True)
        for path, body, want in goods:  # alone again, after all that
            got = answer_of(path, httpx.post(f"{server.url}{path}", json=body, timeout=args.request_timeout).json())
            if (got["ids"], got["text"]) != (want["ids"], want["text"]):
                problems.append(f"after the soak, alone: {got} != {want}")
    rss_warm = next((rss for t, rss in samples if t >= warm), samples[-1][1])
    growth_mb = (rss_end - rss_warm) / 2**20
    if any(gauges.values()):
        problems.append(f"gauges not at zero: {gauges}")
    if growth_mb > args.max_rss_growth_mb:
        problems.append(f"resident memory grew {growth_mb:.1f} MB after {warm:.0f} s")
    problems += soak.failures
    summary = {
        "seconds": duration, "clients": args.clients, "requests": sum(soak.counts.values()),
        "by_kind": dict(soak.counts), "failures": len(soak.failures), "problems": problems[:20],
        "median_latency_s": statistics.median(soak.latencies), "rss_warm_mb": rss_warm / 2**20,
        "rss_end_mb": rss_end / 2**20, "rss_growth_mb": growth_mb, "warm_seconds": warm,
        "rss_max_mb": max(rss for _, rss in samples) / 2**20, "gauges_after": gauges,
        "kv_blocks_held_after": 0 if gauges["kv_cache_usage_perc"] == 0 else "some",
        "metrics_after": {k: v for k, v in m.items() if k.endswith("_total") or "_total{" in k},
        "good_requests": len(goods), "load_average_before": load,
    }
    print(json.dumps(summary, indent=1))
    print(f"{summary['requests']} requests in {duration:.0f} s from {args.clients} clients ({dict(soak.counts)}); "
          f"resident memory {summary['rss_warm_mb']:.0f} MB at {warm:.0f} s, {summary['rss_end_mb']:.0f} MB at the "
          f"end ({growth_mb:+.1f} MB); gauges after: {gauges}; KV blocks held after: "
          f"{summary['kv_blocks_held_after']}; {len(problems)} problems")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_save:
        spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
        ch08 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ch08)
        measure.device_info = ch08.cpu_device_info  # a CPU record names the CPU
        rec = measure.Recorder("ch12_soak")
        rec.add("soak", [args.clients, round(duration)], "requests", summary["requests"], **{
            k: summary[k] for k in ("seconds", "by_kind", "failures", "rss_warm_mb", "rss_end_mb", "rss_growth_mb",
                                    "warm_seconds", "gauges_after", "good_requests", "load_average_before")})
        print(f"saved {rec.save()}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
