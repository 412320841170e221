"""Chapter 11 under compute-sanitizer: a few graph-captured steps of the Llama 3.2 1B stand-in at its real
shapes (a prefill step of 256 tokens and a mixed one replaying prefill graphs, then decode graphs of 1, 2 and
4 rows), with greedy, seeded top-k/top-p,
min-p with penalties and log-probability rows, so every kernel of a captured step and the GPU log-prob kernel run, and
contexts long enough that decode attention's last split combines the others.

    compute-sanitizer --tool memcheck python3 bench/ch11_sanitize.py [--wheel TOKENIZER_WHEEL]
"""

import argparse
from pathlib import Path

import numpy as np

from tinyvllm_lib.engine.input_batch import StepShape
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.llama_standin import prepare_llama_standin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path)
    ap.add_argument("--max-tokens", type=int, default=6)
    args = ap.parse_args()
    folder = prepare_llama_standin(wheel=args.wheel)
    # a 256-token budget: the four prompts' 262 tokens take a prefill step and a mixed one
    llm = LLM(folder, device="cuda", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    runner = llm.llm_engine.model_runner
    graphs = {**runner.graphs.graphs, **runner.graphs.prefill_graphs,
              **{("argmax_only", n): g for n, g in runner.graphs.argmax_graphs.items()}}
    replays = dict.fromkeys(graphs, 0)
    for key, graph in graphs.items():
        def counted(graph=graph, key=key, replay=graph.replay):
            replays[key] += 1
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
    # then one greedy request alone: its decode steps replay the argmax_only graph
    outs += llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                         use_tqdm=False)
    for o in outs:
        print(len(o.outputs[0].token_ids), "tokens:", o.outputs[0].token_ids)
    print("graph replays:", {key: n for key, n in replays.items() if n})
    assert sum(n for key, n in replays.items() if isinstance(key, int)), "no decode step replayed a graph"
    assert sum(n for key, n in replays.items() if isinstance(key, StepShape)) >= 2, "prefill graphs replayed < 2"
    assert sum(n for key, n in replays.items() if isinstance(key, tuple) and key[:1] == ("argmax_only",)), \
        "no argmax_only graph replayed"


if __name__ == "__main__":
    main()
