"""Chapter 15 on the CPU: GPTQ against round-to-nearest on SmolLM2, one scale a row in both (the kernels' format).
Records to book/data/ch15_gptq.json under the CPU's name.

    python bench/ch15_gptq_cpu.py [--answer-tokens 32] [--jitter-seeds 3]   (a few minutes on 2 cores)

Calibration: the library's chat_calibration (chapter 15's 38 CALIBRATION_QUESTIONS, none of ch15_accuracy_cpu.py's
20; bf16's greedy answers to them, 64 tokens at most, from LLM.chat on the CPU), teacher-forced through chapter 15's
HessianProbe (collect_hessians): XᵀX at the input of each 8-bit matrix. Each format is then quantized three ways and
measured exactly as ch15_accuracy_cpu.py measures (the same 20 answers, the same prose of chapter 1):
- rtn: round to nearest (the engine's quantization=);
- gptq: chapter 15's gptq_quantize against the calibration's XᵀX;
- rtn_jitter_S: round to nearest under each row's scale times a random factor in [0.99, 1] (seed S): a different
  rounding of nearly every weight, how much the flip counts move by chance (it clips each row's largest weight by
  under 1%, which costs the prose's perplexity a few tenths of a percent; [1, 1.01] would clip nothing).
"""

import argparse
import time
from dataclasses import dataclass

import numpy as np
from ch08_decode_cpu import cpu_device_info
from ch15_accuracy_cpu import (
    QUESTIONS,
    ROOT,
    TEXT_SOURCE,
    chapter_prose,
    flips_against,
    study,
)

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, fuse_llama_weights
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, is_quantized
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.calibration import (
    CALIBRATION_QUESTIONS,
    chat_calibration,
    collect_hessians,
    greedy_chats,
)
from tinyvllm_lib.quantization.formats import (
    CODE_MAX,
    INT8_MAX,
    QuantizedTensor,
    fp8_e4m3_encode,
)
from tinyvllm_lib.quantization.gptq import gptq_quantize

assert not set(CALIBRATION_QUESTIONS) & set(QUESTIONS), "calibration must not be the test"
MODEL = "SmolLM2-135M-Instruct (dequantized from Q4_1, stored bf16)"
CALIBRATION_SOURCE = "38 chat questions (none of the 20 tested), bf16's greedy answers"


def jittered(w: np.ndarray, method: str, rng) -> QuantizedTensor:
    """Round to nearest under scales of max |w| / the largest code times U[0.99, 1] (nothing past a code's range)."""
    scales = (np.abs(w).max(1) / CODE_MAX[method] * rng.uniform(0.99, 1.0, len(w))).astype(np.float32)
    part = w / np.where(scales > 0, scales, 1)[:, None]
    codes = (np.clip(np.rint(part), -INT8_MAX, INT8_MAX).astype(np.int8) if method == "int8"
             else fp8_e4m3_encode(part.astype(np.float32)))
    return QuantizedTensor(method, codes, scales)


@dataclass
class Reference:
    """bf16's side of every comparison: the 20 chats (prompt ids, bf16's greedy answer ids), the prose's token ids,
    and summarize()'s rows for both (study), with the prose's perplexity."""

    chats: list
    text_ids: np.ndarray
    text: dict
    answers: list
    perplexity: float


def bf16_reference(folder, config: ModelConfig, weights: dict, answer_tokens: int, text_tokens: int) -> Reference:
    """bf16's greedy answers to the 20 questions (LLM.chat on the CPU), the first text_tokens tokens of the prose, and
    bf16's study of both."""
    llm = LLM(folder, device="cpu", max_model_len=512, max_num_seqs=len(CALIBRATION_QUESTIONS))
    chats = greedy_chats(llm, QUESTIONS, answer_tokens)
    text_ids = np.array(llm.get_tokenizer().encode(chapter_prose(ROOT / TEXT_SOURCE))[:text_tokens])
    del llm
    text, answers = study(LlamaNumpy(config, weights), text_ids, chats)
    return Reference(chats, text_ids, text, answers, float(np.exp(-text["target_lp"].mean())))


def record_accuracy(rec: measure.Recorder, model, ref: Reference, /, **extra) -> str:
    """Study model as ref was studied; record the prose's perplexity and the answers' flips against bf16 (two records,
    each with extra); return a line that sums them up."""
    text, got = study(model, ref.text_ids, ref.chats)
    ppl = float(np.exp(-text["target_lp"].mean()))
    flips = flips_against(got, ref.answers)
    dlogp = float(np.mean(np.concatenate([np.abs(g["target_lp"] - r["target_lp"]) for g, r in zip(got, ref.answers)])))
    text_dlogp = float(np.abs(text["target_lp"] - ref.text["target_lp"]).mean())
    num_positions = sum(len(a) for _, a in ref.chats)
    rec.add("text_perplexity", [ref.text_ids.size - 1], "perplexity", ppl, ratio_to_bf16=ppl / ref.perplexity,
            mean_abs_dlogp=text_dlogp, source=TEXT_SOURCE, **extra)
    worst = max((f["bf16_margin"] for f in flips), default=0.0)
    rec.add("chat_flips", [len(ref.chats), num_positions], "positions", len(flips), flips=flips,
            largest_flip_margin=worst, mean_abs_dlogp=dlogp, **extra)
    sure = sum(f["bf16_margin"] > 0.5 for f in flips)
    return (f"{len(flips)} of {num_positions} top tokens differ, {sure} past a margin of 0.5 (largest {worst:.3f}); "
            f"answers' |Δ log p| {dlogp:.4f}; prose perplexity {ppl / ref.perplexity - 1:+.3%}, |Δ log p| "
            f"{text_dlogp:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-tokens", type=int, default=2048)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--calibration-tokens", type=int, default=64, help="bf16's answer to each calibration question")
    ap.add_argument("--jitter-seeds", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    folder = resolve_model("smollm2")
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    ref = bf16_reference(folder, config, weights, args.answer_tokens, args.text_tokens)
    t0 = time.perf_counter()
    calibration = chat_calibration(folder, answer_tokens=args.calibration_tokens)
    hessians = collect_hessians(config, weights, calibration)
    calib = {"sequences": len(calibration), "tokens": int(sum(map(len, calibration))), "source": CALIBRATION_SOURCE,
             "damp": 0.01}
    print(f"calibration: {calib['tokens']} tokens of {calib['sequences']} chats, XᵀX of {len(hessians)} matrices "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    matrices = {n: bf16_bits_to_f32(w) for n, w in fuse_llama_weights(weights, config).items() if is_quantized(n)}

    measure.device_info = cpu_device_info
    rec = measure.Recorder("ch15_gptq")
    common = {"model": MODEL, "backend": "NumPy float32", "calibration": calib, "bf16_perplexity": ref.perplexity}
    for method in ("int8", "fp8"):
        roundings = [("rtn", None), ("gptq", None)] + [(f"rtn_jitter_{s}", s) for s in range(args.jitter_seeds)]
        for rounding, seed in roundings:
            t0 = time.perf_counter()
            if rounding == "rtn":
                tensors = {}
            elif rounding == "gptq":
                tensors = {n: gptq_quantize(w, hessians[n], method) for n, w in matrices.items()}
            else:
                rng = np.random.default_rng(seed)
                tensors = {n: jittered(w, method, rng) for n, w in matrices.items()}
            t_quantize = time.perf_counter() - t0
            line = record_accuracy(rec, QuantizedLlamaNumpy(config, weights, method, tensors=tensors), ref,
                                   quantization=method, rounding=rounding, seconds_quantize=round(t_quantize, 1),
                                   **common)
            print(f"{method} {rounding:>13}: {line} (quantized in {t_quantize:.0f} s, "
                  f"{time.perf_counter() - t0:.0f} s in all)", flush=True)
    for r in rec.records:
        r["seconds_total"] = round(time.perf_counter() - t_start, 1)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
