"""Chapter 15 on the GPU: 8-bit weights (int8, FP8 e4m3) against bf16 on the Llama 3.2 1B stand-in, one run.

    python bench/ch15_quantization.py [--only engine|throughput|gemv|sweep|drift|gemm] [--wheel TOKENIZER_WHEEL]
        # on an H200: gemv about 70 s, engine (batch 1, three formats) about 80 s; on an H100 the sweep about 130 s;
        # throughput and drift longer
    NUMBA_ENABLE_CUDASIM=1 python bench/ch15_quantization.py --tiny [--formats int8 fp8]
        # the GEMV part and the engine's latency on a tiny random Llama in the CUDA simulator (its prompt of 10
        # tokens takes the dequantized GEMM path), nothing recorded: a smoke test of the script's code paths

engine: for bf16, int8 and fp8 in turn, with CUDA graphs and the overlap (chapter 11's defaults): decode at batch 1 (128
random prompt ids, 256 new tokens, greedy; the median of three runs after a warm-up, chapter 11's benchmark.latency),
each against its batch-1 limit (chapter 1's bandwidth ceiling over the bytes a step reads,
llama_quantized.decode_weight_bytes), with its time to first token (a 128-token prefill: the 8-bit model's GEMM path,
int8's on dequantized bf16 scratch, FP8's on FP8 tensor cores where the GPU has them; each record says which).
throughput: for each format, nano-vllm's throughput workload (256 requests, the median of three runs).
--lm-head 8bit (or both): engine and throughput with the 8-bit formats' LM head in 8 bits too (quantize_lm_head),
records marked lm_head_8bit.
gemm: past the GEMV's tokens (16 to 4,096), each layer's product as the engine makes it — bf16 cuBLAS, int8's
dequantized scratch, FP8's quantizer + cuBLASLt, and cuBLASLt alone — replayed from a CUDA graph, weights rotated;
QKV and gate-up with the norm that feeds them (FP8 fuses its quantizer into it), records marked with_norm.
crossover: 1 to 16 tokens, each layer's product as the layer loop makes it on each 8-bit format's two paths (the GEMV and
the dequantized scratch) and bf16's: where QUANTIZED_GEMV_MAX_TOKENS belongs.
small_batch: decode at 4 to 16 concurrent requests, bf16 and int8 with the GEMV up to 4 tokens, and up to 8 and 16 with a
warp a row.
gemv: every projection shape of the 1B model (and the LM head), one token, each format's GEMV alone and its fused
RMSNorm variant (gate-up's also with SiLU·up inside, the engine's MLP kernel), replayed from a CUDA graph over enough weights that none stays in L2: GB/s counted in the bytes it
reads (codes, scales, the input row) against the ceiling; each checked against NumPy first.
sweep: one token (or each bucket of --sweep-tokens), the 8-bit GEMV's knobs (the block's 8 warps sharing 2, 4 or 8
rows, or a warp 1, 2 or 4 rows, and the words each thread loads ahead; past one token only those whose sums fit
GEMV_MAX_ACC) on each shape with the epilogue the engine launches there, with as many blocks as the launcher gives (no
more than the GPU holds of that kernel, which is recorded with its registers), timed as the gemv part times them; the
knobs the launcher picks are marked `chosen`.
drift: one random 64-token prompt teacher-forced: bf16 kernels against float32 NumPy, each 8-bit kernel model against
the bf16 kernels and against its own NumPy reference (mean |Δ log p| over the reference's top 5 tokens).
Records (tagged with the 8-bit GEMV's version, kernels.gemv_8bit.GEMV_8BIT_VERSION) replace this device's records of
the same part, version and formats (LM head included) in book/data/ch15_quantization.json; an earlier version's stay,
drawn beside them.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.gemv import (
    GEMV_BUCKETS,
    GEMV_MAX_ACC,
    GEMV_WARPS,
    gemv,
    gemv_variant,
)
from tinyvllm_lib.kernels.gemv_8bit import (
    GEMV_8BIT_KERNELS,
    GEMV_8BIT_VERSION,
    gemv_8bit,
    gemv_8bit_config,
    gemv_8bit_rmsnorm,
    make_gemv_8bit_kernel,
    pick_gemv_8bit_kernel,
)
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.measure import (
    DATA_DIR,
    Recorder,
    bandwidth_ceiling,
    device_info,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_quantized import decode_weight_bytes, quantized_shapes
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.quantization.formats import quantize

PARTS = ("engine", "throughput", "gemv", "sweep", "drift", "gemm", "crossover", "small_batch", "mma_sweep")
FORMATS = (None, "int8", "fp8")
MAX_MODEL_LEN, MAX_NUM_SEQS = 2048, 256


def engine_part(rec: Recorder, folder, extra: dict, tiny: bool, formats=FORMATS, throughput: bool = True,
                latency: bool = True, heads=(False,)) -> None:
    """Batch 1 and nano-vllm's workload for each format; each 8-bit format once for each of heads (quantize_lm_head:
    False, the LM head in bf16; True, in the format's 8 bits)."""
    config = ModelConfig.from_folder(folder)
    gb_s, ceiling_name = bandwidth_ceiling(device_info()["name"])  # this GPU's (none recorded: nan)
    for method, head in [(m, h) for m in formats for h in ((False,) if m is None else heads)]:
        nbytes = decode_weight_bytes(config, method, lm_head=head)
        limit = gb_s * 1e9 / nbytes
        common = extra | {"quantization": method, "lm_head_8bit": head, "weight_bytes": nbytes, "ceiling_gb_s": gb_s,
                          "ceiling_name": ceiling_name, "part": "engine", "gemm_path": gemm_path_of(method)}
        max_model_len = 256 if tiny else MAX_MODEL_LEN
        kwargs = {"quantization": method, "quantize_lm_head": head}
        if latency:
            latency_run(rec, folder, kwargs, max_model_len, limit, common, tiny)
        if tiny or not throughput:  # the simulator: the latency's steps have run every path once
            continue
        llm = LLM(folder, device="cuda", max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS, **kwargs)
        t = benchmark.throughput(llm, repeats=3)
        print(f"{label_of(method, head)} throughput: {t['output_tok_s']:.0f} output tok/s", flush=True)
        rec.add("throughput", [256], "tok/s", t["output_tok_s"], **t, **(common | {"part": "throughput"}))
        save_part(rec, "throughput", tiny)
        del llm


def gemm_path_of(method) -> str:
    """What the format's matrices take past the GEMV's tokens (chapter 15's QuantizedLinear.gemm_path)."""
    if method is None:
        return "bf16 cuBLAS"
    from tinyvllm_lib.kernels.cublaslt_fp8 import get_cublaslt_fp8
    from tinyvllm_lib.layers import quantized_linear

    if method == "fp8" and quantized_linear.FP8_TENSOR_CORE_GEMM and get_cublaslt_fp8() is not None:
        return "fp8 tensor cores (W8A8)"
    return "dequantized scratch + bf16 cuBLAS"


def label_of(method, head: bool) -> str:
    return (method or "bf16") + (", head 8-bit" if head else "")


def latency_run(rec: Recorder, folder, kwargs: dict, max_model_len: int, limit: float, common: dict,
                tiny: bool) -> None:
    """Batch-1 decode (the median of three runs after a warm-up) and its time to first token; kwargs: the LLM's
    quantization and quantize_lm_head."""
    t0 = time.perf_counter()
    llm = LLM(folder, device="cuda", max_model_len=max_model_len, max_num_seqs=1, **kwargs)
    start_s = time.perf_counter() - t0
    prompt_len, new_tokens = (10, 2) if tiny else (128, 256)  # tiny: past the 8-bit GEMV's 8
    lat = benchmark.latency(llm, prompt_len, new_tokens, repeats=1 if tiny else 3)
    label = label_of(kwargs["quantization"], kwargs["quantize_lm_head"])
    print(f"{label} bs1: {lat['decode_tok_s']:.0f} decode tok/s (limit {limit:.0f}), TTFT "
          f"{lat['ttft_ms']:.1f} ms, engine start {start_s:.1f} s", flush=True)
    rec.add("bs1_decode", [1, prompt_len, new_tokens], "tok/s", lat["decode_tok_s"], limit, start_s=start_s,
            **lat, **common)
    rec.add("bs1_ttft", [1, prompt_len], "ms", lat["ttft_ms"], **common)
    save_part(rec, "engine", tiny)
    del llm


def check(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-4, against: str = "NumPy") -> None:
    error = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert error <= tol, f"{what}: max relative error {error:.2e} against {against}"


def gemv_part(rec: Recorder, config: ModelConfig, extra: dict, tiny: bool) -> None:
    """Each format's GEMV on every decode shape, one token, weights rotated past L2; bytes read / time."""
    gb_s, ceiling_name = bandwidth_ceiling(device_info()["name"])  # this GPU's (none recorded: nan)
    rng = np.random.default_rng(0)
    shapes = quantized_shapes(config, lm_head=True)

    def rotations(nbytes: int) -> int:  # --tiny: a few (its weights all sit in any cache)
        return 2 if tiny else num_rotations(nbytes)

    def timed(launch_one, num_launches: int) -> float:
        return time_launches(launch_one, num_launches, repeats=1 if tiny else 10)

    for name, (N, K) in shapes.items():
        w = rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02)
        x_bits = f32_to_bf16_bits(rng.standard_normal((1, K), dtype=np.float32))
        residual = rng.standard_normal((1, K), dtype=np.float32)
        norm = f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32))
        x, d_residual, d_norm = cuda.to_device(x_bits), cuda.to_device(residual), cuda.to_device(norm)
        out = cuda.device_array((1, N), np.float32)
        for method in FORMATS:
            if method is None:
                bits = f32_to_bf16_bits(w)
                weights = [cuda.to_device(bits) for _ in range(rotations(bits.nbytes))]
                gemv(x, weights[0], out)
                check(out.copy_to_host(), bf16_bits_to_f32(x_bits) @ bf16_bits_to_f32(bits).T, f"bf16 {name}")
                seconds = timed(lambda i, s: gemv(x, weights[i % len(weights)], out, stream=s), len(weights))
                nbytes = bits.nbytes + x_bits.nbytes
                rec.add("gemv", [1, N, K], "GB/s", nbytes / seconds / 1e9, gb_s, layer=name, quantization=None,
                        us=seconds * 1e6, bytes=nbytes, ceiling_name=ceiling_name, part="gemv", **extra)
                continue
            q = quantize(w, method)
            weights = [(cuda.to_device(q.codes), cuda.to_device(q.scales)) for _ in range(rotations(q.nbytes))]
            codes, scales = weights[0]
            gemv_8bit(x, codes, scales, out, method)
            check(out.copy_to_host(), bf16_bits_to_f32(x_bits) @ q.dequantize().T, f"{method} {name}")
            gemv_8bit_rmsnorm(d_residual, d_norm, 1e-5, codes, scales, out, method)
            check(out.copy_to_host(), rmsnorm_ref(residual, norm, 1e-5) @ q.dequantize().T, f"{method} {name} norm")
            plain = timed(lambda i, s: gemv_8bit(x, *weights[i % len(weights)], out, method, stream=s),
                                  len(weights))
            normed = timed(lambda i, s: gemv_8bit_rmsnorm(d_residual, d_norm, 1e-5, *weights[i % len(weights)],
                                                                  out, method, stream=s), len(weights))
            timings = [("gemv", plain, q.nbytes + x_bits.nbytes),
                       ("gemv_rmsnorm", normed, q.nbytes + residual.nbytes + norm.nbytes)]
            if name == "gate_up_proj":  # the engine's MLP kernel: the norm and SiLU·up inside (bf16 out)
                act = cuda.device_array((1, N // 2), np.uint16)
                gemv_8bit_rmsnorm(d_residual, d_norm, 1e-5, codes, scales, act, method, gated=True)
                gate_up = rmsnorm_ref(residual, norm, 1e-5) @ q.dequantize().T
                check(bf16_bits_to_f32(act.copy_to_host()), silu_mul_ref(gate_up), f"{method} {name} gated", 2.0**-8)
                gated = timed(lambda i, s: gemv_8bit_rmsnorm(d_residual, d_norm, 1e-5, *weights[i % len(weights)],
                                                             act, method, stream=s, gated=True), len(weights))
                timings.append(("gemv_rmsnorm_gated", gated, q.nbytes + residual.nbytes + norm.nbytes))
            for kind, seconds, nbytes in timings:
                rec.add(kind, [1, N, K], "GB/s", nbytes / seconds / 1e9, gb_s, layer=name, quantization=method,
                        us=seconds * 1e6, bytes=nbytes, ceiling_name=ceiling_name, part="gemv", **extra)
            print(f"{name} ({N}x{K}) {method}: {plain * 1e6:.1f} us, {(q.nbytes + x_bits.nbytes) / plain / 1e9:.0f} "
                  f"GB/s; with the norm {normed * 1e6:.1f} us", flush=True)
        save_part(rec, "gemv", tiny)


GEMM_TOKENS = (16, 64, 256, 1024, 4096)


def gemm_part(rec: Recorder, config: ModelConfig, extra: dict, tiny: bool) -> None:
    """Past the GEMV's tokens: each layer's product as the engine makes it (QuantizedLinear.apply), bf16 cuBLAS against
    int8's dequantized scratch and FP8's path (the tensor cores where the GPU has them: the tokens' quantizer, then
    cuBLASLt), and FP8's cuBLASLt call alone on codes quantized beforehand; each checked against NumPy first, timed
    in a replayed CUDA graph, weights rotated past L2."""
    from tinyvllm_lib.kernels.cublaslt_fp8 import gemm_fp8
    from tinyvllm_lib.kernels.rmsnorm import rmsnorm
    from tinyvllm_lib.layers.linear import linear, rmsnorm_linear
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    rng = np.random.default_rng(0)
    tokens = (16,) if tiny else GEMM_TOKENS
    workspace = cuda.device_array(32 << 20, np.uint8)
    shapes = quantized_shapes(config, lm_head=False)
    scratch = cuda.device_array(max(n * k for n, k in shapes.values()), np.uint16)  # as large as the model's
    for name, (N, K) in shapes.items():
        w = rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02)
        bits = f32_to_bf16_bits(w)
        n_rot = 2 if tiny else num_rotations(N * K)
        layers = {None: [cuda.to_device(bits) for _ in range(n_rot)]}
        quantized = {m: quantize(w, m) for m in ("int8", "fp8")}
        for m, q in quantized.items():
            layers[m] = [QuantizedLinear(q, scratch) for _ in range(n_rot)]
        normed_input = name in NORMED_INPUT  # the engine norms this product's input first: time the norm with it
        norm_weight = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32)))
        for M in tokens:
            x_f32 = rng.standard_normal((M, K), dtype=np.float32)
            residual = cuda.to_device(x_f32)
            normed = cuda.device_array((M, K), np.uint16)
            if normed_input:  # the product's input: the norm's bf16 rows
                rmsnorm(residual, norm_weight, EPS, normed)
                x_bits = normed.copy_to_host()
            else:
                x_bits = f32_to_bf16_bits(x_f32)
            x = cuda.to_device(x_bits)
            out = cuda.device_array((M, N), np.float32)
            flops = 2.0 * M * N * K

            def product(w, st=0):
                if normed_input:  # as the layer loop: rmsnorm_linear (FP8: norm and quantizer one kernel)
                    return rmsnorm_linear(residual, norm_weight, EPS, w, out, normed, stream=st, workspace=workspace)
                return linear(x, w, out, stream=st, workspace=workspace)

            for m, ws in layers.items():
                path = "bf16 cuBLAS" if m is None else ws[0].gemm_path(x)
                product(ws[0])
                rows = x_bits[:64]  # checked on the first 64 token vectors (NumPy's time)
                if path == "fp8":  # W8A8: against the product of what both codes stand for
                    want = quantize(bf16_bits_to_f32(rows), "fp8").dequantize() @ quantized[m].dequantize().T
                else:
                    wq = bits if m is None else f32_to_bf16_bits(quantized[m].dequantize())  # the scratch's bf16
                    want = bf16_bits_to_f32(rows) @ bf16_bits_to_f32(wq).T
                check(out.copy_to_host()[:64], want, f"{m or 'bf16'} {name} M={M}", 1e-3)
                seconds = time_launches(lambda i, st: product(ws[i % len(ws)], st), len(ws), repeats=1 if tiny else 10)
                rec.add("gemm", [M, N, K], "TFLOP/s", flops / seconds / 1e12, layer=name, quantization=m, path=path,
                        us=seconds * 1e6, part="gemm", with_norm=normed_input, **extra)
                print(f"{name} M={M} {m or 'bf16'} ({path}): {seconds * 1e6:.1f} us, {flops / seconds / 1e12:.0f} "
                      "TFLOP/s", flush=True)
            if layers["fp8"][0].gemm_path(x) == "fp8":  # the cuBLASLt call alone, the codes made beforehand
                xq = quantize(bf16_bits_to_f32(x_bits), "fp8")
                xc, xs = cuda.to_device(xq.codes), cuda.to_device(xq.scales)
                ws = layers["fp8"]
                gemm_fp8(xc, xs, ws[0].codes, ws[0].scales, out, 0, workspace)  # its plan, before the capture
                seconds = time_launches(lambda i, st: gemm_fp8(xc, xs, ws[i % len(ws)].codes, ws[i % len(ws)].scales,
                                                               out, st, workspace), len(ws), repeats=10)
                rec.add("gemm", [M, N, K], "TFLOP/s", flops / seconds / 1e12, layer=name, quantization="fp8",
                        path="fp8 cuBLASLt alone", us=seconds * 1e6, part="gemm", with_norm=False, **extra)
                print(f"{name} M={M} fp8 cuBLASLt alone: {seconds * 1e6:.1f} us", flush=True)
        save_part(rec, "gemm", tiny)


CROSSOVER_TOKENS = (1, 2, 4, 8, 12, 16)


def crossover_part(rec: Recorder, config: ModelConfig, extra: dict, tiny: bool, formats=("int8", "fp8")) -> None:
    """Up to the 8-bit GEMV's 16 token vectors: each layer's step as the layer loop makes it (QKV with its norm, O and
    down adding into the residual, gate-up with its norm and SiLU·up) on each 8-bit format's two paths, the GEMV and
    the dequantized scratch (QuantizedLinear.gemv_max_tokens set to 16, then 0), the GEMV past one token in the
    launcher's variant ("auto") and with a warp a row ("warp", gemv_variant), beside bf16's own (chapter 6's GEMV
    or cuBLAS); replayed from a CUDA graph, weights rotated past L2. Where the GEMV stops winning is where
    QUANTIZED_GEMV_MAX_TOKENS belongs."""
    from tinyvllm_lib.layers.linear import (
        linear,
        rmsnorm_linear,
        rmsnorm_linear_silu_mul,
    )
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    rng = np.random.default_rng(1)
    tokens = (3,) if tiny else CROSSOVER_TOKENS
    shapes = quantized_shapes(config, lm_head=False)
    scratch = cuda.device_array(max(n * k for n, k in shapes.values()), np.uint16)
    for name, (N, K) in shapes.items():
        w = rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02)
        n_rot = 2 if tiny else num_rotations(N * K)
        weights = {None: [cuda.to_device(f32_to_bf16_bits(w)) for _ in range(n_rot)]}
        for m in formats:
            q = quantize(w, m)
            weights[m] = [QuantizedLinear(q, scratch) for _ in range(n_rot)]
        norm_host = rng.uniform(0.5, 1.5, K).astype(np.float32)
        norm_weight = cuda.to_device(f32_to_bf16_bits(norm_host))
        for M in tokens:
            residual = cuda.to_device(rng.standard_normal((M, K), dtype=np.float32))
            x = cuda.to_device(f32_to_bf16_bits(rng.standard_normal((M, K), dtype=np.float32)))
            normed = cuda.device_array((M, K), np.uint16)
            out = cuda.device_array((M, N), np.float32)
            act = cuda.device_array((M, N // 2), np.uint16)

            def step(w, st):  # as LlamaCuda's layer loop makes this product
                on = {"stream": st}
                if name == "qkv_proj":
                    return rmsnorm_linear(residual, norm_weight, EPS, w, out, normed, **on)
                if name == "gate_up_proj":
                    return rmsnorm_linear_silu_mul(residual, norm_weight, EPS, w, act, out, normed, **on)
                return linear(x, w, out, accumulate=True, **on)

            made = {}  # path -> its product from zeros (checked against each other before timing)
            for m, ws in weights.items():
                for path, most, variant in ((("bf16", None, None),) if m is None else
                                            (("gemv", 16, "auto"), ("gemv", 16, "warp"), ("mma", 0, None),
                                             ("scratch", 0, None))):
                    if path == "gemv" and variant == "warp" and M == 1:
                        continue  # one token: the launcher's own knobs whatever the variant
                    for ql in ws if m else ():
                        ql.gemv_max_tokens, ql.gemv_variant = most, variant
                        ql.mma_max_tokens = 16 if path == "mma" else 0
                    if m and path in ("gemv", "mma"):
                        assert ws[0].gemm_path(x) == path, (ws[0].gemm_path(x), path)
                    elif m:  # the GEMM path: the scratch, or FP8's tensor cores with --fp8-tensor-cores
                        path = ws[0].gemm_path(x)
                    out.copy_to_device(np.zeros((M, N), np.float32))
                    act.copy_to_device(np.full((M, N // 2), 0x7FC0, np.uint16))  # NaN: a path that writes nothing fails
                    step(ws[0], 0)
                    got = act.copy_to_host() if name == "gate_up_proj" else out.copy_to_host()
                    made[m, path, variant] = bf16_bits_to_f32(got) if got.dtype == np.uint16 else got
                    if m is None:  # bf16 against NumPy on the same bf16 inputs
                        w_f32 = bf16_bits_to_f32(f32_to_bf16_bits(w))
                        if name in ("qkv_proj", "gate_up_proj"):
                            x_ref = rmsnorm_ref(residual.copy_to_host(), f32_to_bf16_bits(norm_host), EPS)
                            x_ref = bf16_bits_to_f32(f32_to_bf16_bits(x_ref))
                        else:
                            x_ref = bf16_bits_to_f32(x.copy_to_host())
                        want = x_ref @ w_f32.T
                        check(made[m, path, variant], silu_mul_ref(want) if name == "gate_up_proj" else want,
                              f"bf16 {name} M={M}", 2e-2)
                    elif path == "gemv" and variant == "warp":  # the same codes: the variants agree to rounding
                        check(made[m, path, variant], made[m, "gemv", "auto"], f"{m} {name} M={M} warp", 1e-2,
                              "the launcher's variant")
                    elif path != "gemv":  # the same codes and scales: the paths agree to bf16's rounding
                        check(made[m, path, variant], made[m, "gemv", "auto"], f"{m} {name} M={M} {path}", 1e-2,
                              "the GEMV")
                    seconds = time_launches(lambda i, st: step(ws[i % len(ws)], st), len(ws),
                                            repeats=1 if tiny else 10)
                    rec.add("crossover", [M, N, K], "us", seconds * 1e6, layer=name, quantization=m, path=path,
                            gemv_variant=variant, part="crossover", **extra)
                    print(f"{name} M={M} {m or 'bf16'} {path} {variant or ''}: {seconds * 1e6:.1f} us", flush=True)
        save_part(rec, "crossover", tiny)


SMALL_BATCHES = (2, 4, 8, 12, 16)


# (QUANTIZED_GEMV_MAX_TOKENS, QUANTIZED_GEMV_VARIANT, QUANTIZED_MMA_MAX_TOKENS): the GEMV up to 4 tokens with the
# tensor cores past it up to 16, and without them (the scratch past 4)
SMALL_BATCH_SETTINGS = ((4, "auto", 16), (4, "auto", 0))


def small_batch_part(rec: Recorder, folder, extra: dict, settings=SMALL_BATCH_SETTINGS, repeats: int = 3) -> None:
    """Decode at a few concurrent requests through the engine (CUDA graphs, the overlap): bf16, then int8 with
    QUANTIZED_GEMV_MAX_TOKENS and QUANTIZED_GEMV_VARIANT at each of `settings` (set before the engine captures its
    graphs). B requests of 128
    random prompt ids and 128 new greedy tokens at once; decode tok/s over the steps after the first, the median of
    `repeats` after a warm-up batch."""
    from tinyvllm_lib.layers import quantized_linear

    default = (quantized_linear.QUANTIZED_GEMV_MAX_TOKENS, quantized_linear.QUANTIZED_GEMV_VARIANT,
               quantized_linear.QUANTIZED_MMA_MAX_TOKENS)
    try:
        small_batch_runs(rec, folder, extra, settings, repeats, default)
    finally:
        (quantized_linear.QUANTIZED_GEMV_MAX_TOKENS, quantized_linear.QUANTIZED_GEMV_VARIANT,
         quantized_linear.QUANTIZED_MMA_MAX_TOKENS) = default
    save_part(rec, "small_batch", False)


def small_batch_runs(rec: Recorder, folder, extra: dict, settings, repeats: int, default: tuple) -> None:
    from tinyvllm_lib.layers import quantized_linear

    rng = np.random.default_rng(2)
    for method, most, variant, mma in [(None, None, None, None)] + [("int8", *s) for s in settings]:
        quantized_linear.QUANTIZED_GEMV_MAX_TOKENS = default[0] if most is None else most
        quantized_linear.QUANTIZED_GEMV_VARIANT = default[1] if variant is None else variant
        quantized_linear.QUANTIZED_MMA_MAX_TOKENS = default[2] if mma is None else mma
        llm = LLM(folder, device="cuda", max_model_len=1024, max_num_seqs=max(SMALL_BATCHES), quantization=method)
        engine = llm.llm_engine
        for warm_up, B in [(True, max(SMALL_BATCHES))] + [(False, b) for b in SMALL_BATCHES]:
            runs = []
            for r in range(repeats):
                for i in range(B):
                    prompt = rng.integers(0, llm.config.vocab_size, 128).tolist()
                    engine.add_request(f"b{B}-{r}-{i}", prompt, benchmark.greedy(128))
                engine.step()  # the prefill (and the first tokens)
                t0, steps = time.perf_counter(), 0
                while engine.has_unfinished_requests():
                    engine.step()
                    steps += 1
                runs.append(B * steps / (time.perf_counter() - t0))
            if not warm_up:
                value = float(np.median(runs))
                rec.add("small_batch_decode", [B], "tok/s", value, quantization=method, gemv_max_tokens=most,
                        gemv_variant=variant, mma_max_tokens=mma, runs=runs, part="small_batch", **extra)
                print(f"{method or 'bf16'} (GEMV up to {most}, {variant}; mma up to {mma}) batch {B}: "
                      f"{value:.0f} decode tok/s",
                      flush=True)
        del llm, engine


# the products whose input the layer loop norms first (rmsnorm_linear), and the norm's epsilon (Llama 3.2's)
NORMED_INPUT = ("qkv_proj", "gate_up_proj")
EPS = 1e-5


# the epilogue the engine launches for each layer's shape at one token (the LM head stays bf16: QUANTIZE_LM_HEAD);
# the knobs tried: the block's 8 warps sharing 4 or 8 rows, or a warp 1, 2 or 4 rows (gated: pairs, 2 or 4)
SWEEP_KINDS = {"qkv_proj": "rmsnorm", "o_proj": "add", "gate_up_proj": "rmsnorm_gated", "down_proj": "add"}
SWEEP_KNOBS = ([(GEMV_WARPS, rows, unroll) for rows in (2, 4, 8) for unroll in (1, 2)]
               + [(1, rows, unroll) for rows in (1, 2, 4) for unroll in (4, 8)])


def sweep_part(rec: Recorder, config: ModelConfig, extra: dict, tiny: bool, formats=("int8", "fp8"),
               tokens=(1,)) -> None:
    """Each knob setting of the 8-bit GEMV on each shape at each of `tokens` token vectors (buckets: 1, 2, 4, 8), with
    the epilogue the engine launches there, through chapter 15's launcher with the setting's kernel in its table (so
    with the blocks it gives: no more than the GPU holds of that kernel), weights rotated past L2; each checked first
    (a first launch, which compiles it). Past one token only the settings whose sums fit GEMV_MAX_ACC."""
    gb_s, ceiling_name = bandwidth_ceiling(device_info()["name"])  # this GPU's (none recorded: nan)
    rng = np.random.default_rng(0)
    for (name, (N, K)), method, T in ((item, m, t) for item in quantized_shapes(config, lm_head=False).items()
                                      for m in formats for t in tokens):
        q = quantize(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02), method)
        weights = [(cuda.to_device(q.codes), cuda.to_device(q.scales))
                   for _ in range(2 if tiny else num_rotations(q.nbytes))]
        x_bits = f32_to_bf16_bits(rng.standard_normal((T, K), dtype=np.float32))
        residual = rng.standard_normal((T, K), dtype=np.float32)
        norm = f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32))
        prior = rng.standard_normal((T, N), dtype=np.float32)
        d_x, d_residual, d_norm = (cuda.to_device(a) for a in (x_bits, residual, norm))
        kind = SWEEP_KINDS[name]
        gated, normed, add = "gated" in kind, "rmsnorm" in kind, kind == "add"
        product = (rmsnorm_ref(residual, norm, 1e-5) if normed else bf16_bits_to_f32(x_bits)) @ q.dequantize().T
        want = silu_mul_ref(product) if gated else product + prior if add else product
        out = cuda.device_array((T, N // 2), np.uint16) if gated else cuda.device_array((T, N), np.float32)
        nbytes = q.nbytes + (residual.nbytes + norm.nbytes if normed else x_bits.nbytes)
        variant = "warp" if tiny else gemv_variant(T, N)  # the launcher's "auto"
        chosen, key = gemv_8bit_config(variant, T, kind), (method, variant, T, kind)
        model_kernel = GEMV_8BIT_KERNELS[key]

        def launch(i, s):  # as the engine launches it
            codes, scales = weights[i % len(weights)]
            if normed:
                gemv_8bit_rmsnorm(d_residual, d_norm, 1e-5, codes, scales, out, method, stream=s, gated=gated)
            else:
                gemv_8bit(d_x, codes, scales, out, method, stream=s, accumulate=add)

        for knobs in SWEEP_KNOBS:
            warps, rows, unroll = knobs
            if (gated and rows % 2) or rows * T > GEMV_MAX_ACC:
                continue
            GEMV_8BIT_KERNELS[key] = make_gemv_8bit_kernel(method, T, warps, rows, unroll, accumulate=add,
                                                           rms_norm=normed, gated=gated)
            try:
                if add:
                    out.copy_to_device(prior)
                launch(0, 0)
                got = out.copy_to_host()
                check(bf16_bits_to_f32(got) if gated else got, want, f"{method} {name} {kind} {knobs} T={T}",
                      2.0**-8 if gated else 1e-4)
                kernel, blocks = pick_gemv_8bit_kernel("sweep", method, T, N, kind)
                registers = None if tiny else max(kernel.get_regs_per_thread().values())
                seconds = time_launches(launch, len(weights), repeats=1 if tiny else 10)
            finally:
                GEMV_8BIT_KERNELS[key] = model_kernel
            rec.add("gemv_sweep", [T, N, K], "GB/s", nbytes / seconds / 1e9, gb_s, layer=name,
                    quantization=method, kind=kind, warps_per_row=warps, rows=rows, unroll=unroll, blocks=blocks,
                    registers=registers, chosen=knobs == chosen, us=seconds * 1e6, bytes=nbytes,
                    ceiling_name=ceiling_name, part="sweep", tokens=T, **extra)
            print(f"{name} {method} {kind or 'plain'} T={T} {knobs}{' (chosen)' * (knobs == chosen)}: "
                  f"{seconds * 1e6:.2f} us", flush=True)
        save_part(rec, "sweep", tiny)  # shape by shape: a run cut short keeps what it timed


# the tensor-core kernel's knobs: m-tiles a block (gate-up's is a gate tile and its up tile), warps splitting K, chunks
# of 64 k loaded ahead
MMA_SWEEP_KNOBS = [(mt, w, a) for mt in (1, 2) for w in (4, 8, 16) for a in (1, 2, 4)]
MMA_SWEEP_TOKENS = (2, 16)


def mma_sweep_part(rec: Recorder, config: ModelConfig, extra: dict, tiny: bool, formats=("int8",)) -> None:
    """The tensor-core kernel (mma_8bit) on each layer's shape with the epilogue the layer loop gives it (QKV plain
    after its norm, O and down adding, gate-up gated) at 2, 8 and 16 token vectors, each knob setting
    (MMA_SWEEP_KNOBS), checked against NumPy first, then timed as the sweep part times the GEMV; the launcher's
    knobs marked `chosen`."""
    from tinyvllm_lib.kernels.mma_8bit import (
        MMA_8BIT_KERNELS,
        MMA_8BIT_KNOBS,
        make_mma_8bit_kernel,
        mma_8bit,
    )

    gb_s, ceiling_name = bandwidth_ceiling(device_info()["name"])
    rng = np.random.default_rng(3)
    kinds = {"qkv_proj": "", "o_proj": "add", "gate_up_proj": "gated", "down_proj": "add"}
    for (name, (N, K)), method, T in ((item, m, t) for item in quantized_shapes(config, lm_head=False).items()
                                      for m in formats for t in ((3,) if tiny else MMA_SWEEP_TOKENS)):
        q = quantize(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02), method)
        weights = [(cuda.to_device(q.codes), cuda.to_device(q.scales))
                   for _ in range(2 if tiny else num_rotations(q.nbytes))]
        x_bits = f32_to_bf16_bits(rng.standard_normal((T, K), dtype=np.float32))
        d_x, kind = cuda.to_device(x_bits), kinds[name]
        gated, add = kind == "gated", kind == "add"
        prior = rng.standard_normal((T, N), dtype=np.float32)
        product = bf16_bits_to_f32(x_bits) @ q.dequantize().T
        want = silu_mul_ref(product) if gated else product + prior if add else product
        out = cuda.device_array((T, N // 2), np.uint16) if gated else cuda.device_array((T, N), np.float32)
        nbytes = q.nbytes + x_bits.nbytes
        key = (method, 1 if T <= 8 else 2, kind)
        model_kernel = MMA_8BIT_KERNELS[key]
        chosen = MMA_8BIT_KNOBS[kind, key[1]]

        def launch(i, s):
            codes, scales = weights[i % len(weights)]
            mma_8bit(d_x, codes, scales, out, method, stream=s, accumulate=add, gated=gated)

        for knobs in MMA_SWEEP_KNOBS:
            m_tiles, warps, ahead = knobs
            if gated and m_tiles != 2:
                continue
            if warps == 4 and not gated:  # few blocks a layer past gate-up: 4 warps leave the GPU idle
                continue
            MMA_8BIT_KERNELS[key] = make_mma_8bit_kernel(method, key[1], m_tiles, warps, ahead, accumulate=add,
                                                         gated=gated)
            try:
                if add:
                    out.copy_to_device(prior)
                try:
                    launch(0, 0)
                except Exception as err:  # too many registers for the block's threads: nothing to time
                    print(f"mma {name} {method} T={T} {knobs}: not launched ({type(err).__name__})", flush=True)
                    continue
                got = out.copy_to_host()
                check(bf16_bits_to_f32(got) if gated else got, want, f"mma {method} {name} {knobs} T={T}",
                      2.0**-8 if gated else 1e-4)
                kernel = MMA_8BIT_KERNELS[key]
                registers = None if tiny else max(kernel.get_regs_per_thread().values())
                seconds = time_launches(launch, len(weights), repeats=1 if tiny else 10)
            finally:
                MMA_8BIT_KERNELS[key] = model_kernel
            rec.add("mma_sweep", [T, N, K], "GB/s", nbytes / seconds / 1e9, gb_s, layer=name, quantization=method,
                    kind=kind, m_tiles=m_tiles, warps=warps, ahead=ahead, registers=registers,
                    chosen=knobs == chosen, us=seconds * 1e6, bytes=nbytes, ceiling_name=ceiling_name,
                    part="mma_sweep", tokens=T, **extra)
            print(f"mma {name} {method} T={T} {knobs}{' (chosen)' * (knobs == chosen)}: {seconds * 1e6:.2f} us",
                  flush=True)
        save_part(rec, "mma_sweep", tiny)


def best_mma_knobs(device_name: str) -> dict:
    """From this device's mma_sweep records of this kernel version: for each (epilogue, n-tiles), the knobs whose
    times summed over the layers of that epilogue (O and down share "add") and the token counts of that n-tile count
    are least, among the knobs timed for all of them."""
    from tinyvllm_lib.kernels.mma_8bit import MMA_8BIT_VERSION

    path = DATA_DIR / "ch15_quantization.json"
    runs = [r for r in (json.loads(path.read_text()) if path.exists() else [])
            if r.get("part") == "mma_sweep" and r["device"].get("name") == device_name
            and r.get("mma_8bit_version") == MMA_8BIT_VERSION]
    total, seen = {}, {}
    for r in runs:
        group = (r["kind"], 1 if r["tokens"] <= 8 else 2)
        knobs = (r["m_tiles"], r["warps"], r["ahead"])
        total[group, knobs] = total.get((group, knobs), 0.0) + r["us"]
        seen.setdefault(group, {}).setdefault(knobs, set()).add((r["layer"], r["tokens"]))
    best = {}
    for group, by_knobs in seen.items():
        everywhere = set.union(*by_knobs.values())
        complete = [k for k, cells in by_knobs.items() if cells == everywhere]
        best[group] = min(complete, key=lambda k: total[group, k])
    return best


def use_mma_knobs(knobs: dict) -> None:
    """Rebuild the launcher's tensor-core kernels (both formats) with these (epilogue, n-tiles) -> knobs."""
    from tinyvllm_lib.kernels import mma_8bit

    for (kind, n_tiles), (m_tiles, warps, ahead) in knobs.items():
        mma_8bit.MMA_8BIT_KNOBS[kind, n_tiles] = (m_tiles, warps, ahead)
        for method in ("int8", "fp8"):
            mma_8bit.MMA_8BIT_KERNELS[method, n_tiles, kind] = mma_8bit.mma_8bit_kernel_for(method, n_tiles, kind)


def use_prefetch_l2(mib: int) -> None:
    """Rebuild the launcher's 8-bit kernels (GEMV and tensor cores, both formats, every epilogue) with `mib` MiB of
    L2 prefetch before the wait (0: none); the library's default is kernels.prefetch.PREFETCH_L2_BYTES."""
    from tinyvllm_lib.kernels import gemv_8bit, mma_8bit

    for key in list(gemv_8bit.GEMV_8BIT_KERNELS):  # (format, variant, bucket, epilogue)
        gemv_8bit.GEMV_8BIT_KERNELS[key] = gemv_8bit.gemv_8bit_kernel_for(*key, prefetch_bytes=mib << 20)
    for key in list(mma_8bit.MMA_8BIT_KERNELS):  # (format, n-tiles, epilogue), at the table's knobs
        mma_8bit.MMA_8BIT_KERNELS[key] = mma_8bit.mma_8bit_kernel_for(*key, prefetch_bytes=mib << 20)


def prefetch_l2_mib(arg: int | None) -> int:
    """The MiB of L2 prefetch the run's 8-bit kernels use: the argument, else the library's default."""
    from tinyvllm_lib.kernels.prefetch import PREFETCH_L2_BYTES

    return PREFETCH_L2_BYTES >> 20 if arg is None else arg


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def gap(ours: np.ndarray, ref: np.ndarray, k: int = 5) -> dict:
    """Chapter 7's measure: mean |Δ log p| over each position's k most likely tokens of ref, the largest at its top
    token, and the positions whose top token differs."""
    top = np.argsort(-ref, axis=-1)[:, :k]
    rows = np.arange(ref.shape[0])[:, None]
    d = np.abs(ours[rows, top] - ref[rows, top])
    return {"mean_top5": float(d.mean()), "max_top1": float(d[:, 0].max()),
            "top1_differs": int((ours.argmax(-1) != ref.argmax(-1)).sum())}


def drift_part(rec: Recorder, folder, extra: dict, tiny: bool) -> None:
    """Teacher-forced log-probs of one random prompt: bf16 kernels against float32 NumPy (the precision the book
    already lives with), each 8-bit kernel model against bf16 kernels (what 8 bits add), and each against its own
    NumPy reference (the kernels at real sizes: same weights, float32 sums)."""
    from tinyvllm_lib.models.llama_cuda import LlamaCuda
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda
    from tinyvllm_lib.models.llama_numpy import LlamaNumpy
    from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy
    from tinyvllm_lib.models.loader import load_weights

    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 6 if tiny else 64)
    common = extra | {"part": "drift", "num_tokens": int(ids.size)}
    f32 = log_softmax(LlamaNumpy(config, weights).forward(ids))
    bf16 = log_softmax(LlamaCuda(config, weights).forward(ids))
    pairs = {"bf16_kernels_vs_f32_numpy": (bf16, f32)}
    for method in ("int8", "fp8"):
        ours = log_softmax(QuantizedLlamaCuda(config, weights, method).forward(ids))
        numpy_ref = log_softmax(QuantizedLlamaNumpy(config, weights, method, bf16_activations=True).forward(ids))
        pairs[f"{method}_kernels_vs_bf16_kernels"] = (ours, bf16)
        pairs[f"{method}_kernels_vs_{method}_numpy"] = (ours, numpy_ref)
    for name, (ours, ref) in pairs.items():
        g = gap(ours, ref)
        print(f"{name}: mean |Δ log p| over the top 5 {g['mean_top5']:.4f}, at the top token <= {g['max_top1']:.4f}, "
              f"{g['top1_differs']} of {ids.size} top tokens differ", flush=True)
        rec.add("drift", [int(ids.size)], "mean |Δ log p|", g["mean_top5"], pair=name, **g, **common)
    save_part(rec, "drift", tiny)


def save_part(rec: Recorder, part: str, tiny: bool) -> Path | None:
    """Replace this part's records of this device and this 8-bit GEMV version in ch15_quantization.json; keep the rest
    (an earlier kernel's records stay, to be drawn beside this one's; --tiny: nothing)."""
    if tiny:
        return None
    path = DATA_DIR / "ch15_quantization.json"
    old = json.loads(path.read_text()) if path.exists() else []
    mine = [r for r in rec.records if r.get("part") == part]

    def kind(r: dict) -> tuple:  # a run of some formats (or GEMV settings, or token counts) keeps the others' records
        return (r.get("quantization"), r.get("lm_head_8bit", False), r.get("gemv_max_tokens"), r.get("gemv_variant"),
                r.get("tokens", 1), r.get("mma_max_tokens"), r.get("prefetch_l2_mib"))

    made = {kind(r) for r in mine}

    def replaced(r: dict) -> bool:
        return (r["device"].get("name") == rec.device.get("name") and r.get("part") == part
                and r.get("gemv_8bit_version") == GEMV_8BIT_VERSION
                and (part == "gemv" or kind(r) in made))

    kept = [r for r in old if not replaced(r)]
    path.write_text(json.dumps(kept + mine, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=PARTS, help="one part (default: both)")
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama, nothing recorded (the simulator)")
    ap.add_argument("--formats", nargs="+", choices=("bf16", "int8", "fp8"), default=["bf16", "int8", "fp8"])
    ap.add_argument("--lm-head", choices=("bf16", "8bit", "both"), default="bf16",
                    help="engine and throughput: the 8-bit formats' LM head in bf16 (the engine's default), in 8 bits "
                         "(quantize_lm_head=True), or a run of each")
    ap.add_argument("--fp8-tensor-cores", action="store_true",
                    help="FP8's GEMM path on FP8 tensor cores (quantized_linear.FP8_TENSOR_CORE_GEMM, off by default)")
    ap.add_argument("--mma-knobs", choices=("library", "best"), default="library",
                    help="crossover, small_batch, engine: the tensor-core kernel's knobs as the library sets them, or "
                         "the fastest of this device's mma_sweep records (best_mma_knobs; records say which)")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[1], choices=GEMV_BUCKETS,
                    help="sweep: the token buckets to sweep the knobs at (default: 1)")
    ap.add_argument("--small-batch-settings", nargs="+", default=SMALL_BATCH_SETTINGS,
                    type=lambda text: (int(text.split(":")[0]), text.split(":")[1], int(text.split(":")[2])),
                    help="small_batch: int8's settings as GEMV_LIMIT:VARIANT:MMA_LIMIT (default: 4:auto:16 4:auto:0)")
    ap.add_argument("--prefetch-l2-mib", type=int, default=None,
                    help="the 8-bit kernels' L2 prefetch before the wait, MiB across a grid (0: none; default: the "
                         "library's PREFETCH_L2_BYTES); records carry prefetch_l2_mib")
    args = ap.parse_args()
    if args.fp8_tensor_cores:
        from tinyvllm_lib.layers import quantized_linear

        quantized_linear.FP8_TENSOR_CORE_GEMM = True
    if args.tiny:
        import tempfile

        os.environ["TINYVLLM_SIM_CUDA"] = "1"  # device="cuda" in the simulator
        folder = make_random_llama(Path(tempfile.mkdtemp()) / "tiny", tiny_llama_config(tie_word_embeddings=True))
        extra = {"model": "tiny random Llama (smoke run)"}
    else:
        folder = prepare_llama_standin(wheel=args.wheel)
        from tinyvllm_lib.kernels.decode_rope import DECODE_ROPE_VERSION
        from tinyvllm_lib.kernels.mma_8bit import MMA_8BIT_VERSION
        from tinyvllm_lib.layers.attention import FUSE_DECODE_ROPE

        extra = {"gemv_8bit_version": GEMV_8BIT_VERSION, "mma_8bit_version": MMA_8BIT_VERSION, "engine_commit": os.environ.get("ENGINE_COMMIT"),
                 "model": "Llama 3.2 1B stand-in (random bf16 weights, real tokenizer)", "max_model_len": MAX_MODEL_LEN,
                 "fuse_decode_rope": FUSE_DECODE_ROPE, "decode_rope_version": DECODE_ROPE_VERSION,
                 "workload": "bs1: 128 random prompt ids, 256 new, greedy, ignore_eos; throughput: nano-vllm's "
                             "256 requests, lengths uniform in [100, 1024], seed 0"}
    rec = Recorder("ch15_quantization")
    if args.mma_knobs == "best" and not args.tiny:
        knobs = best_mma_knobs(rec.device.get("name"))
        print("the tensor-core kernel's knobs from this device's sweep:", knobs)
        use_mma_knobs(knobs)
    if args.prefetch_l2_mib is not None:
        use_prefetch_l2(args.prefetch_l2_mib)
    if not args.tiny:
        extra["prefetch_l2_mib"] = prefetch_l2_mib(args.prefetch_l2_mib)
        from tinyvllm_lib.kernels.mma_8bit import MMA_8BIT_KNOBS

        extra["mma_knobs"] = {f"{kind or 'plain'}/{n}": list(v) for (kind, n), v in MMA_8BIT_KNOBS.items()}
    if args.only in (None, "gemv"):
        gemv_part(rec, ModelConfig.from_folder(folder), extra, args.tiny)
    if args.only in (None, "sweep"):
        sweep_part(rec, ModelConfig.from_folder(folder), extra, args.tiny,
                   [f for f in args.formats if f != "bf16"], args.sweep_tokens)
    if args.only in (None, "drift"):
        drift_part(rec, folder, extra, args.tiny)
    if args.only in (None, "gemm"):
        gemm_part(rec, ModelConfig.from_folder(folder), extra, args.tiny)
    if args.only in (None, "crossover"):
        crossover_part(rec, ModelConfig.from_folder(folder), extra, args.tiny,
                       [f for f in args.formats if f != "bf16"])
    if args.only in (None, "mma_sweep"):
        mma_sweep_part(rec, ModelConfig.from_folder(folder), extra, args.tiny,
                       [f for f in args.formats if f != "bf16"])
    if args.only in (None, "small_batch") and not args.tiny:
        small_batch_part(rec, folder, extra, args.small_batch_settings)
    if args.only in (None, "engine", "throughput"):
        formats = [None if f == "bf16" else f for f in args.formats]
        engine_part(rec, folder, extra, args.tiny, formats, throughput=args.only in (None, "throughput"),
                    latency=args.only in (None, "engine"),
                    heads={"bf16": (False,), "8bit": (True,), "both": (False, True)}[args.lm_head])
    print("done" if args.tiny else f"wrote {DATA_DIR / 'ch15_quantization.json'}")


if __name__ == "__main__":
    main()
