"""Chapter 11 under compute-sanitizer: a few graph-captured decode steps of the Llama 3.2 1B stand-in at
its real shapes (prefill eager, then decode graphs of 1, 2 and 4 rows), with greedy, seeded top-k/top-p,
min-p with penalties and log-probability rows, so every kernel of a captured step and the GPU log-prob kernel run, and
contexts long enough that decode attention's last split combines the others.

    compute-sanitizer --tool memcheck python3 bench/ch11_sanitize.py [--wheel TOKENIZER_WHEEL]
"""

import argparse
from pathlib import Path

import numpy as np

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.llama_standin import prepare_llama_standin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path)
    ap.add_argument("--max-tokens", type=int, default=6)
    args = ap.parse_args()
    folder = prepare_llama_standin(wheel=args.wheel)
    llm = LLM(folder, device="cuda", max_model_len=256, max_num_seqs=4)
    runner = llm.llm_engine.model_runner
    replays = {rows: 0 for rows in runner.graphs.graphs}
    for rows, graph in runner.graphs.graphs.items():
        def counted(graph=graph, rows=rows, replay=graph.replay):
            replays[rows] += 1
            replay()
        graph.replay = counted
    rng = np.random.default_rng(0)
    # 40 and 200 tokens: decode attention splits their contexts (2 and 9 splits), so the last split combines
    prompts = [rng.integers(0, 128000, n).tolist() for n in (17, 40, 5, 200)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=args.max_tokens - 2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=args.max_tokens + 2, logprobs=20, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, seed=3, max_tokens=args.max_tokens, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        print(len(o.outputs[0].token_ids), "tokens:", o.outputs[0].token_ids)
    print("graph replays by size:", replays)
    assert sum(replays.values()) > 0, "no decode step replayed a graph"


if __name__ == "__main__":
    main()
