"""Chapter 15 on the CPU: SmolLM2's 8-bit checkpoints, measured through the engine's loader. Records to
book/data/ch15_checkpoint.json under the CPU's name.

    python bench/ch15_checkpoint_cpu.py [--roundings gptq rtn] [--keep DIR]   (about 20 minutes on 2 cores)

For each format (int8, fp8) and rounding, quantize_folder — what `python -m tinyvllm_lib quantize` runs, GPTQ
calibrating on its own chat — writes a checkpoint of SmolLM2 into a temporary folder (or under --keep, outside the
repository); LLM(checkpoint, device="cpu") loads it, and the model the engine built is measured exactly as
ch15_gptq_cpu.py measures the roundings it keeps in memory (its record_accuracy: the same 20 answers, the same
prose). With the same calibration the figures equal book/data/ch15_gptq.json's to the last digit; the script says
where they do not. Also recorded: the seconds to quantize, to start LLM on the checkpoint, on the bf16 folder with
quantization= (round to nearest as it loads) and in bf16 (the best of three starts each), and the bytes on disk.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from ch08_decode_cpu import cpu_device_info
from ch15_gptq_cpu import MODEL, bf16_reference, record_accuracy

import tinyvllm_lib.measure as measure
from tinyvllm_lib import LLM
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.quantization.quantizer import quantize_folder

COMPARED = {"text_perplexity": ("value", "ratio_to_bf16", "mean_abs_dlogp"),
            "chat_flips": ("value", "largest_flip_margin", "mean_abs_dlogp")}


def best_start(folder, repeats: int = 3, **kwargs) -> tuple[float, LLM]:
    """The fewest seconds LLM(folder, device="cpu", ...) took to start, of `repeats` starts, and the last engine."""
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm = LLM(folder, device="cpu", max_model_len=512, max_num_seqs=1, **kwargs)
        seconds.append(time.perf_counter() - t0)
    return min(seconds), llm


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())


def in_memory_differences(records: list[dict], device: str) -> list[str]:
    """Where these records differ from ch15_gptq.json's (measured in memory) for the same format and rounding: this
    CPU's records where there are some, else another CPU's (named). Empty: equal to the last digit."""
    theirs = {}
    for r in measure.load_records("ch15_gptq"):
        key = (r["name"], r["quantization"], r["rounding"])
        if key not in theirs or r["device"]["name"] == device:
            theirs[key] = r
    out = []
    for r in records:
        key = (r["name"], r.get("quantization"), r.get("rounding"))
        if r["name"] not in COMPARED:
            continue
        if key not in theirs:
            out.append(f"{key}: not in ch15_gptq.json")
            continue
        where = theirs[key]["device"]["name"]
        for field in COMPARED[r["name"]]:
            if r[field] != theirs[key][field]:
                out.append(f"{key} {field}: {r[field]!r} here, {theirs[key][field]!r} in memory on {where}")
        if r["name"] == "chat_flips" and [(f["question"], f["position"]) for f in r["flips"]] != [
                (f["question"], f["position"]) for f in theirs[key]["flips"]]:
            out.append(f"{key}: the flipped positions differ from those in memory on {where}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-tokens", type=int, default=2048)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--roundings", nargs="+", default=["gptq", "rtn"], choices=["gptq", "rtn"])
    ap.add_argument("--keep", type=Path, help="write the checkpoints here (outside the repository) and keep them")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    folder = resolve_model("smollm2")
    config = ModelConfig.from_folder(folder)
    ref = bf16_reference(folder, config, load_weights(folder, config, progress=False), args.answer_tokens,
                         args.text_tokens)
    print(f"bf16 studied: prose perplexity {ref.perplexity:.4f} ({time.perf_counter() - t_start:.0f} s)", flush=True)

    measure.device_info = cpu_device_info
    rec = measure.Recorder("ch15_checkpoint")
    common = {"model": MODEL, "backend": "NumPy float32", "bf16_perplexity": ref.perplexity}
    seconds, _ = best_start(folder)
    rec.add("start_seconds", [], "s", seconds, quantization=None, rounding=None, folder_bytes=folder_bytes(folder),
            **common)
    print(f"bf16: LLM starts in {seconds:.2f} s; the folder holds {folder_bytes(folder) / 1e6:.1f} MB", flush=True)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ch15_checkpoint_"))
    for method in ("int8", "fp8"):
        seconds, _ = best_start(folder, quantization=method)
        rec.add("start_seconds", [], "s", seconds, quantization=method, rounding="rtn_at_load",
                folder_bytes=folder_bytes(folder), **common)
        print(f"{method} rounded as the bf16 folder loads: LLM starts in {seconds:.2f} s", flush=True)
        for rounding in args.roundings:
            t0 = time.perf_counter()
            checkpoint = quantize_folder(folder, work / f"smollm2-{method}-{rounding}", method, rounding)
            t_quantize = time.perf_counter() - t0
            qc = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
            seconds, llm = best_start(checkpoint)
            model = llm.llm_engine.model_runner.model  # the model the engine built from the checkpoint
            assert isinstance(model, QuantizedLlamaNumpy) and llm.llm_engine.engine_config.quantization == method
            extra = {"quantization": method, "rounding": rounding, "quantization_config": qc,
                     "seconds_quantize": round(t_quantize, 1), **common}
            rec.add("start_seconds", [], "s", seconds, folder_bytes=folder_bytes(checkpoint), **extra)
            line = record_accuracy(rec, model, ref, **extra)
            print(f"{method} {rounding} checkpoint ({folder_bytes(checkpoint) / 1e6:.1f} MB, quantized in "
                  f"{t_quantize:.0f} s, LLM starts in {seconds:.2f} s): {line}", flush=True)
            del llm, model
    for r in rec.records:
        r["seconds_total"] = round(time.perf_counter() - t_start, 1)
    differences = in_memory_differences(rec.records, rec.device["name"])
    devices = sorted({r["device"]["name"] for r in measure.load_records("ch15_gptq")})
    print("\n".join(differences) or f"every figure equals ch15_gptq.json's, measured in memory ({', '.join(devices)})",
          flush=True)
    if not args.no_save:
        print(f"recorded {len(rec.records)} measurements in {rec.save()}")
    if args.keep is None:
        import shutil

        shutil.rmtree(work)


if __name__ == "__main__":
    main()
