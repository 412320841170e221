"""Chapter 8: what each knob of the decode attention kernel does, at Llama 3.2 1B's shapes.

Moves one knob at a time away from the module's defaults: values per lane of a key row
(lane_elements), rows a lane loads at once (keys_per_lane), a register cap, warps per block, keys
per split, the grid size the splits aim for and loading the next step's rows early (prefetch), at 1, 8 and 64 sequences x 1024 tokens of context (a paged cache of
16-slot blocks in shuffled order). Every variant is checked against the float64 reference before
it is timed (in a CUDA graph, rotating through K/V sets larger than L2). Records to
book/data/ch08_decode_tune.json (--mixed: ch08_decode_mixed.json); the chapter plots the first and the defaults
are chosen from it.

    python bench/ch08_decode_tune.py [--grid] [--seqs 64 8 1] [--mixed]
"""

import argparse
import itertools

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.decode_attention_kernel import decode_attention_kernel_for
from tinyvllm_lib.kernels.decode_splits import decode_splits, decode_workspace
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    num_rotations,
    time_launches,
)

H, KVH, D, CONTEXT, BLOCK = 32, 8, 64, 1024, 16
MIXED_MAX = 2048  # --mixed: the longest context (nano-vllm's workload: 1,024 prompt + 1,024 new tokens)


def make_case(gen, num_seqs: int, mixed: bool = False) -> dict:
    """Rotating K/V sets, a shuffled block table, full contexts (mixed: lengths uniform in [100, MIXED_MAX], as
    nano-vllm's workload reaches, with the grid sized for MIXED_MAX as a captured step's is), random queries;
    the reference for set 0."""
    max_len = MIXED_MAX if mixed else CONTEXT
    blocks_per_seq = max_len // BLOCK
    num_slots = num_seqs * max_len
    lens = gen.integers(100, MIXED_MAX + 1, num_seqs).astype(np.int32) if mixed else np.full(num_seqs, CONTEXT, np.int32)
    kv_bytes = 2 * int(lens.sum()) * KVH * D * 2  # what the kernel reads
    host = []  # the first set's bits, for the reference
    sets = []
    for _ in range(num_rotations(kv_bytes)):
        k, v = (f32_to_bf16_bits(gen.standard_normal((num_slots, KVH, D), np.float32)) for _ in range(2))
        host = host or [k, v]
        sets.append((cuda.to_device(k), cuda.to_device(v)))
    bt = gen.permutation(num_seqs * blocks_per_seq).astype(np.int32).reshape(num_seqs, blocks_per_seq)
    qkv = gen.standard_normal((num_seqs, (H + 2 * KVH) * D)).astype(np.float32)
    want = decode_attention_ref(qkv, *host, bt, BLOCK, lens, H, KVH, D)
    return {"n": num_seqs, "kv_bytes": kv_bytes, "max_len": max_len, "sets": sets, "bt": cuda.to_device(bt),
            "lens": cuda.to_device(lens), "qkv": cuda.to_device(qkv), "want": want,
            "out": cuda.device_array((num_seqs, H * D), np.float32), "ws": decode_workspace(num_seqs, max_len, H, D)}


def run_variant(case: dict, **knobs) -> tuple[float, int, float, int]:
    """(seconds per call, number of splits, relative error, registers per thread) for one setting of the knobs."""
    config = DecodeAttentionConfig(**knobs)  # every knob is a field: nothing global is changed

    def call(i, stream):
        k, v = case["sets"][i % len(case["sets"])]
        decode_attention(case["qkv"], k, v, case["bt"], BLOCK, case["lens"], H, KVH, D, case["out"], stream=stream,
                         workspace=case["ws"], max_context_len=case["max_len"], config=config)

    call(0, 0)
    cuda.synchronize()
    err = float(np.abs(case["out"].copy_to_host() - case["want"]).max() / np.abs(case["want"]).max())
    seconds = time_launches(call, 2 * len(case["sets"]))
    kernel = decode_attention_kernel_for(D, H // KVH, config)
    splits = decode_splits(case["max_len"], case["n"], KVH, config, max_splits=case["ws"].shape[1])
    return seconds, splits, err, max(kernel.get_regs_per_thread().values())


def settings(grid: dict, defaults: dict) -> list[dict]:
    """The defaults, then each knob moved alone through its values (the others at their defaults)."""
    out = [dict(defaults)]
    for knob, values in grid.items():
        out += [{**defaults, knob: v} for v in values if v != defaults[knob]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", action="store_true",
                    help="every combination of rows in flight, register cap, warps, grid target and prefetch (64 sequences"
                         " unless --seqs says otherwise; minutes)")
    ap.add_argument("--seqs", type=int, nargs="+", help="sequences at once (default 64 8 1; with --grid 64)")
    ap.add_argument("--mixed", action="store_true",
                    help="contexts of 100 to 2,048 tokens (recorded to ch08_decode_mixed.json: chapter 8 plots the "
                         "full 1,024-token contexts)")
    args = ap.parse_args()
    base = DEFAULT_DECODE_CONFIG
    defaults = {"lane_elements": base.lane_elements, "keys_per_lane": base.keys_per_lane, "max_registers": base.max_registers,
                "num_warps": base.num_warps, "split_keys": base.split_keys, "target_blocks": base.target_blocks,
                "prefetch": base.prefetch}
    grid = {"lane_elements": (8, 16), "keys_per_lane": (1, 2, 3, 4), "max_registers": (None, 128), "num_warps": (1, 2, 4, 8),
            "split_keys": (256, 512, 1024), "target_blocks": (512, 1024, 2048), "prefetch": (False, True)}
    if args.grid:  # the knobs that trade registers for bytes in flight, together
        grid = {"lane_elements": (8,), "keys_per_lane": (1, 2, 3, 4), "max_registers": (None, 128), "num_warps": (2, 4),
                "split_keys": (512, 1024), "target_blocks": (512, 1024), "prefetch": (False, True)}
        assert all(defaults[k] in v for k, v in grid.items()), "the grid must hold the defaults (chapter 8's dark bar)"
    gen = np.random.default_rng(0)
    # --mixed records to a file of its own: a save replaces a device's records in its file
    rec = Recorder("ch08_decode_mixed" if args.mixed else "ch08_decode_tune")
    # chapter 1's bandwidth ceiling on this GPU (the best of its copy and read rates), if recorded
    ceiling_gbs, ceiling_name = bandwidth_ceiling(rec.device["name"])
    ceiling = {"ceiling": ceiling_gbs, "ceiling_name": ceiling_name} if ceiling_name else {}
    for n in args.seqs or ([64] if args.grid else [64, 8, 1]):
        case = make_case(gen, n, args.mixed)
        best = None
        todo = [dict(zip(grid, v)) for v in itertools.product(*grid.values())] if args.grid else settings(grid, defaults)
        for knobs in todo:
            seconds, splits, err, regs = run_variant(case, **knobs)
            gbs = case["kv_bytes"] / seconds / 1e9
            ok = err < 1e-5
            moved = [k for k in knobs if knobs[k] != defaults[k]]
            rec.add("decode_attention_mixed" if args.mixed else "decode_attention_variant",
                    [n, case["max_len"], H, KVH, D], "GB/s", gbs, us=seconds * 1e6, **ceiling,
                    **knobs, moved=moved, splits=splits, registers=regs, rel_error=err, correct=ok)
            label = "  ".join(f"{k} {v}" for k, v in knobs.items())
            print(f"{n:>3} seqs  {label}  splits {splits:>2}  regs {regs}: {seconds * 1e6:7.1f} us {gbs:6.0f} GB/s"
                  + (f" {gbs / ceiling_gbs:4.0%}" if ceiling else "") + ("" if ok else f"  WRONG (rel error {err:.1e})"))
            if ok and (best is None or seconds < best[0]):
                best = (seconds, label)
        if best:
            print(f"best at {n} seqs: {best[0] * 1e6:.1f} us with {best[1]}"
                  + (f" = {case['kv_bytes'] / best[0] / 1e9 / ceiling_gbs:.0%} of the ceiling ({ceiling_name})"
                     if ceiling else ""))
        del case
    print("saved", rec.save())


if __name__ == "__main__":
    main()
