"""Chapter 08 on the CPU: decode speed at batch 1 for SmolLM2 with the NumPy engine, against
transformers (float32, same CPU, `model.generate` with its KV cache), in one run. Records to
book/data/ch08_kv_cache.json under the CPU's name.

    python bench/ch08_decode_cpu.py [--runs 5] [--new-tokens 32]

Each run generates `new_tokens` greedy tokens (eos ignored, so exactly that many) after a short
chat prompt, with each engine in turn, so both see the same machine load. Decode speed is timed
inside each request: from the end of the prefill to the last decode step, (new_tokens - 1) steps
of forward pass + sampling (ours: timestamps of the runner's calls; transformers: of its
streamer's calls). End to end: new_tokens / the request's wall time. Medians over the runs.
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "Write a short story about a cat who learns to fly."}]  # an answer longer than 32 tokens


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_device_info() -> dict:
    """This is a CPU measurement: the record names the CPU (and its core count), not a GPU."""
    return {"name": f"CPU: {cpu_name()} ({os.cpu_count()} cores)", "kind": "cpu", "cpu": cpu_name(), "cores": os.cpu_count()}


class Timestamps:
    """Records when each call happens: wraps our runner's execute; is transformers' streamer (put per token)."""

    def __init__(self, fn=None):
        self.fn, self.times = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.times.append(time.perf_counter())
        return out

    def put(self, value):  # transformers: the prompt once, then each new token
        self.times.append(time.perf_counter())

    def end(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-save", action="store_true", help="print, do not record")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    llm = LLM("smollm2", device="cpu", max_num_seqs=1)
    prompt_ids = llm.tokenizer.apply_chat_template(QUESTION, tokenize=True)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.folder), dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt_ids])
    mask = torch.ones_like(input_ids)

    runner = llm.llm_engine.model_runner
    steps = Timestamps(runner.execute)
    runner.execute = steps  # the runner's calls (an instance attribute): the prefill, then one per decode step

    def ours(num_tokens: int) -> tuple[list[int], float, float]:
        """(tokens, decode seconds for num_tokens - 1 steps, wall seconds)."""
        steps.times.clear()
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        tokens = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].token_ids
        wall = time.perf_counter() - t0
        assert len(steps.times) == num_tokens  # 1 prefill + num_tokens - 1 decode steps
        return tokens, steps.times[-1] - steps.times[0], wall

    def theirs(num_tokens: int) -> tuple[list[int], float, float]:
        streamer = Timestamps()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=num_tokens,
                              min_new_tokens=num_tokens, pad_token_id=llm.config.eos_token_ids[0], streamer=streamer)
        wall = time.perf_counter() - t0
        assert len(streamer.times) == num_tokens + 1  # the prompt, then each new token
        return out[0, len(prompt_ids):].tolist(), streamer.times[-1] - streamer.times[1], wall

    n = args.new_tokens
    tokens_ours, tokens_theirs = ours(n)[0], theirs(n)[0]  # warm-up, and a check that both decode the same
    same = sum(a == b for a, b in zip(tokens_ours, tokens_theirs))
    print(f"{len(prompt_ids)} prompt tokens; greedy tokens agree at {same}/{n} steps")
    samples = {"tinyvllm": {"decode": [], "wall": []}, "transformers": {"decode": [], "wall": []}}
    for run in range(args.runs):
        for name, fn in (("tinyvllm", ours), ("transformers", theirs)):
            _, decode_seconds, wall = fn(n)
            samples[name]["decode"].append(decode_seconds)
            samples[name]["wall"].append(wall)
        print(f"run {run + 1}/{args.runs}: " + ", ".join(
            f"{k} {(n - 1) / samples[k]['decode'][-1]:.1f} tok/s" for k in samples))

    measure.device_info = cpu_device_info  # a CPU measurement: name the CPU, not a GPU
    rec = measure.Recorder("ch08_kv_cache")
    extra = {"prompt_tokens": len(prompt_ids), "new_tokens": n, "runs": args.runs, "model": "SmolLM2-135M-Instruct",
             "dtype": "float32", "torch": torch.__version__, "transformers": transformers.__version__,
             "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
             "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}  # other work on the CPU
    results = {}
    for name, label in (("tinyvllm", "tinyvllm_numpy"), ("transformers", "transformers")):
        decode_s, wall = (np.array(samples[name][k]) for k in ("decode", "wall"))
        decode = statistics.median((n - 1) / decode_s)
        end_to_end = statistics.median(n / wall)
        results[name] = decode
        rec.add(f"{label}_decode", [1, n], "tok/s", decode, seconds_decode=list(decode_s), **extra)
        rec.add(f"{label}_end_to_end", [1, n], "tok/s", end_to_end, seconds_wall=list(wall), **extra)
        print(f"{label:>16}: decode {decode:6.1f} tok/s ({(n - 1)} steps), end to end {end_to_end:6.1f} tok/s")
    ratio = results["tinyvllm"] / results["transformers"]
    rec.records[0]["vs_transformers"] = ratio
    print(f"decode speed: {ratio:.2f}x transformers on {rec.device['name']}")
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
