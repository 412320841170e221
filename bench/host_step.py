"""The host's side of a 256-row decode step, phase by phase, on the CPU.

On the GPU a replayed 256-row decode step takes ~3.1 ms and chapter 11's overlap hides the host's work for step
N + 1 behind it, so a step costs max(GPU, host). This measures the host's share alone: LLMEngine with async
scheduling (as on the GPU: every steady decode step is planned by schedule_ahead) and its runner replaced by a
stand-in that does what ModelRunner.execute_async does on the host (InputBatch.from_step, PackedInputs.pack into
the pinned buffer, padded to the graph's size; no device copy, no launch) and returns random token ids at once.
256 requests (prompts of 128..512 random ids < 10,000, ignore_eos, max_tokens large), prefix caching on (the
default) unless said; once all 256 decode, each step's CPU time (this thread's: other jobs on the machine do not
count) is split into phases:

    schedule        PagedScheduler.schedule and AsyncScheduler.schedule_ahead
    from_step       InputBatch.from_step, less its sampling metadata
    sampling        the step's SamplingMetadata
    pack            PackedInputs.pack (host buffer only)
    postprocess     PagedScheduler.postprocess (count, cache blocks, append tokens, free)
    engine_output   the rest of LLMEngine._postprocess (stats, outputs, done)
    step            the whole of LLMEngine.step (the phases, the stand-in's random draws, the rest)

Settings: greedy, temperature 0.6 top_p 0.9, greedy with logprobs=5 (FINAL_ONLY, as LLM.generate asks), greedy
streaming (CUMULATIVE: an output per request per step, text decoded as it grows), and greedy without prefix
caching. The tokenizer is the embedded SmolLM2's (the model is a 2-layer random Llama of its vocabulary: it never
runs). Prints the median µs per step and per row of each phase; records to book/data/host_step.json.

    NUMBA_ENABLE_CUDASIM=1 python bench/host_step.py [--steps 256] [--rows 256] [--label L]   (~1 minute)

A run under another --label keeps this CPU's records of the others: the book compares the engine before its
host-side work (label "before": ENGINE_COMMIT=a9447f4, PYTHONPATH a checkout of it, TINYVLLM_DATA this
repository's book/data) with the engine now (label "now").
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import tinyvllm_lib.measure as measure
from tinyvllm_lib.engine import input_batch as input_batch_module
from tinyvllm_lib.engine.async_scheduler import AsyncScheduler
from tinyvllm_lib.engine.cuda_graphs import cuda_graph_sizes, graph_size_for
from tinyvllm_lib.engine.input_batch import InputBatch, PackedInputs
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.models.smollm2 import resolve_model

_spec = importlib.util.spec_from_file_location("ch08_decode_cpu", Path(__file__).with_name("ch08_decode_cpu.py"))
_ch08 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch08)  # cpu_device_info: a CPU record names the CPU

PHASES = ("schedule", "from_step", "sampling", "pack", "postprocess", "engine_output", "step")
FINAL = RequestOutputKind.FINAL_ONLY
SETTINGS = {
    "greedy": (SamplingParams(temperature=0.0, output_kind=FINAL), True),
    "t 0.6 top_p 0.9": (SamplingParams(temperature=0.6, top_p=0.9, output_kind=FINAL), True),
    "logprobs 5": (SamplingParams(temperature=0.0, logprobs=5, output_kind=FINAL), True),
    "greedy streaming": (SamplingParams(temperature=0.0), True),
    "greedy, no prefix caching": (SamplingParams(temperature=0.0, output_kind=FINAL), False),
}


class Phases:
    """CPU seconds per phase within one engine step; nested phases are subtracted from the phase around them."""

    def __init__(self):
        self.now, self.stack = dict.fromkeys(PHASES, 0.0), []

    def wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            t0, self.stack = time.thread_time(), [*self.stack, 0.0]
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                inner = self.stack.pop()
                self.now[phase] += spent - (inner if phase != "step" else 0.0)
                if self.stack and phase != "step":
                    self.stack[-1] += spent
        return timed


class Pending:
    def __init__(self, result: ModelRunnerOutput, cudagraph_size):
        self.result, self.cudagraph_size = result, cudagraph_size

    def get_output(self) -> ModelRunnerOutput:
        return self.result


class StandInRunner:
    """execute_async as ModelRunner's on the host (from_step, pack padded to a graph's size, no copy, no launch);
    random tokens (and log-probs, where asked) at once."""

    def __init__(self, engine: LLMEngine, phases: Phases):
        e = engine
        self.block_size, self.graphs = e.engine_config.block_size, cuda_graph_sizes(e.max_num_seqs)
        max_blocks = -(-e.max_model_len // self.block_size)
        self.packed = PackedInputs(e.max_num_batched_tokens, e.max_num_seqs, max_blocks)
        self.packed.pack = phases.wrap(self.packed.pack, "pack")
        self.vocab, self.turn, self.rng = e.config.vocab_size, 0, np.random.default_rng(0)

    def execute_async(self, step) -> Pending:
        batch = InputBatch.from_step(step, self.block_size)
        size = graph_size_for(batch.num_reqs, self.graphs) if batch.is_uniform_decode else None
        self.packed.pack(batch, self.turn, pad_to=size)
        self.turn = 1 - self.turn
        n, k = batch.num_sampled, int(batch.sampling.num_logprobs.max(initial=-1))
        out = SamplerOutput(self.rng.integers(0, self.vocab, n))
        if k >= 0:
            out.logprobs = -self.rng.random(n, np.float32)
            out.top_ids = self.rng.integers(0, self.vocab, (n, max(k, 1)))
            out.top_logprobs = -self.rng.random((n, max(k, 1)), np.float32)
        return Pending(ModelRunnerOutput(out, [None] * batch.num_reqs), size)

    def execute(self, step) -> ModelRunnerOutput:
        return self.execute_async(step).get_output()


def model_folder() -> Path:
    """A 2-layer random Llama of SmolLM2's vocabulary, with SmolLM2's tokenizer (it never runs)."""
    smol = resolve_model("smollm2")
    folder = Path(tempfile.mkdtemp(prefix="host_step_"))
    make_random_llama(folder, tiny_llama_config(vocab_size=49152, max_position_embeddings=2048), seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, folder / name)
    return folder


def run(folder: Path, params: SamplingParams, prefix_caching: bool, rows: int, steps: int) -> dict:
    """Median CPU µs per step of each phase over `steps` decode steps with all `rows` requests running."""
    e = LLMEngine(folder, "cpu", max_model_len=2048, max_num_seqs=rows, num_kv_blocks=rows * 64,
                  enable_prefix_caching=prefix_caching)
    phases = Phases()
    e.model_runner = StandInRunner(e, phases)
    # what LLMEngine does with the graph runner: steps overlap, decode steps planned ahead
    e.async_scheduling = True
    e.scheduler = AsyncScheduler(e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len, e.block_manager)
    s = e.scheduler
    s.schedule, s.schedule_ahead = phases.wrap(s.schedule, "schedule"), phases.wrap(s.schedule_ahead, "schedule")
    s.postprocess = phases.wrap(s.postprocess, "postprocess")
    e._postprocess = phases.wrap(e._postprocess, "engine_output")
    step = phases.wrap(e.step, "step")
    metadata = input_batch_module.SamplingMetadata
    from_step = InputBatch.__dict__["from_step"]
    builders = {name: metadata.__dict__[name] for name in ("from_params", "from_settings") if name in metadata.__dict__}
    InputBatch.from_step = classmethod(phases.wrap(from_step.__func__, "from_step"))
    for name, builder in builders.items():  # the sampling metadata, however from_step makes it
        setattr(metadata, name, classmethod(phases.wrap(builder.__func__, "sampling")))
    try:
        rng = np.random.default_rng(1)
        for i in range(rows):
            prompt = rng.integers(0, 10_000, int(rng.integers(128, 513))).tolist()
            e.add_request(str(i), prompt, replace(params, max_tokens=1500, ignore_eos=True))
        samples = []
        while len(samples) < steps:
            phases.now = dict.fromkeys(PHASES, 0.0)
            step()
            if s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
                continue  # admitting and prefilling
            samples.append(phases.now)
    finally:
        InputBatch.from_step = from_step
        for name, builder in builders.items():
            setattr(metadata, name, builder)
    assert len(s.running) == rows
    return {p: 1e6 * float(np.median([x[p] for x in samples])) for p in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256, help="decode steps timed (16 blocks' worth at 256)")
    ap.add_argument("--label", default=None, help="what this run measures (e.g. a commit's change)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    folder = model_folder()
    measure.device_info = _ch08.cpu_device_info
    rec = measure.Recorder("host_step")
    commit = os.environ.get("ENGINE_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    print(f"{args.rows} rows, median CPU µs per decode step over {args.steps} steps (per row in brackets)")
    print(f"{'setting':>26} " + " ".join(f"{p:>17}" for p in PHASES))
    for name, (params, caching) in SETTINGS.items():
        r = run(folder, params, caching, args.rows, args.steps)
        print(f"{name:>26} " + " ".join(f"{r[p]:8.0f} ({r[p] / args.rows:5.2f})" for p in PHASES), flush=True)
        rec.add("host_decode_step", [args.rows], "us", r["step"], setting=name, prefix_caching=caching,
                phases_us=r, steps=args.steps, engine_commit=commit, label=args.label,
                load_average=os.getloadavg()[0])  # other jobs on the machine slow even CPU time
    shutil.rmtree(folder, ignore_errors=True)
    if not args.no_save:
        # this device's records of other labels stay (a run before a change, and after it)
        rec.records += [r for r in measure.load_records("host_step")
                        if r["device"].get("name") == rec.device.get("name") and r.get("label") != args.label]
        print("saved", rec.save())


if __name__ == "__main__":
    main()
