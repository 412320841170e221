"""Chapter 8b (and 11's log-probs) on the GPU: the sampling kernels alone, before and after the radix select.

At 1 and 256 rows of 128,256 logits (Llama 3's vocabulary), for greedy, temperature 0.8, top-k 50, top-p 0.9,
min-p 0.05 and Llama's defaults (T 0.6, top-p 0.9): the radix-select sampler (kernels.sampling_radix, all seven
launches, as a captured decode graph runs them) and the bisection kernel it replaced (one block a sampled row;
it has no min-p); and log-probs 5 and 20 of the sampled ids, spread over shares and one block a row (k + 2 passes).
Each is replayed from a CUDA graph (tinyvllm_lib.measure.time_launches: median of repeats) over logits buffers
rotated past the 60 MB L2, and compared with the time its row bytes take at chapter 1's bandwidth ceiling
(rows x vocab x 4 bytes). The logits are peaked like a model's: standard normal times 2, plus 32 tokens a row
between 6 and 14 (top-p 0.9 keeps a few dozen tokens). Greedy tokens are checked against np.argmax first.
Records to book/data/ch08b_sampler.json.

    python bench/ch08b_sampler.py                                     (~1 minute on an H200, compiling included)
    NUMBA_ENABLE_CUDASIM=1 python bench/ch08b_sampler.py --tiny         (the code paths, in the simulator)
"""

import argparse

import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.logprobs import (
    gpu_logprobs,
    logprobs_workspace,
    one_block_logprobs_kernel,
)
from tinyvllm_lib.kernels.sampling import (
    MAX_SHARES,
    SAMPLER_THREADS,
    bisection_sample_kernel,
    greedy_shares,
)
from tinyvllm_lib.kernels.sampling_radix import sample, sampler_workspace
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    num_rotations,
    time_launches,
)

SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature_0.8": (0.8, 0, 1.0, 0.0),
    "top_k_50": (1.0, 50, 1.0, 0.0),
    "top_p_0.9": (1.0, 0, 0.9, 0.0),
    "min_p_0.05": (1.0, 0, 1.0, 0.05),
    "llama_defaults": (0.6, 0, 0.9, 0.0),
}


def peaked_logits(rng, rows: int, vocab: int) -> np.ndarray:
    z = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    top = rng.integers(0, vocab, (rows, 32))
    z[np.arange(rows)[:, None], top] = rng.uniform(6, 14, (rows, 32))
    return z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="small shapes, one launch each: for the simulator")
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.vocab, args.repeats = [1, 3], 300, 1
    rng = np.random.default_rng(0)
    rec = Recorder("ch08b_sampler")
    # chapter 1's bandwidth ceiling on this GPU (the best of its copy and read rates)
    ceiling_gb_s, ceiling_name = bandwidth_ceiling(rec.device["name"])
    if not ceiling_name:
        ceiling_gb_s, ceiling_name = 4000.0, "guessed: no ceiling recorded for this device"
    for rows in args.rows:
        nbytes = rows * args.vocab * 4
        bytes_us = nbytes / ceiling_gb_s / 1e3
        n_buf = 1 if args.tiny else num_rotations(nbytes)
        # distinct buffers past L2 (copies of a few random ones)
        bufs = [cuda.to_device(peaked_logits(rng, rows, args.vocab)) for _ in range(min(n_buf, 4))]
        for i in range(len(bufs), n_buf):
            bufs.append(cuda.device_array_like(bufs[0]))
            bufs[i].copy_to_device(bufs[i % 4])
        ws, out = sampler_workspace(rows), cuda.device_array(rows, np.int64)
        part_v = cuda.device_array((rows, MAX_SHARES), np.float32)
        part_i = cuda.device_array((rows, MAX_SHARES), np.int64)
        tickets = cuda.to_device(np.zeros(rows, np.int32))
        uniform = cuda.to_device(rng.random(rows))
        sample(bufs[0], *(cuda.to_device(np.zeros(rows, d)) for d in (np.float32, np.int64)),
               cuda.to_device(np.ones(rows, np.float32)), cuda.to_device(np.zeros(rows, np.float32)), uniform, ws, out)
        assert (out.copy_to_host() == bufs[0].copy_to_host().argmax(1)).all(), "greedy is not the argmax"

        def timed(launch, cap: int) -> float:
            num = min(n_buf, cap)
            return time_launches(lambda i, s: launch(bufs[i % n_buf], s), num, repeats=args.repeats) * 1e6

        for name, (t, k, p, mp) in SETTINGS.items():
            row = [cuda.to_device(np.full(rows, v, d)) for v, d in ((t, np.float32), (k, np.int64), (p, np.float32),
                                                                    (mp, np.float32))]
            new = timed(lambda z, s: sample(z, *row, uniform, ws, out, s), 256)
            old = None
            if mp == 0:  # the bisection kernel has no min-p
                old = timed(lambda z, s: bisection_sample_kernel[(rows, greedy_shares(rows)), SAMPLER_THREADS, s](
                    z, row[0], row[1], row[2], uniform, part_v, part_i, tickets, out), 8)
            for kernel, us in (("radix", new), ("bisection", old)):
                if us is not None:
                    rec.add("sample", [rows, args.vocab], "us", us, setting=name, kernel=kernel, bytes=nbytes,
                            bytes_us=bytes_us, ceiling_gb_s=ceiling_gb_s, ceiling_name=ceiling_name, times_bytes=us / bytes_us)
            print(f"{rows:>3} rows  {name:>16}: radix {new:9.1f} us   bisection "
                  f"{'-' if old is None else f'{old:9.1f} us'}   bytes at the ceiling {bytes_us:7.1f} us", flush=True)
        ids = cuda.to_device(rng.integers(0, args.vocab, rows))
        chosen = cuda.device_array(rows, np.float32)
        top_i, top_v = cuda.device_array((rows, 20), np.int64), cuda.device_array((rows, 20), np.float32)
        lws = logprobs_workspace(rows)
        for k in (5, 20):
            ks = cuda.to_device(np.full(rows, k, np.int64))  # each row's k, as a captured step reads it
            new = timed(lambda z, s: gpu_logprobs(z, ids, ks, chosen, top_i, top_v, lws, s), 256)
            old = timed(lambda z, s: one_block_logprobs_kernel[rows, SAMPLER_THREADS, s](z, ids, k, chosen, top_i,
                                                                                          top_v), 8)
            for kernel, us in (("shares", new), ("one_block", old)):
                rec.add("logprobs", [rows, args.vocab], "us", us, setting=f"logprobs_{k}", kernel=kernel,
                        bytes=nbytes, bytes_us=bytes_us, ceiling_gb_s=ceiling_gb_s, ceiling_name=ceiling_name, times_bytes=us / bytes_us)
            print(f"{rows:>3} rows  {f'logprobs {k}':>16}: shares {new:8.1f} us   one block {old:9.1f} us   "
                  f"bytes at the ceiling {bytes_us:7.1f} us", flush=True)
    if not config.ENABLE_CUDASIM:
        print("saved", rec.save())


if __name__ == "__main__":
    main()
