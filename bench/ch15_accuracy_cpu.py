"""Chapter 15 on the CPU: what 8-bit weights do to SmolLM2's predictions, against its bf16 weights. Records to
book/data/ch15_accuracy.json under the CPU's name.

    python bench/ch15_accuracy_cpu.py [--text-tokens 2048] [--answer-tokens 32]   (a few minutes on 2 cores)

Every model is the NumPy backend (chapter 7's LlamaNumpy; the 8-bit ones are chapter 15's QuantizedLlamaNumpy, the
weights the engine's `quantization=` loads), teacher-forced: one forward pass over a whole sequence, log-softmax in
float64. Two studies:

- text: the markdown of chapters/01_bf16.py (the book's own prose, so nothing is downloaded), its first
  --text-tokens tokens: perplexity, and mean and largest |Δ log p| of each next token against bf16;
- chat: 20 questions in the chat template; bf16's greedy answer (--answer-tokens at most, from LLM.chat on the CPU)
  teacher-forced through every model; at each answer position bf16's top token, its top-two log-prob margin, and
  whether the 8-bit model's top token differs.

Each 8-bit format is measured with the LM head (the tied embedding) in bf16, the engine's choice, and in 8 bits; fp8
once more with the GPU's tensor-core GEMM path mirrored (its inputs quantized per token past 8 token vectors, W8A8:
in a teacher-forced pass that is every product, so it bounds what a prompt's prefill sees); and int8 with its inputs
rounded to int8 per token likewise, a what-if the GPU does not run (int8 tensor cores would need it).
"""

import argparse
import re
import time
from pathlib import Path

import numpy as np
from ch08_decode_cpu import cpu_device_info

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, is_quantized
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.calibration import greedy_chats
from tinyvllm_lib.quantization.formats import quantize

ROOT = Path(__file__).resolve().parent.parent
TEXT_SOURCE = "chapters/01_bf16.py"
QUESTIONS = [
    "What is the capital of France?", "Name three fruits.", "Who wrote Hamlet?", "What color is the sky?",
    "What is the largest ocean on Earth?", "How many days are in a week?", "What is 12 times 7?",
    "Give me a synonym for happy.", "What is photosynthesis?", "Write a haiku about the sea.",
    "Why do leaves change color in autumn?", "What is the boiling point of water?",
    "Explain what a computer program is.", "Suggest a name for a pet cat.", "What is the opposite of cold?",
    "How do airplanes stay in the air?", "What language is spoken in Brazil?", "Tell me a fun fact about owls.",
    "What is a prime number?", "How can I sleep better?",
]
# (label, quantization, the LM head in 8 bits too, fp8_gemm_tokens: past how many token vectors the products quantize
# their inputs to FP8 as the GPU's tensor-core path does (W8A8); None: never, the GEMV's W8A16)
VARIANTS = [("int8", "int8", False, None), ("fp8", "fp8", False, None), ("int8, head 8-bit", "int8", True, None),
            ("fp8, head 8-bit", "fp8", True, None), ("fp8, W8A8 past 8 tokens", "fp8", False, 8),
            ("int8, W8A8 past 8 tokens (not built)", "int8", False, 8)]


class Int8ActivationsNumpy(QuantizedLlamaNumpy):
    """A what-if the GPU does not run: int8 weights whose products past `tokens` token vectors also round their
    inputs to int8, one scale a token (absmax / 127), as an int8 tensor-core GEMM (W8A8) would need."""

    def __init__(self, *args, tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokens = tokens

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if len(x) > self.tokens and is_quantized(name, self.quantize_lm_head):
            x = quantize(bf16_bits_to_f32(f32_to_bf16_bits(x)), "int8").dequantize()
            return x @ self.matrices[name].T
        return super().linear(x, name)


def chapter_prose(path: Path) -> str:
    """The markdown cells of a jupytext percent chapter, as plain text (the leading '# ' of each line dropped)."""
    parts = re.split(r"^(# %%.*)$", path.read_text(encoding="utf-8"), flags=re.M)
    cells = [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]  # (header, body)
    return "\n\n".join("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                                  for line in body.strip().splitlines())
                        for header, body in cells if "[markdown]" in header)


def summarize(logits: np.ndarray, targets: np.ndarray, rows: int = 256) -> dict:
    """Per row of logits (float32): the target's log-prob, the top token, and the top-two log-prob margin
    (log-softmax in float64, a few rows at a time)."""
    out = {"target_lp": [], "top": [], "margin": []}
    for start in range(0, len(logits), rows):
        x = logits[start : start + rows].astype(np.float64)
        x -= x.max(axis=-1, keepdims=True)
        lp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
        top2 = np.sort(np.partition(lp, -2, axis=-1)[:, -2:], axis=-1)
        out["target_lp"].append(lp[np.arange(len(lp)), targets[start : start + rows]])
        out["top"].append(lp.argmax(-1))
        out["margin"].append(top2[:, 1] - top2[:, 0])
    return {k: np.concatenate(v) for k, v in out.items()}


def flips_against(answers: list[dict], ref_answers: list[dict]) -> list[dict]:
    """Each answer position where the model's top token (summarize's) differs from bf16's: which question and
    position, bf16's top-two margin there, and the two tokens."""
    return [{"question": i, "position": int(t), "bf16_margin": round(float(ref["margin"][t]), 4),
             "bf16_token": int(ref["top"][t]), "token": int(got["top"][t])}
            for i, (got, ref) in enumerate(zip(answers, ref_answers)) for t in np.flatnonzero(got["top"] != ref["top"])]


def study(model, text_ids: np.ndarray, chats: list[tuple[list[int], list[int]]]) -> tuple[dict, list[dict]]:
    """summarize() over the text's next tokens, and over each answer's positions (each chat teacher-forced alone)."""
    text = summarize(model.forward(text_ids)[:-1], text_ids[1:])
    answers = []
    for prompt, answer in chats:
        ids = np.array(prompt + answer)
        logits = model.forward(ids)[len(prompt) - 1 : len(ids) - 1]  # the rows that predict the answer
        answers.append(summarize(logits, np.array(answer)))
    return text, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-tokens", type=int, default=2048)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    folder = resolve_model("smollm2")
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)

    # bf16's greedy answers, from the engine as a user gets them
    llm = LLM(folder, device="cpu", max_model_len=512, max_num_seqs=len(QUESTIONS))
    chats = greedy_chats(llm, QUESTIONS, args.answer_tokens)
    text = chapter_prose(ROOT / TEXT_SOURCE)
    text_ids = np.array(llm.get_tokenizer().encode(text)[: args.text_tokens])
    print(f"{len(chats)} bf16 answers ({sum(len(a) for _, a in chats)} tokens); text: {text_ids.size} tokens of "
          f"{TEXT_SOURCE}'s prose", flush=True)

    t0 = time.perf_counter()
    ref_text, ref_answers = study(LlamaNumpy(config, weights), text_ids, chats)
    print(f"bf16 studied in {time.perf_counter() - t0:.0f} s", flush=True)
    num_targets = text_ids.size - 1
    ref_ppl = float(np.exp(-ref_text["target_lp"].mean()))
    num_positions = sum(len(a) for _, a in chats)
    greedy_agrees = sum(int((r["top"] == np.array(a)).sum()) for r, (_, a) in zip(ref_answers, chats))

    measure.device_info = cpu_device_info  # a CPU measurement: name the CPU, not a GPU
    rec = measure.Recorder("ch15_accuracy")
    common = {"model": "SmolLM2-135M-Instruct (dequantized from Q4_1, stored bf16)", "backend": "NumPy float32"}
    rec.add("text_perplexity", [num_targets], "perplexity", ref_ppl, quantization=None, lm_head_8bit=False,
            source=TEXT_SOURCE, **common)
    rec.add("chat_margins", [len(chats), num_positions], "positions", num_positions, quantization=None,
            lm_head_8bit=False, margins=[[round(float(m), 4) for m in r["margin"]] for r in ref_answers],
            greedy_equals_teacher_forced_top=greedy_agrees, questions=QUESTIONS,
            answers=[answer for _, answer in chats], **common)
    print(f"bf16: perplexity {ref_ppl:.4f} over {num_targets} tokens; teacher-forced top = engine's greedy token at "
          f"{greedy_agrees} of {num_positions} answer positions", flush=True)
    for label, method, head, gemm_tokens in VARIANTS:
        t0 = time.perf_counter()
        if method == "int8" and gemm_tokens is not None:
            model = Int8ActivationsNumpy(config, weights, method, quantize_lm_head=head, tokens=gemm_tokens)
        else:
            model = QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=head, fp8_gemm_tokens=gemm_tokens)
        text, answers = study(model, text_ids, chats)
        ppl = float(np.exp(-text["target_lp"].mean()))
        delta = np.abs(text["target_lp"] - ref_text["target_lp"])
        text_top1 = float(np.mean(text["top"] == ref_text["top"]))
        flips = flips_against(answers, ref_answers)
        answer_delta = np.concatenate([np.abs(got["target_lp"] - ref["target_lp"])
                                       for got, ref in zip(answers, ref_answers)])
        worst_flip = max((f["bf16_margin"] for f in flips), default=0.0)
        extra = {"quantization": method, "lm_head_8bit": head, "label": label, "w8a8_tokens": gemm_tokens, **common}
        rec.add("text_perplexity", [num_targets], "perplexity", ppl, ratio_to_bf16=ppl / ref_ppl,
                mean_abs_dlogp=float(delta.mean()), max_abs_dlogp=float(delta.max()), top1_agreement=text_top1,
                source=TEXT_SOURCE, **extra)
        rec.add("chat_flips", [len(chats), num_positions], "positions", len(flips), flips=flips,
                largest_flip_margin=worst_flip, mean_abs_dlogp=float(answer_delta.mean()), **extra)
        print(f"{label:>16}: perplexity {ppl:.4f} ({ppl / ref_ppl - 1:+.2%}), mean |Δ log p| {delta.mean():.4f}, "
              f"text top-1 agreement {text_top1:.2%}; chat: {len(flips)} of {num_positions} top tokens differ, "
              f"largest bf16 margin among them {worst_flip:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for r in rec.records:
        r["seconds_total"] = round(time.perf_counter() - t_start, 1)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")


if __name__ == "__main__":
    main()
