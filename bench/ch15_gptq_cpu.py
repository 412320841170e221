"""Chapter 15 on the CPU: GPTQ against round-to-nearest on SmolLM2, one scale a row in both (the kernels' format).
Records to book/data/ch15_gptq.json under the CPU's name.

    python bench/ch15_gptq_cpu.py [--answer-tokens 32] [--jitter-seeds 3]   (a few minutes on 2 cores)

Calibration: 38 chat questions of this script's own (none of ch15_accuracy_cpu.py's 20), bf16's greedy answers to
them (64 tokens at most, from LLM.chat on the CPU), teacher-forced through chapter 15's HessianProbe: XᵀX at the
input of each 8-bit matrix. Each format is then quantized three ways and measured exactly as
ch15_accuracy_cpu.py measures (the same 20 answers, the same prose of chapter 1):
- rtn: round to nearest (the engine's quantization=);
- gptq: chapter 15's gptq_quantize against the calibration's XᵀX;
- rtn_jitter_S: round to nearest under each row's scale times a random factor in [0.99, 1] (seed S): a different
  rounding of nearly every weight, how much the flip counts move by chance (it clips each row's largest weight by
  under 1%, which costs the prose's perplexity a few tenths of a percent; [1, 1.01] would clip nothing).
"""

import argparse
import time

import numpy as np
from ch08_decode_cpu import cpu_device_info
from ch15_accuracy_cpu import (
    QUESTIONS,
    ROOT,
    TEXT_SOURCE,
    chapter_prose,
    flips_against,
    summarize,
)

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, is_quantized
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.formats import (
    CODE_MAX,
    INT8_MAX,
    QuantizedTensor,
    fp8_e4m3_encode,
)
from tinyvllm_lib.quantization.gptq import HessianProbe, gptq_quantize

CALIBRATION_QUESTIONS = [
    "How do I make a cup of tea?", "What is the tallest mountain in the world?", "Translate 'good morning' into Spanish.",
    "List four musical instruments.", "What does a doctor do?", "Write a short poem about the moon.",
    "How many legs does a spider have?", "What is 15 plus 27?", "Explain gravity to a child.",
    "What is the chemical symbol for gold?", "Give me a tip for studying.", "Who painted the Mona Lisa?",
    "What is the difference between weather and climate?", "Describe a rainbow.", "Suggest a healthy breakfast.",
    "What is the main ingredient of bread?", "How does a bicycle work?", "Name a famous scientist.",
    "Why is exercise important?", "What is an adjective?", "Tell me a joke.", "How do bees make honey?",
    "What is the currency of Japan?", "Write one sentence about friendship.", "What are the three states of matter?",
    "How do I say thank you in French?", "What is a volcano?", "Recommend a book for children.",
    "What is the square root of 81?", "How many continents are there?", "What is the internet?",
    "Give an example of a mammal.", "How can I save money?", "What causes thunder?", "Explain what a noun is.",
    "What do plants need to grow?", "Describe a typical day at school.", "What is the speed of light?"]
assert not set(CALIBRATION_QUESTIONS) & set(QUESTIONS), "calibration must not be the test"


def jittered(w: np.ndarray, method: str, rng) -> QuantizedTensor:
    """Round to nearest under scales of max |w| / the largest code times U[0.99, 1] (nothing past a code's range)."""
    scales = (np.abs(w).max(1) / CODE_MAX[method] * rng.uniform(0.99, 1.0, len(w))).astype(np.float32)
    part = w / np.where(scales > 0, scales, 1)[:, None]
    codes = (np.clip(np.rint(part), -INT8_MAX, INT8_MAX).astype(np.int8) if method == "int8"
             else fp8_e4m3_encode(part.astype(np.float32)))
    return QuantizedTensor(method, codes, scales)


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
    llm = LLM(folder, device="cpu", max_model_len=512, max_num_seqs=len(CALIBRATION_QUESTIONS))

    def answers(questions, tokens, llm=llm):
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]

    chats = answers(QUESTIONS, args.answer_tokens)
    calibration = [np.array(p + a) for p, a in answers(CALIBRATION_QUESTIONS, args.calibration_tokens)]
    text_ids = np.array(llm.get_tokenizer().encode(chapter_prose(ROOT / TEXT_SOURCE))[: args.text_tokens])
    del llm

    def study(model):
        text = summarize(model.forward(text_ids)[:-1], text_ids[1:])
        got = []
        for prompt, answer in chats:
            ids = np.array(prompt + answer)
            got.append(summarize(model.forward(ids)[len(prompt) - 1 : len(ids) - 1], np.array(answer)))
        return text, got

    ref_text, ref_answers = study(LlamaNumpy(config, weights))
    ref_ppl = float(np.exp(-ref_text["target_lp"].mean()))
    t0 = time.perf_counter()
    probe = HessianProbe(config, weights)
    for ids in calibration:
        probe.forward(ids)
    hessians = probe.hessians
    calib = {"sequences": len(calibration), "tokens": int(sum(map(len, calibration))),
             "source": "38 chat questions (none of the 20 tested), bf16's greedy answers", "damp": 0.01}
    print(f"calibration: {calib['tokens']} tokens of {calib['sequences']} chats, XᵀX of {len(hessians)} matrices "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    names = [n for n in probe.matrices if is_quantized(n)]

    measure.device_info = cpu_device_info
    rec = measure.Recorder("ch15_gptq")
    common = {"model": "SmolLM2-135M-Instruct (dequantized from Q4_1, stored bf16)", "backend": "NumPy float32",
              "calibration": calib, "bf16_perplexity": ref_ppl}
    num_positions = sum(len(a) for _, a in chats)
    for method in ("int8", "fp8"):
        roundings = [("rtn", None), ("gptq", None)] + [(f"rtn_jitter_{s}", s) for s in range(args.jitter_seeds)]
        for rounding, seed in roundings:
            t0 = time.perf_counter()
            if rounding == "rtn":
                tensors = {}
            elif rounding == "gptq":
                tensors = {n: gptq_quantize(probe.matrices[n], hessians[n], method) for n in names}
            else:
                rng = np.random.default_rng(seed)
                tensors = {n: jittered(probe.matrices[n], method, rng) for n in names}
            t_quantize = time.perf_counter() - t0
            text, got = study(QuantizedLlamaNumpy(config, weights, method, tensors=tensors))
            ppl = float(np.exp(-text["target_lp"].mean()))
            flips = flips_against(got, ref_answers)
            dlogp = float(np.mean(np.concatenate([np.abs(g["target_lp"] - r["target_lp"])
                                                  for g, r in zip(got, ref_answers)])))
            text_dlogp = float(np.abs(text["target_lp"] - ref_text["target_lp"]).mean())
            extra = {"quantization": method, "rounding": rounding, "seconds_quantize": round(t_quantize, 1), **common}
            rec.add("text_perplexity", [text_ids.size - 1], "perplexity", ppl, ratio_to_bf16=ppl / ref_ppl,
                    mean_abs_dlogp=text_dlogp, source=TEXT_SOURCE, **extra)
            worst = max((f["bf16_margin"] for f in flips), default=0.0)
            rec.add("chat_flips", [len(chats), num_positions], "positions", len(flips), flips=flips,
                    largest_flip_margin=worst, mean_abs_dlogp=dlogp, **extra)
            sure = sum(f["bf16_margin"] > 0.5 for f in flips)
            print(f"{method} {rounding:>13}: {len(flips)} of {num_positions} top tokens differ, {sure} past a margin "
                  f"of 0.5 (largest {worst:.3f}); answers' |Δ log p| {dlogp:.4f}; prose perplexity "
                  f"{ppl / ref_ppl - 1:+.3%}, |Δ log p| {text_dlogp:.4f} (quantized in {t_quantize:.0f} s, "
                  f"{time.perf_counter() - t0:.0f} s in all)", flush=True)
    for r in rec.records:
        r["seconds_total"] = round(time.perf_counter() - t_start, 1)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
