"""Chapter 9 on the GPU: continuous batching on Llama 3.2 1B's exact shapes (random bf16 weights).

The nano-vllm workload: prompts and outputs of lengths drawn uniformly from [100, 1024] (seed 0),
random token ids, greedy, eos ignored; 64 and 256 requests in one LLM, and the first few of them
one at a time in the same run. Then one decode step at several batch sizes (contexts of 512 tokens),
timed from Python as the engine runs it and as its kernels alone, replayed from a captured CUDA graph.
Records to book/data/ch09_batching.json.

    python bench/ch09_batching.py [--alone 3]    (an H200: about four minutes)
"""

import argparse
import tempfile
import time

import numpy as np

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.benchmark import nano_vllm_workload
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.input_batch import InputBatch
from tinyvllm_lib.engine.scheduler import Scheduler
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.measure import Recorder, time_launches
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama

MAX_MODEL_LEN, MAX_NUM_SEQS = 2048, 256


def workload(n: int, vocab: int, seed: int = 0):
    prompts, output_lens = nano_vllm_workload(n, 100, 1024, seed, vocab)  # chapter 11's, the same draws
    return prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in output_lens]


class StepLog:
    """Wraps the runner's execute (an instance attribute): each step's kind, size and wall seconds."""

    def __init__(self, execute):
        self.execute, self.steps = execute, []

    def __call__(self, step):
        t0 = time.perf_counter()
        out = self.execute(step)  # the sampler copies the tokens back: the step is done when this returns
        self.steps.append((step.num_prefills > 0, len(step.requests), step.num_tokens, time.perf_counter() - t0))
        return out


def run(llm: LLM, log: StepLog, prompts, params) -> dict:
    log.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    assert num_out == sum(p.max_tokens for p in params)
    decode = [s for s in log.steps if not s[0]]
    return {"seconds": seconds, "output_tokens": num_out, "prompt_tokens": num_in, "steps": len(log.steps),
            "prefill_steps": len(log.steps) - len(decode), "prefill_seconds": sum(s[3] for s in log.steps if s[0]),
            "decode_seconds": sum(s[3] for s in decode), "mean_decode_rows": float(np.mean([s[1] for s in decode])),
            "mean_decode_step_ms": 1e3 * float(np.mean([s[3] for s in decode]))}


def contiguous_scheduler(engine, rows: int) -> Scheduler:
    """Chapter 9's scheduler on `rows` contiguous rows of max_model_len slots, laid in the engine's KV pool."""
    alloc = ContiguousAllocator(rows, engine.max_model_len, engine.model_runner.block_size)
    if alloc.num_slots > engine.model_runner.kv_cache.num_slots:
        raise ValueError(f"{rows} rows of {engine.max_model_len} slots do not fit in the engine's pool")
    return Scheduler(rows, engine.max_num_batched_tokens, alloc)


def decode_step_times(llm: LLM, rows: int, context: int = 512) -> tuple[float, float]:
    """(wall seconds, kernel seconds) of one decode step of `rows` requests at `context` tokens each."""
    engine = llm.llm_engine
    runner = engine.model_runner
    alloc = ContiguousAllocator(rows, engine.max_model_len, runner.block_size)  # chapter 9's rows, in the pool
    rng = np.random.default_rng(rows)
    requests = [engine.make_request(f"t{i}", rng.integers(0, 1000, context).tolist(),
                                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for i in range(rows)]
    held = [alloc.allocate() for _ in requests]
    try:
        tables = alloc.block_tables(held)
        per = max(1, engine.max_num_batched_tokens // context)
        for start in range(0, rows, per):  # prefill in steps within the token budget
            part = slice(start, start + per)
            runner.execute(SchedulerOutput(requests[part], [context] * len(requests[part]), len(requests[part]), tables[part]))
        for r in requests:
            r.num_computed_tokens = context
            r.output_token_ids.append(7)
        step = SchedulerOutput(requests, [1] * rows, 0, tables)
        runner.execute(step)
        t0 = time.perf_counter()
        for _ in range(10):
            runner.execute(step)
        wall = (time.perf_counter() - t0) / 10
        batch = InputBatch.from_step(step, runner.block_size)  # the step's kernels, sampler included
        runner.packed.pack(batch, turn=0)
        runner.packed.copy(batch, runner.stream)
        runner.stream.synchronize()
        kernels = time_launches(lambda i, s: runner.run(batch, s), 1, repeats=10)
    finally:
        for row in held:
            alloc.free(row)
    return wall, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alone", type=int, default=3, help="requests of the 64-request workload to run one at a time")
    args = ap.parse_args()
    rec = Recorder("ch09_batching")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_random_llama(tmp, LLAMA_3_2_1B_CONFIG, seed=0)
        llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                  enforce_eager=True)  # chapter 9 launches from Python: its numbers stay its own
        engine = llm.llm_engine
        engine.scheduler = contiguous_scheduler(engine, MAX_NUM_SEQS)
        log = StepLog(engine.model_runner.execute)
        engine.model_runner.execute = log
        vocab = llm.config.vocab_size
        warm_prompts, warm_params = workload(8, vocab, seed=1)
        llm.generate(warm_prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 8, use_tqdm=False)
        extra = {"model": "Llama 3.2 1B shapes, random bf16 weights", "max_model_len": MAX_MODEL_LEN,
                 "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": engine.max_num_batched_tokens, "workload":
                 "prompt and output lengths uniform in [100, 1024], seed 0, random ids, greedy, ignore_eos"}
        for n in (64, 256):
            prompts, params = workload(n, vocab)
            r = run(llm, log, prompts, params)
            out_tok_s, total_tok_s = r["output_tokens"] / r["seconds"], (r["output_tokens"] + r["prompt_tokens"]) / r["seconds"]
            rec.add("output_throughput", [n], "tok/s", out_tok_s, total_tok_s=total_tok_s, **r, **extra)
            print(f"{n:>3} requests: {out_tok_s:8.0f} output tok/s, {total_tok_s:8.0f} total tok/s, {r['steps']} steps "
                  f"({r['prefill_steps']} prefill, {r['prefill_seconds']:.1f} s), {r['seconds']:.1f} s; decode steps "
                  f"{r['mean_decode_step_ms']:.1f} ms at {r['mean_decode_rows']:.0f} rows on average")
        prompts, params = workload(64, vocab)
        engine.scheduler = contiguous_scheduler(engine, 1)  # one at a time
        r = run(llm, log, prompts[: args.alone], params[: args.alone])
        rec.add("one_at_a_time", [args.alone], "tok/s", r["output_tokens"] / r["seconds"], **r, **extra)
        print(f"one at a time ({args.alone} requests): {r['output_tokens'] / r['seconds']:.1f} output tok/s")
        engine.scheduler = contiguous_scheduler(engine, MAX_NUM_SEQS)
        for rows in (1, 16, 64, 256):
            wall, kernels = decode_step_times(llm, rows)
            rec.add("decode_step_wall", [rows], "ms", wall * 1e3, context=512)
            rec.add("decode_step_kernels", [rows], "ms", kernels * 1e3, context=512, launch_share=1 - kernels / wall)
            print(f"decode step of {rows:>3} requests at 512 tokens: {wall * 1e3:6.2f} ms from Python, {kernels * 1e3:6.2f} ms "
                  f"of kernels ({1 - kernels / wall:.0%} lost to launches and the host)")
    print("saved", rec.save())


if __name__ == "__main__":
    main()
