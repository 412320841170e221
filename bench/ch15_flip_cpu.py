"""Chapter 15 on the CPU: where GPTQ FP8's flips past bf16's 0.5 margin come from, on SmolLM2. Records to
book/data/ch15_flip.json under the CPU's name.

    python bench/ch15_flip_cpu.py [--answer-tokens 32] [--calibration-tokens 64]   (about 4 minutes on 2 idle cores)

The model and measure of bench/ch15_gptq_cpu.py: FP8 e4m3 with one scale a row, codes chosen by chapter 15's
gptq_quantize on the same calibration (38 chats, none of the 20 tested), the 20 answers bf16 gave teacher-forced
through it. At each answer position where its top token differs from bf16's and bf16's top-two margin exceeds 0.5,
the lead of bf16's token over the model's best other token (log-probs; below 0: flipped), measured again with some of
the 8-bit matrices kept bf16:
- none (every matrix FP8: the flip as chapter 15 records it), and all (every matrix bf16: a control that must give
  bf16's own margin back);
- each kind of matrix (qkv_proj, o_proj, gate_up_proj, down_proj) kept bf16 in every layer;
- each layer's four matrices kept bf16, one layer at a time.
Where one matrix's rounding makes the flip, keeping its kind or its layer restores bf16's token; where the error is
spread over many, none of the single layers does.
"""

import argparse
import time

import numpy as np
from ch08_decode_cpu import cpu_device_info
from ch15_accuracy_cpu import flips_against, summarize
from ch15_gptq_cpu import MODEL, bf16_reference

import tinyvllm_lib.measure as measure
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, fuse_llama_weights
from tinyvllm_lib.models.llama_quantized import (
    QUANTIZED_MATRICES,
    QuantizedLlamaNumpy,
    is_quantized,
)
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.calibration import chat_calibration, collect_hessians
from tinyvllm_lib.quantization.gptq import gptq_quantize


class PartlyBf16(QuantizedLlamaNumpy):
    """QuantizedLlamaNumpy with the matrices named in `kept` (fused names) left in bf16: a what-if for this script."""

    def __init__(self, *args, kept: frozenset = frozenset(), **kwargs):
        self.kept = kept
        super().__init__(*args, **kwargs)

    def load_matrix(self, name, array):
        if name in self.kept:
            return LlamaNumpy.load_matrix(self, name, array)
        return super().load_matrix(name, array)


def lead(model, chat, position: int, token: int) -> float:
    """bf16's token's log-prob less the best other token's, at an answer position, the chat teacher-forced."""
    prompt, answer = chat
    ids = np.array(prompt + answer)
    row = model.forward(ids)[len(prompt) - 1 + position].astype(np.float64)
    lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
    return float(lp[token] - np.max(np.delete(lp, token)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--calibration-tokens", type=int, default=64)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    folder = resolve_model("smollm2")
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    ref = bf16_reference(folder, config, weights, args.answer_tokens, text_tokens=16)  # the prose is not used here
    calibration = chat_calibration(folder, answer_tokens=args.calibration_tokens)
    hessians = collect_hessians(config, weights, calibration)
    matrices = {n: bf16_bits_to_f32(w) for n, w in fuse_llama_weights(weights, config).items() if is_quantized(n)}
    tensors = {n: gptq_quantize(w, hessians[n], "fp8") for n, w in matrices.items()}
    print(f"GPTQ FP8 of {len(tensors)} matrices on {sum(map(len, calibration))} calibration tokens "
          f"({time.perf_counter() - t_start:.0f} s in)", flush=True)

    def model(kept=frozenset()):
        return PartlyBf16(config, weights, "fp8", tensors=tensors, kept=kept)

    every = model()
    got = []
    for prompt, answer in ref.chats:
        ids = np.array(prompt + answer)
        got.append(summarize(every.forward(ids)[len(prompt) - 1 : len(ids) - 1], np.array(answer)))
    sure = [f for f in flips_against(got, ref.answers) if f["bf16_margin"] > 0.5]
    print(f"{len(sure)} flips past bf16's 0.5 margin: {sure}", flush=True)

    measure.device_info = cpu_device_info
    rec = measure.Recorder("ch15_flip")
    common = {"model": MODEL, "backend": "NumPy float32", "quantization": "fp8", "rounding": "gptq",
              "calibration_tokens": int(sum(map(len, calibration))), "answer_tokens": args.answer_tokens}
    rec.add("sure_flips", [len(ref.chats)], "positions", len(sure), **common)  # 0 is a result too
    layers = range(config.num_hidden_layers)
    everything = frozenset(tensors)
    variants = ([("none", "", frozenset()), ("all", "", everything)]
                + [("kind", kind, frozenset(f"layers.{i}.{kind}" for i in layers)) for kind in QUANTIZED_MATRICES]
                + [("layer", str(i), frozenset(f"layers.{i}.{kind}" for kind in QUANTIZED_MATRICES))
                   for i in layers])
    for f in sure:
        chat = ref.chats[f["question"]]
        for kept_by, which, kept in variants:
            value = lead(model(kept) if kept else every, chat, f["position"], f["bf16_token"])
            if kept_by == "all":  # the control: every matrix bf16 is the bf16 model, its lead bf16's margin
                assert abs(value - f["bf16_margin"]) < 1e-3, (value, f["bf16_margin"])
            rec.add("flip_lead", [f["question"], f["position"]], "log-prob lead of bf16's token", value,
                    kept_bf16=kept_by, which=which, bf16_margin=f["bf16_margin"], bf16_token=f["bf16_token"],
                    flipped_to=f["token"], **common)
            print(f"question {f['question']} position {f['position']}: kept bf16 {kept_by} {which or '-':>12}: "
                  f"lead {value:+.3f}", flush=True)
    for r in rec.records:
        r["seconds_total"] = round(time.perf_counter() - t_start, 1)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
