"""Chapter 11 on the GPU, for iterating: batch 1 on the Llama 3.2 1B stand-in, graphs + overlap, as
bench/ch11_llama.py measures it (decode tok/s over 3 runs, and the decode graph replayed back to back at 256
tokens), printed and not recorded. Compare two versions of a kernel in one device call: run it, change the
code, run it again.

    python bench/ch11_bs1_check.py [--wheel TOKENIZER_WHEEL] [--label NAME]        (~30 s on an H200)
"""

import argparse
import json
from pathlib import Path

from ch11_llama import MAX_MODEL_LEN, graph_kernel_ms

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.models.llama_standin import prepare_llama_standin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--label", default="", help="a name for this version, printed with the numbers")
    args = ap.parse_args()
    llm = LLM(prepare_llama_standin(wheel=args.wheel), device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    lat = benchmark.latency(llm, 128, 256, repeats=3)
    replay = graph_kernel_ms(llm.llm_engine.model_runner, 1, 256, argmax_only=True)
    print(json.dumps({"label": args.label, "decode_tok_s": round(lat["decode_tok_s"], 1),
                      "graph_replay_ms": round(replay, 4)}))


if __name__ == "__main__":
    main()
