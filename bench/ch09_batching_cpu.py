"""Chapter 9 on the CPU: 16 chat requests to SmolLM2 with the NumPy backend, batched against one at a time,
in one run (32 greedy tokens each, eos ignored, so both do the same work). Records to book/data/ch09_batching.json
under the CPU's name.

    python bench/ch09_batching_cpu.py [--requests 16] [--new-tokens 32]
"""

import argparse
import importlib.util
import time
from pathlib import Path

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.scheduler import Scheduler

_spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
_ch08 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch08)  # cpu_device_info: a CPU record names the CPU

TOPICS = ["the capital of France", "photosynthesis", "rain", "the number pi", "the sky", "copper", "the French Revolution",
          "bicycles", "compilers", "boiling water", "turtles", "Newton's laws", "the moon", "jazz", "volcanoes", "bread"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    llm = LLM("smollm2", device="cpu", max_model_len=512, max_num_seqs=args.requests)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}], tokenize=True)
               for t in (TOPICS * 4)[: args.requests]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    seconds = {}
    for name, rows in (("cpu_one_at_a_time", 1), ("cpu_batched", args.requests)):
        alloc = ContiguousAllocator(rows, engine.max_model_len, engine.model_runner.block_size)
        engine.scheduler = Scheduler(rows, engine.max_num_batched_tokens, alloc)  # chapter 9's
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds[name] = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
    measure.device_info = _ch08.cpu_device_info
    rec = measure.Recorder("ch09_batching")
    num_out = args.requests * args.new_tokens
    for name, s in seconds.items():
        rec.add(name, [args.requests], "tok/s", num_out / s, seconds=s, model="SmolLM2-135M-Instruct", dtype="float32",
                new_tokens=args.new_tokens, prompt_tokens=sum(map(len, prompts)))
        print(f"{name:>18}: {num_out / s:6.1f} output tok/s ({s:.1f} s)")
    ratio = seconds["cpu_one_at_a_time"] / seconds["cpu_batched"]
    rec.records[-1]["vs_one_at_a_time"] = ratio
    print(f"batched: {ratio:.2f}x one at a time on {rec.device['name']}; saved {rec.save()}")


if __name__ == "__main__":
    main()
