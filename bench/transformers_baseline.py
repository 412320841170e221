"""Hugging Face transformers as the baseline for the engine's benchmarks.

bs1_decode: batch 1, random prompt, greedy, exactly new_tokens (eos neither stops nor
  is masked, as the engine's ignore_eos). "eager": the dynamic cache. "compile": a
  static cache and CompileConfig(mode="reduce-overhead"), with which generate
  torch.compiles the decode step (prefill stays eager): transformers 5's form of the
  docs' "static cache + torch.compile(model.forward, mode='reduce-overhead')". One
  StaticCache, reset, serves every call (the docs' second way): generate's fresh cache
  per call may move, and cudagraphs re-record when a static input moves.
  Timing: per repeat one generate, the GPU synchronised before and after. A logits
  processor synchronises once, at its first call (prefill's logits ready, first token
  about to be picked) and stamps t_first; later calls do nothing, so decode runs
  unperturbed. tok_s = (new_tokens - 1) / (t_total - t_first), e2e_tok_s = new_tokens
  / t_total, ttft_ms = t_first: medians over repeats. ttft_ms_separate, a cross-check,
  times whole generates of 1 token (set-up and tear-down too). Warm-up before timing:
  two full generates and a 1-token one (compiling, recording cudagraphs).
throughput: the nano-vllm workload (nano_vllm_workload) in static batches of batch_size
  requests in request order: left padding, attention mask, greedy, each request runs to
  its batch's longest output; only its own output_lens tokens count. Wall time covers
  the whole workload, after a warm-up. To shorten a run pass a smaller num_requests:
  the result says what ran; nothing is extrapolated.
Run: .venv/bin/python bench/transformers_baseline.py FOLDER [--device cuda|cpu]
"""

import argparse
import inspect
import statistics
import time

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    CompileConfig,
    LogitsProcessor,
    StaticCache,
)

from tinyvllm_lib.benchmark import nano_vllm_workload  # the engine's requests

VERSIONS = {"torch": torch.__version__, "transformers": transformers.__version__}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def load(folder, device):
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(device)
    assert model.dtype == torch.bfloat16, model.dtype
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None  # never stop, never mask: exactly max_new_tokens
    gc.pad_token_id = 0  # only fills left padding here
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    return model


def set_mode(model, mode, device):
    if mode == "compile":
        gc = model.generation_config
        if device == "cuda":
            gc.compile_config = CompileConfig(mode="reduce-overhead")
        else:  # CPU test only: inductor without cudagraphs
            gc.compile_config = CompileConfig(mode="default")
            gc.compile_config._compile_all_devices = True
    elif mode != "eager":
        raise ValueError(f"mode {mode!r}: 'eager' or 'compile'")


def generate(model, mode, caches, ids, mask, max_new_tokens, **kw):
    """generate; in compile mode with one reused StaticCache per batch size."""
    if mode == "compile":
        if len(ids) not in caches:
            caches[len(ids)] = StaticCache(
                config=model.config, max_cache_len=caches["max_cache_len"]
            )
        caches[len(ids)].reset()
        name = (
            "cache"
            if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values"
        )  # renamed in transformers 5
        kw[name] = caches[len(ids)]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kw)
    assert out.shape[1] == ids.shape[1] + max_new_tokens, out.shape
    return out[:, ids.shape[1] :]


class FirstTokenClock(LogitsProcessor):
    """Synchronise and stamp the time at the first call only."""

    def __init__(self, device):
        self.device, self.t = device, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            sync(self.device)
            self.t = time.perf_counter()
        return scores


@torch.inference_mode()
def bs1_decode(
    folder, mode, prompt_len=128, new_tokens=256, repeats=3, seed=0, device="cuda"
):
    model = load(folder, device)
    set_mode(model, mode, device)
    caches = {"max_cache_len": prompt_len + new_tokens}
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, prompt_len)
    ids = torch.tensor(ids[None], device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        clock = FirstTokenClock(device)
        sync(device)
        t0 = time.perf_counter()
        out = generate(model, mode, caches, ids, mask, n, logits_processor=[clock])
        sync(device)
        t1 = time.perf_counter()
        return out[0].tolist(), clock.t - t0, t1 - t0

    t0 = time.perf_counter()
    warm = [gen(new_tokens)[2] for _ in range(2)]  # compiles, records cudagraphs
    gen(1)
    warmup_s = time.perf_counter() - t0
    frames = dict(torch._dynamo.utils.counters["frames"])
    runs = [gen(new_tokens) for _ in range(repeats)]
    recompiled = dict(torch._dynamo.utils.counters["frames"]) != frames
    tokens = runs[0][0]
    # random weights leave near-ties between logits, which a compiled step may break another way on
    # another run; the timing stands (every run makes new_tokens), and the record says how many agreed
    same_tokens = sum(r[0] == tokens for r in runs)
    first, total = [r[1] for r in runs], [r[2] for r in runs]
    decode = [(new_tokens - 1) / (b - a) for a, b in zip(first, total)]
    separate = [gen(1)[2] for _ in range(repeats)]
    return {
        "mode": mode,
        "device": device,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "tok_s": statistics.median(decode),
        "e2e_tok_s": new_tokens / statistics.median(total),
        "ttft_ms": 1e3 * statistics.median(first),
        "ttft_ms_separate": 1e3 * statistics.median(separate),
        "decode_tok_s_runs": decode,
        "total_s_runs": total,
        "warmup_s": warmup_s,
        "warmup_generate_s": warm,
        "compiled": hasattr(model, "_compiled_call"),
        "recompiled_while_timed": recompiled,
        "tokens": tokens[:16],
        "repeats_with_the_first_repeats_tokens": same_tokens,
        **VERSIONS,
    }


@torch.inference_mode()
def ttft(folder, lengths, repeats=3, seed=0, device="cuda"):
    """Time to first token at each prompt length, eager (bf16, sdpa): generate one token, the time from the call
    to the first logits (FirstTokenClock), median of `repeats` after one warm-up run at that length."""
    model = load(folder, device)
    rng = np.random.default_rng(seed)
    out = {}
    for n in lengths:
        ids = torch.tensor(rng.integers(0, model.config.vocab_size, n)[None], device=device)
        mask = torch.ones_like(ids)
        times = []
        for i in range(repeats + 1):
            clock = FirstTokenClock(device)
            sync(device)
            t0 = time.perf_counter()
            generate(model, "eager", {}, ids, mask, 1, logits_processor=[clock])
            if i:  # the first run warms this length up
                times.append(clock.t - t0)
        out[n] = {"ttft_ms": 1e3 * statistics.median(times), "ttft_ms_runs": [1e3 * t for t in times]}
    del model
    return out


def run_batch(model, mode, caches, prompts, max_new, device):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return generate(model, mode, caches, ids.to(device), mask.to(device), max_new)


@torch.inference_mode()
def throughput(
    folder,
    mode="eager",
    num_requests=256,
    min_len=100,
    max_len=1024,
    seed=0,
    batch_sizes=(64, 128, 256),
    device="cuda",
):
    model = load(folder, device)
    set_mode(model, mode, device)
    prompts, outs = nano_vllm_workload(
        num_requests, min_len, max_len, seed, model.config.vocab_size
    )
    useful = sum(outs)
    rows = []
    for bs in batch_sizes:
        bs = min(bs, num_requests)
        caches = {"max_cache_len": 2 * max_len}  # one cache length for all batches
        t0 = time.perf_counter()  # warm-up: every batch shape the run will use
        for size in {bs, num_requests % bs or bs}:
            run_batch(model, mode, caches, prompts[:size], 4, device)
        sync(device)
        warmup_s = time.perf_counter() - t0
        computed = 0
        t0 = time.perf_counter()
        for i in range(0, num_requests, bs):
            max_new = max(outs[i : i + bs])
            run_batch(model, mode, caches, prompts[i : i + bs], max_new, device)
            computed += max_new * len(outs[i : i + bs])
        sync(device)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "batch_size": bs,
                "seconds": seconds,
                "warmup_s": warmup_s,
                "output_tok_s": useful / seconds,
                "computed_tokens": computed,
                "useful_fraction": useful / computed,
            }
        )
        print(
            f"batch {bs:>4}: {useful / seconds:9.1f} useful output tok/s, "
            f"{seconds:7.1f} s, {useful / computed:.0%} of computed tokens useful"
        )
    best = max(rows, key=lambda r: r["output_tok_s"])
    return {
        "mode": mode,
        "device": device,
        "num_requests": num_requests,
        "min_len": min_len,
        "max_len": max_len,
        "seed": seed,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": useful,
        "best_output_tok_s": best["output_tok_s"],
        "best_batch_size": best["batch_size"],
        "rows": rows,
        **VERSIONS,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--throughput-mode", default="eager", choices=["eager", "compile"])
    ap.add_argument("--quick", action="store_true", help="tiny lengths (CPU check)")
    a = ap.parse_args()
    bs1 = dict(prompt_len=16, new_tokens=8, repeats=2) if a.quick else {}
    tp = (
        dict(num_requests=8, min_len=4, max_len=16, batch_sizes=(3, 8))
        if a.quick
        else {}
    )
    for mode in ("eager", "compile"):
        print(bs1_decode(a.folder, mode, device=a.device, **bs1))
    print(throughput(a.folder, a.throughput_mode, device=a.device, **tp))
