"""Chapter 11 on the GPU: a decode step of the Llama 3.2 1B stand-in, kernel by kernel.

For each kernel of the step as the model launches it (embedding; per layer QKV, RoPE with the KV write,
attention, output projection, gate-up, SiLU, down; the final norm, LM head, sampler — the residual adds are
inside the output and down projections, a norm is inside the projection after it where rmsnorm_linear puts it
(norm_in_gemv: at one row, QKV), and elsewhere a norm kernel comes before the projection) its time, replayed from a
captured graph (tinyvllm_lib.measure.time_launches) with the 16 layers' weights and caches rotated
so that none is read from L2 when a real step would read it from memory; the bytes it must move
(counted, not measured: weights, cache and activations); its share of the step and of chapter 1's
copy bandwidth. The sum over kernels is compared with the whole decode graph replayed back to back.
Each fusion is also timed against the two kernels it replaces, on the same buffers (records "fusion").
Records to book/data/ch11_kernels.json.

    python bench/ch11_kernels.py [--rows 1 64 256] [--context 1024]     (~2 minutes on an H200)
    NUMBA_ENABLE_CUDASIM=1 python bench/ch11_kernels.py --tiny            (the code paths, in the simulator)
"""

import argparse
import tempfile

import numpy as np
from numba import config, cuda

from tinyvllm_lib.engine.cuda_graphs import ARGMAX_GRAPH_MAX_ROWS
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampler_cuda import SETTING_DTYPES
from tinyvllm_lib.kernels.activation import GEMV_GATED_KERNELS, gemv_silu_mul, silu_mul
from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.embedding import embed
from tinyvllm_lib.kernels.gemv import (
    GEMV_BUCKETS,
    can_gemv,
    gemv_rmsnorm,
    make_gemv_kernel,
)
from tinyvllm_lib.kernels.kv_cache_write import rope_and_write_kv_cache, write_kv_cache
from tinyvllm_lib.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tinyvllm_lib.kernels.rope import rope_qkv
from tinyvllm_lib.layers.linear import (
    GATED_GEMV_MAX_TOKENS,
    linear,
    linear_path,
    norm_in_gemv,
    rmsnorm_linear,
    silu_in_gemv,
)
from tinyvllm_lib.measure import Recorder, bandwidth_ceiling, device_info, time_launches
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config


def decode_kernels(runner, rows: int, context: int, rng) -> list:
    """[(name, launches per step, launch_one(i, stream), bytes per launch)] for a decode step of `rows` rows
    whose contexts are `context` tokens, its inputs filled with random values."""
    c, w, b, ws = runner.config, runner.model.weights, runner.activations, runner.cublas_workspace
    L, H, KVH, D = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hid, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    cache, bs = runner.kv_cache, runner.block_size
    blocks = context // bs
    tables = rng.permutation(cache.num_slots // bs)[: rows * blocks].reshape(rows, blocks).astype(np.int32)
    width = runner.packed.max_blocks
    full = np.zeros((rows, width), np.int32)
    full[:, :blocks] = tables
    bt = cuda.to_device(full)
    lens = cuda.to_device(np.full(rows, context, np.int32))
    slots = cuda.to_device((tables[:, -1].astype(np.int64) * bs + bs - 1))
    ids = cuda.to_device(rng.integers(0, vocab, rows).astype(np.int64))
    pos = cuda.to_device(np.full(rows, context - 1, np.int64))
    x = {name: buf[:rows] for name, buf in b.items()}
    for name in ("residual", "qkv", "gate_up"):  # finite float32 activations, not uninitialised memory
        x[name].copy_to_device(rng.standard_normal(x[name].shape).astype(np.float32))
    for name in ("normed", "attn", "act"):
        x[name].copy_to_device((rng.standard_normal(x[name].shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    logits = runner.logits[:rows]
    logits.copy_to_device(rng.standard_normal(logits.shape).astype(np.float32))
    r = {name: cuda.to_device(np.full(rows, value, SETTING_DTYPES[name]))  # greedy rows
         for name, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0),
                             ("uniform", 0.5), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                             ("presence_penalty", 0.0), ("penalty_slot", -1), ("num_logprobs", -1))}
    lin = lambda name, wname, out, add=False: (lambda i, s: linear(  # noqa: E731
        x[name], w[f"layers.{i % L}.{wname}"], x[out], stream=s, workspace=ws, accumulate=add))
    # the projections after a norm: the norm inside the GEMV (where rmsnorm_linear puts it), or a norm kernel
    # (its own entry) then the projection
    gated = silu_in_gemv(x["normed"], w["layers.0.gate_up_proj"])  # the model's choice (chapter 7)
    fused = {name: norm_in_gemv(x["normed"], w[f"layers.0.{name}"]) for name in ("qkv_proj", "gate_up_proj")}
    norm_lin = lambda norm, wname, out: (  # noqa: E731
        (lambda i, s: rmsnorm_linear(x["residual"], w[f"layers.{i % L}.{norm}"], 1e-5, w[f"layers.{i % L}.{wname}"],
                                     x[out], x["normed"], stream=s, workspace=ws))
        if fused[wname] else lin("normed", wname, out))
    qkv_w, kv_bytes = (H + 2 * KVH) * D, 2 * rows * context * KVH * D * 2
    act_bytes = lambda *widths_dtypes: rows * sum(n * d for n, d in widths_dtypes)  # noqa: E731
    # what a projection after a norm reads besides w: the residual and the norm's weight, or the normed rows
    norm_in = {name: act_bytes((hid, 4)) + 2 * hid if f else act_bytes((hid, 2)) for name, f in fused.items()}
    kernels = [
        ("embed", 1, lambda i, s: embed(ids, w["embed_tokens"], x["residual"], stream=s), act_bytes((hid, 2), (hid, 4))),
        ("rmsnorm", 1 + L * sum(not f for f in fused.values()),  # the final norm, and those not in a GEMV
         lambda i, s: rmsnorm(x["residual"], w[f"layers.{i % L}.input_layernorm"], 1e-5, x["normed"], stream=s),
         act_bytes((hid, 4), (hid, 2)) + 2 * hid),
        ("qkv_proj", L, norm_lin("input_layernorm", "qkv_proj", "qkv"), qkv_w * hid * 2 + norm_in["qkv_proj"] + act_bytes((qkv_w, 4))),
        ("rope_kv_write", L, lambda i, s: rope_and_write_kv_cache(  # the attention layer's, as the model calls it
            x["qkv"], pos, runner.model.rope, H, KVH, slots, cache.k[i % L], cache.v[i % L], stream=s),
         2 * act_bytes(((H + KVH) * D, 4)) + act_bytes((KVH * D, 4), (2 * KVH * D, 2))),
        ("attention", L, lambda i, s: decode_attention(
            x["qkv"], cache.k_words[i % L], cache.v_words[i % L], bt, bs, lens, H, KVH, D, x["attn"], stream=s,
            workspace=runner.workspace, max_context_len=runner.max_model_len), kv_bytes + act_bytes((H * D, 4), (H * D, 2))),
        # the residual add in the projection: out read and written
        ("o_proj", L, lin("attn", "o_proj", "residual", add=True), H * D * hid * 2 + act_bytes((H * D, 2), (hid, 8))),
        # where silu_in_gemv (one row of the 1B) the model's gate-up is the gated GEMV, SiLU·up inside, after its
        # norm; silu_mul is then not launched (timed all the same, 0 a step)
        ("gate_up_proj", L, (lambda i, s: gemv_silu_mul(x["normed"], w[f"layers.{i % L}.gate_up_proj"], x["act"],
                                                         stream=s)) if gated
         else norm_lin("post_attention_layernorm", "gate_up_proj", "gate_up"),
         2 * inter * hid * 2 + (act_bytes((hid, 2), (inter, 2)) if gated
                                else norm_in["gate_up_proj"] + act_bytes((2 * inter, 4)))),
        ("silu_mul", 0 if gated else L, lambda i, s: silu_mul(x["gate_up"], x["act"], stream=s),
         act_bytes((2 * inter, 4), (inter, 2))),
        ("down_proj", L, lin("act", "down_proj", "residual", add=True), inter * hid * 2 + act_bytes((inter, 2), (hid, 8))),
        ("lm_head", 1, lambda i, s: linear(x["normed"], w["lm_head"], logits, stream=s, workspace=ws),
         vocab * hid * 2 + act_bytes((hid, 2), (vocab, 4))),
        # greedy rows: up to ARGMAX_GRAPH_MAX_ROWS a step replays the argmax_only graph (the argmax alone), past it
        # the graph of every sampling, penalty and log-prob kernel
        ("sample", 1, (lambda i, s: runner.sampler.launch(logits, s, rows=r, steps=[0], penalize=False,
                                                          logprobs=False)) if rows <= ARGMAX_GRAPH_MAX_ROWS
         else (lambda i, s: runner.sampler.launch(logits, s, rows=r)), act_bytes((vocab, 4))),
    ]
    return kernels


def fusions(runner, rows: int, context: int, rng) -> list:
    """[(fusion, separate(i, stream), fused(i, stream))]: fused kernels against the kernels they replace, on the
    same buffers (filled by decode_kernels): RoPE with the KV write (the model's); at one row the gated GEMV
    (chapter 7's, the model's at one token), the residual add inside the output and down projections (the
    model's: they write what chapter 4's add + norm kernel added, leaving a plain norm), and the norm inside QKV's
    and gate-up's GEMVs (the model's for QKV; for gate-up, which runs a warp a row, also with blocks sharing each
    row)."""
    c, w, b, ws = runner.config, runner.model.weights, runner.activations, runner.cublas_workspace
    L, H, KVH = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    cache, x = runner.kv_cache, {name: buf[:rows] for name, buf in b.items()}
    pos = cuda.to_device(np.full(rows, context - 1, np.int64))
    slots = cuda.to_device(rng.permutation(cache.num_slots)[:rows].astype(np.int64))
    out = [("rope_kv_write",
            lambda i, s: (rope_qkv(x["qkv"], pos, runner.model.rope, H, KVH, stream=s),
                          write_kv_cache(x["qkv"], H, KVH, slots, cache.k[i % L], cache.v[i % L], stream=s)),
            lambda i, s: rope_and_write_kv_cache(x["qkv"], pos, runner.model.rope, H, KVH, slots, cache.k[i % L],
                                                 cache.v[i % L], stream=s))]
    if linear_path(x["normed"], w["layers.0.gate_up_proj"]) == "gemv":
        out.append(("gate_up_silu",
                    lambda i, s: (linear(x["normed"], w[f"layers.{i % L}.gate_up_proj"], x["gate_up"], stream=s, workspace=ws),
                                  silu_mul(x["gate_up"], x["act"], stream=s)),
                    lambda i, s: gemv_silu_mul(x["normed"], w[f"layers.{i % L}.gate_up_proj"], x["act"], stream=s)))
        # the residual add in the projection (the model's), against the projection writing its own output and
        # chapter 4's add + norm kernel; then the norm: its own kernel, or inside the next projection's GEMV
        delta = cuda.to_device(rng.standard_normal((rows, c.hidden_size)).astype(np.float32))
        for name, (first, x_in, norm) in {
            "add_in_o_proj": ("o_proj", "attn", "post_attention_layernorm"),
            "add_in_down_proj": ("down_proj", "act", "input_layernorm"),
        }.items():
            def separate(i, s, first=first, x_in=x_in, norm=norm):
                p = f"layers.{i % L}."
                linear(x[x_in], w[p + first], delta, stream=s, workspace=ws)
                fused_add_rmsnorm(x["residual"], delta, w[p + norm], 1e-5, x["normed"], stream=s)

            def fused(i, s, first=first, x_in=x_in, norm=norm):
                p = f"layers.{i % L}."
                linear(x[x_in], w[p + first], x["residual"], stream=s, workspace=ws, accumulate=True)
                rmsnorm(x["residual"], w[p + norm], 1e-5, x["normed"], stream=s)

            out.append((name, separate, fused))
        for name, (norm, second, out_name, variant) in {
            "norm_in_qkv_proj": ("input_layernorm", "qkv_proj", "qkv", "auto"),
            "norm_in_gate_up_proj": ("post_attention_layernorm", "gate_up_proj", "gate_up", "auto"),
            "norm_in_gate_up_proj_block": ("post_attention_layernorm", "gate_up_proj", "gate_up", "block"),
        }.items():
            def separate(i, s, norm=norm, second=second, out_name=out_name):
                p = f"layers.{i % L}."
                rmsnorm(x["residual"], w[p + norm], 1e-5, x["normed"], stream=s)
                linear(x["normed"], w[p + second], x[out_name], stream=s, workspace=ws)

            def fused(i, s, norm=norm, second=second, out_name=out_name, variant=variant):
                p = f"layers.{i % L}."
                gemv_rmsnorm(x["residual"], w[p + norm], 1e-5, w[p + second], x[out_name], stream=s,
                             variant=variant)

            out.append((name, separate, fused))
    return out


def gated_sweep(runner, rows: int, rec: Recorder) -> None:
    """The gated GEMV's one knob, the steps of its (gate, up) pair of rows each warp keeps in flight, at `rows`
    tokens: each setting against gate-up's GEMV + silu_mul, on the buffers decode_kernels filled (records
    "gated_sweep"; chapter 7 keeps the fastest at one token)."""
    w, L = runner.model.weights, runner.config.num_hidden_layers
    x = {name: buf[:rows] for name, buf in runner.activations.items()}
    repeats = 1 if config.ENABLE_CUDASIM else 10

    def separate(i, s):
        linear(x["normed"], w[f"layers.{i % L}.gate_up_proj"], x["gate_up"], stream=s,
               workspace=runner.cublas_workspace)
        silu_mul(x["gate_up"], x["act"], stream=s)

    t_sep = time_launches(separate, 16, repeats=repeats) * 1e6
    bucket = next(b for b in GEMV_BUCKETS if b >= rows)
    model_kernel = GEMV_GATED_KERNELS[bucket]

    def gated(i, s):  # chapter 7's launcher, with this setting's kernel in its table
        gemv_silu_mul(x["normed"], w[f"layers.{i % L}.gate_up_proj"], x["act"], stream=s)

    for unroll in (1, 2, 4, 8):
        GEMV_GATED_KERNELS[bucket] = make_gemv_kernel(bucket, 1, 2, unroll, gated=True)
        try:
            us = time_launches(gated, 16, repeats=repeats) * 1e6
        finally:
            GEMV_GATED_KERNELS[bucket] = model_kernel
        rec.add("gated_sweep", [rows, runner.config.intermediate_size], "us", us, unroll=unroll, separate_us=t_sep,
                is_model=rows <= GATED_GEMV_MAX_TOKENS and unroll == model_kernel.unroll)
        print(f"{rows:>3} rows  gated GEMV, {unroll} step(s) in flight: {us:.2f} us (gate-up + silu_mul "
              f"{t_sep:.2f} us)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama, for the simulator")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tmp = tempfile.TemporaryDirectory()
    tiny = tiny_llama_config(max_position_embeddings=4 * args.context)
    folder = make_random_llama(tmp.name, tiny) if args.tiny else prepare_llama_standin()
    rows_max = max(args.rows)
    llm = LLM(folder, device="cuda", max_model_len=2 * args.context, max_num_seqs=rows_max, enforce_eager=True,
              num_kv_blocks=(2 * args.context // 16) * rows_max * 2)
    runner = llm.llm_engine.model_runner
    ceiling, ceiling_name = bandwidth_ceiling(device_info()["name"])  # chapter 1's best rate on this GPU
    rec = Recorder("ch11_kernels")
    for rows in args.rows:
        total, table = 0.0, []
        for name, per_step, launch, nbytes in decode_kernels(runner, rows, args.context, rng):
            repeats = 1 if config.ENABLE_CUDASIM else 10
            seconds = time_launches(launch, max(per_step, 16 if per_step > 1 else 1), repeats=repeats)
            us, gb_s = seconds * 1e6, nbytes / seconds / 1e9
            total += us * per_step
            table.append((name, per_step, us, nbytes, gb_s))
        for name, per_step, us, nbytes, gb_s in table:
            rec.add("decode_kernel", [rows, args.context], "us", us, kernel=name, per_step=per_step, bytes=nbytes,
                    gb_s=gb_s, ceiling_gb_s=ceiling, ceiling_name=ceiling_name, share_of_step=us * per_step / total,
                    ratio=gb_s / ceiling)
            print(f"{rows:>3} rows  {name:>13} x{per_step:<3} {us:8.2f} us  {us * per_step / total:6.1%} of the step  "
                  f"{gb_s:7.0f} GB/s ({gb_s / ceiling:5.1%} of the ceiling)", flush=True)
        rec.add("decode_kernels_sum", [rows, args.context], "us", total, ceiling_gb_s=ceiling)
        print(f"{rows:>3} rows: {total:.0f} us per step, summed over kernels", flush=True)
        for name, separate, fused in fusions(runner, rows, args.context, rng):
            repeats = 1 if config.ENABLE_CUDASIM else 10
            t_sep, t_fused = (time_launches(f, 16, repeats=repeats) * 1e6 for f in (separate, fused))
            saved = (t_sep - t_fused) * runner.config.num_hidden_layers  # one launch a layer
            extra = {"unroll": GEMV_GATED_KERNELS[1].unroll} if name == "gate_up_silu" else {}
            rec.add("fusion", [rows, args.context], "us", t_fused, kernel=name, separate_us=t_sep,
                    saved_per_step_us=saved, **extra)
            print(f"{rows:>3} rows  fusion {name}: {t_sep:.2f} us separate, {t_fused:.2f} us fused "
                  f"({saved:.0f} us a step)", flush=True)
    # the gated GEMV's knob at 1, 2 and 4 tokens against what the model runs there (the GEMV, or cuBLAS, then
    # silu_mul), on the buffers the rows above filled
    for rows in (1, 2, 4):
        if rows <= rows_max and can_gemv(runner.activations["normed"][:rows],
                                         runner.model.weights["layers.0.gate_up_proj"]):
            gated_sweep(runner, rows, rec)
    if not config.ENABLE_CUDASIM:
        print("saved", rec.save())


if __name__ == "__main__":
    main()
