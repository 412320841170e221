"""Chapter 11 on the CPU: what the host spends on a decode step when the model costs nothing.

The engine runs nano-vllm's workload (and one 128 + 256-token request alone) with its runner
replaced by a stand-in that prepares the step's inputs and packs them as the GPU runner does
(InputBatch.from_step, PackedInputs.pack, padded to a graph's size) and returns random token ids at once. What is
left is the host's share of a step, timed as this thread's CPU time: schedule, prepare and pack, postprocess (append tokens,
detokenize, stop checks, outputs). Records the median decode step by batch size to
book/data/ch11_host_cpu.json under the CPU's name.

    NUMBA_ENABLE_CUDASIM=1 python bench/ch11_host_cpu.py     (~1 minute; the simulator only makes the pinned buffer)
"""

import importlib.util
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import tinyvllm_lib.measure as measure
from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.cuda_graphs import cuda_graph_sizes, graph_size_for
from tinyvllm_lib.engine.input_batch import InputBatch, PackedInputs
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.sampling_params import RequestOutputKind
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

_spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
_ch08 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch08)  # cpu_device_info: a CPU record names the CPU

# the stand-in's tokenizer and config with a model too small to matter (it never runs)
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}


class StandInRunner:
    """execute(step): the step's InputBatch, packed as ModelRunner.execute_async packs it (a decode step padded to
    its graph's size), sampled at random; timed."""

    def __init__(self, max_rows: int, max_tokens: int, max_blocks: int, block_size: int = 16):
        self.packed, self.block_size = PackedInputs(max_tokens, max_rows, max_blocks), block_size
        self.sizes, self.turn = cuda_graph_sizes(max_rows), 0
        self.rng, self.seconds = np.random.default_rng(0), 0.0

    def __call__(self, step):
        t0 = time.thread_time()
        batch = InputBatch.from_step(step, self.block_size)
        size = graph_size_for(batch.num_reqs, self.sizes) if batch.is_uniform_decode else None
        self.packed.pack(batch, self.turn, pad_to=size)
        self.turn = 1 - self.turn
        n = batch.num_sampled
        out = ModelRunnerOutput(SamplerOutput(self.rng.integers(0, 128000, n)), [None] * len(step.requests))
        self.seconds += time.thread_time() - t0
        return out


def decode_steps(engine: LLMEngine, runner: StandInRunner, rows: int) -> dict:
    """Step until done; the median CPU time (this thread's: other jobs on the machine do not count) of decode
    steps with `rows` running, and its execute share."""
    walls, executes = [], []
    while engine.has_unfinished_requests():
        step_rows, before = len(engine.scheduler.running), runner.seconds
        t0 = time.thread_time()
        engine.step()
        wall = time.thread_time() - t0
        if step_rows == rows and not engine.scheduler.waiting:
            walls.append(wall)
            executes.append(runner.seconds - before)
    return {"steps": len(walls), "host_ms": 1e3 * float(np.median(walls)),
            "prepare_and_pack_ms": 1e3 * float(np.median(executes))}


def main() -> None:
    folder = prepare_llama_standin(config_overrides=SMALL)
    measure.device_info = _ch08.cpu_device_info
    rec = measure.Recorder("ch11_host_cpu")
    for rows in (1, 64, 256):
        engine = LLMEngine(folder, device="cpu", max_model_len=2048, max_num_seqs=rows, num_kv_blocks=rows * 128)
        runner = StandInRunner(rows, engine.max_num_batched_tokens, 128)
        engine.model_runner.execute = runner
        if rows == 1:
            prompts, outs = [np.random.default_rng(0).integers(0, 128000, 128).tolist()], [256]
        else:
            prompts, outs = benchmark.nano_vllm_workload(rows, vocab_size=128256)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            # FINAL_ONLY, as LLM.generate asks when nothing streams
            engine.add_request(str(i), p, replace(benchmark.greedy(o), output_kind=RequestOutputKind.FINAL_ONLY))
        r = decode_steps(engine, runner, rows)
        rec.add("host_step", [rows], "ms", r["host_ms"], **r, tokenizer="Llama 3.2 (FINAL_ONLY, no stop strings: decoded once, at the end)",
                load_average=os.getloadavg()[0])  # other jobs on the machine slow even CPU time
        print(f"{rows:>3} running: host {r['host_ms']:.2f} ms per decode step (prepare + pack "
              f"{r['prepare_and_pack_ms']:.2f} ms), median of {r['steps']} steps -> at most "
              f"{rows / r['host_ms'] * 1e3:,.0f} tok/s if the GPU took no time", flush=True)
    print("saved", rec.save())


if __name__ == "__main__":
    main()
