"""Chapter 11 on the GPU: a timeline of the asynchronous overlap, from a real run.

The engine (graphs + overlap) on the Llama 3.2 1B stand-in decodes at batch 1 and at batch 64 (prompts of 128
random tokens, greedy, eos ignored); a few decode steps in the middle are timed. On the host: planning the next
step (`schedule_ahead`), launching it (`execute_async`: pack, one copy, the graph's replay, the copies back), waiting
for the step before (`get_output`) and post-processing it (tokens, stop checks, outputs), each stamped with
`time.perf_counter`. On the GPU: each replayed graph between two CUDA events recorded on the runner's stream around
the replay, placed on the host's clock by an event recorded on an idle stream at a known host time. Records every
span to book/data/ch11_timeline.json.

    python bench/ch11_timeline.py [--wheel TOKENIZER_WHEEL]     (an H200: under a minute)
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

PROMPT, NEW = 128, 48
KEEP = range(20, 26)  # the decode steps kept (in the steady state)


def timeline(llm, rows: int) -> list[dict]:
    """One run of `rows` requests; the spans of the kept steps: (lane, what, start s, end s) on the host's clock."""
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    scheduler, stream = engine.scheduler, runner.stream
    spans, gpu = [], []  # gpu: (start event, end event) per replay

    def stamped(lane, what, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spans.append({"lane": lane, "what": what, "start": t0, "end": time.perf_counter()})
            return out
        return call

    launch = runner.execute_async

    def execute_async(step):
        t0 = time.perf_counter()
        out = launch(step)
        spans.append({"lane": "host", "what": "launch", "start": t0, "end": time.perf_counter()})
        out.get_output = stamped("host", "wait", out.get_output)
        return out

    replay = runner.graphs.replay

    def timed_replay(size):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        replay(size)
        end.record(stream)
        gpu.append((start, end))

    runner.execute_async = execute_async
    runner.graphs.replay = timed_replay
    scheduler.schedule_ahead = stamped("host", "schedule", scheduler.schedule_ahead)
    engine._postprocess = stamped("host", "postprocess", engine._postprocess)
    # the GPU's clock on the host's: an event on the idle stream at a known host time
    stream.synchronize()
    ref = cuda.event()
    t_ref = time.perf_counter()
    ref.record(stream)
    ref.synchronize()
    rng = np.random.default_rng(rows)
    prompts = [rng.integers(0, 128000, PROMPT).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    stream.synchronize()
    for start, end in gpu:
        s = t_ref + cuda.event_elapsed_time(ref, start) / 1e3
        spans.append({"lane": "GPU", "what": "graph", "start": s, "end": t_ref + cuda.event_elapsed_time(ref, end) / 1e3})
    # the kept window: from the launch of step KEEP[0] to the end of step KEEP[-1]'s post-processing
    launches = sorted(s["start"] for s in spans if s["what"] == "launch")
    posts = sorted(s["end"] for s in spans if s["what"] == "postprocess")
    t0, t1 = launches[KEEP[0]], posts[KEEP[-1]]
    kept = [s for s in spans if s["end"] > t0 and s["start"] < t1]
    for s in kept:
        s["start_ms"], s["end_ms"] = 1e3 * (s.pop("start") - t0), 1e3 * (s.pop("end") - t0)
    for name in ("execute_async", "_postprocess", "schedule_ahead"):
        for obj in (runner, engine, scheduler):
            obj.__dict__.pop(name, None)
    runner.graphs.__dict__.pop("replay", None)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    args = ap.parse_args()
    rec = Recorder("ch11_timeline")
    folder = prepare_llama_standin(wheel=args.wheel)
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT"), "mode": "graphs + overlap", "prompt_len": PROMPT,
             "kept_steps": [KEEP[0], KEEP[-1]]}
    for rows in (1, 64):
        llm = LLM(folder, device="cuda", max_model_len=512, max_num_seqs=rows)
        llm.generate([[1] * PROMPT] * rows, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
        spans = timeline(llm, rows)
        for s in spans:
            rec.add("span", [rows], "ms", s["end_ms"] - s["start_ms"], lane=s["lane"], what=s["what"],
                    start_ms=s["start_ms"], end_ms=s["end_ms"], rows=rows, **extra)
        gpu = [s["end_ms"] - s["start_ms"] for s in spans if s["lane"] == "GPU"]
        host = {w: np.median([s["end_ms"] - s["start_ms"] for s in spans if s["what"] == w])
                for w in ("schedule", "launch", "wait", "postprocess")}
        print(f"{rows} rows: GPU step median {np.median(gpu):.3f} ms; host medians "
              + ", ".join(f"{w} {v:.3f} ms" for w, v in host.items()), flush=True)
        del llm
    print("saved", rec.save())


if __name__ == "__main__":
    main()
