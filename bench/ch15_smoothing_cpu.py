"""A what-if for chapter 15, on the CPU: W8A8 (the activations rounded per token too, as an 8-bit tensor-core GEMM
needs) after SmoothQuant's smoothing (Xiao et al., 2022). Records to book/data/ch15_smoothing.json under the CPU's name.

    python bench/ch15_smoothing_cpu.py [--alphas 0.5] [--methods int8 fp8]   (about a minute a setting on 2 cores)

Each quantized matrix's inputs are divided per channel by s_j = max|X_j|^α / max|W_j|^(1-α) and its columns multiplied
by s_j (the product is unchanged), so the activations' outlier channels hand part of their range to the weights; then
both are quantized as chapter 15 quantizes them (per row of W, per token of X). max|X_j| comes from one pass over the
prose of chapters/04_rmsnorm.py (calibration); the study is chapter 15's text study (ch15_accuracy_cpu.py) on
chapters/01_bf16.py, so calibration and evaluation do not share text. Not a GPU path: the engine would fold 1/s into the
norm weights (QKV, gate-up) and into up_proj's rows (down); O's input channels share v_proj's under grouped-query
attention, which this what-if ignores (each channel its own s).
"""

import argparse
import time

import numpy as np
from ch08_decode_cpu import cpu_device_info
from ch15_accuracy_cpu import ROOT, TEXT_SOURCE, chapter_prose, study

import tinyvllm_lib.measure as measure
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.llama_quantized import is_quantized
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.formats import quantize
from tinyvllm_lib.tokenizer import Tokenizer

CALIBRATION_SOURCE = "chapters/04_rmsnorm.py"


class ActivationRange(LlamaNumpy):
    """Chapter 7's NumPy model that keeps each quantized matrix's largest |input| per channel, in `ranges`."""

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if is_quantized(name):
            ranges = self.__dict__.setdefault("ranges", {})
            ranges[name] = np.maximum(ranges.get(name, 0.0), np.abs(x).max(axis=0))
        return super().linear(x, name)


class SmoothedW8A8(LlamaNumpy):
    """Each quantized matrix smoothed by α, then its weight quantized per row and, past `tokens` token vectors, its
    bf16-rounded input per token."""

    def __init__(self, config, weights, method: str, alpha: float, ranges: dict, tokens: int = 8):
        super().__init__(config, weights)
        self.method, self.tokens, self.smooth, self.quantized = method, tokens, {}, {}
        for name, w in self.matrices.items():
            if is_quantized(name):
                s = (np.maximum(ranges[name], 1e-5) ** alpha
                     / np.maximum(np.abs(w).max(axis=0), 1e-5) ** (1 - alpha)).astype(np.float32)
                self.smooth[name] = s
                self.quantized[name] = quantize(w * s[None, :], method).dequantize()

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if name not in self.quantized:
            return super().linear(x, name)
        x = bf16_bits_to_f32(f32_to_bf16_bits(x)) / self.smooth[name]
        if len(x) > self.tokens:
            x = quantize(x, self.method).dequantize()
        return x @ self.quantized[name].T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5])
    ap.add_argument("--methods", nargs="+", choices=("int8", "fp8"), default=["int8", "fp8"])
    ap.add_argument("--text-tokens", type=int, default=2048)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    folder = resolve_model("smollm2")
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    tokenizer = Tokenizer.from_folder(folder)
    text_ids = np.array(tokenizer.encode(chapter_prose(ROOT / TEXT_SOURCE))[: args.text_tokens])
    calibration = np.array(tokenizer.encode(chapter_prose(ROOT / CALIBRATION_SOURCE))[:1024])
    probe = ActivationRange(config, weights)
    probe.forward(calibration)
    ref, _ = study(LlamaNumpy(config, weights), text_ids, [])
    ref_ppl = float(np.exp(-ref["target_lp"].mean()))
    measure.device_info = cpu_device_info  # a CPU measurement: name the CPU, not a GPU
    rec = measure.Recorder("ch15_smoothing")
    common = {"model": "SmolLM2-135M-Instruct (dequantized from Q4_1, stored bf16)", "backend": "NumPy float32",
              "source": TEXT_SOURCE, "calibration": CALIBRATION_SOURCE, "w8a8_tokens": 8}
    for method in args.methods:
        for alpha in args.alphas:
            t0 = time.perf_counter()
            got, _ = study(SmoothedW8A8(config, weights, method, alpha, probe.ranges), text_ids, [])
            ppl = float(np.exp(-got["target_lp"].mean()))
            delta = np.abs(got["target_lp"] - ref["target_lp"])
            top1 = float(np.mean(got["top"] == ref["top"]))
            rec.add("smoothed_w8a8_perplexity", [text_ids.size - 1], "perplexity", ppl, ratio_to_bf16=ppl / ref_ppl,
                    mean_abs_dlogp=float(delta.mean()), top1_agreement=top1, quantization=method, alpha=alpha,
                    **common)
            print(f"{method} W8A8, smoothed with alpha {alpha}: perplexity {ppl:.4f} ({ppl / ref_ppl - 1:+.2%}), mean "
                  f"|Δ log p| {delta.mean():.4f}, top-1 agreement {top1:.2%} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
