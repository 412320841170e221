"""Chapter 11's benchmark functions and `python -m tinyvllm_lib bench`, on the CPU with a tiny model:
what they count and report, not how fast."""

import json

import numpy as np
import pytest

from tinyvllm_lib import benchmark
from tinyvllm_lib.cli import main
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("bench"), tiny_llama_config(vocab_size=256), seed=3)


def test_nano_vllm_workload_is_seeded_and_in_range():
    prompts, outs = benchmark.nano_vllm_workload(256, 100, 1024, seed=0, vocab_size=1000)
    again, outs2 = benchmark.nano_vllm_workload(256, 100, 1024, seed=0, vocab_size=1000)
    assert prompts == again and outs == outs2
    lens = np.array([len(p) for p in prompts])
    assert lens.min() >= 100 and lens.max() <= 1024 and min(outs) >= 100 and max(outs) <= 1024
    assert max(max(p) for p in prompts) < 1000
    # chapter 9's benchmark drew the same requests: prompt lengths, then output lengths, then ids
    rng = np.random.default_rng(0)
    assert lens.tolist() == rng.integers(100, 1025, 256).tolist() and outs == rng.integers(100, 1025, 256).tolist()
    assert benchmark.nano_vllm_workload(8, seed=1)[1] != benchmark.nano_vllm_workload(8, seed=0)[1]


def test_latency_and_throughput_count_what_they_ran(folder):
    llm = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=8)
    lat = benchmark.latency(llm, prompt_len=10, new_tokens=6, repeats=2)
    assert lat["ttft_ms"] > 0 and lat["decode_tok_s"] > 0 and 0 < lat["e2e_tok_s"]
    assert lat["ttft_ms"] / 1e3 < lat["seconds"]  # the first token comes before the last
    assert abs(lat["e2e_tok_s"] * lat["seconds"] - 6) < 1e-6
    assert not llm.llm_engine.has_unfinished_requests()
    load = benchmark.throughput(llm, num_requests=5, min_len=3, max_len=20)
    prompts, outs = benchmark.nano_vllm_workload(5, 3, 20, vocab_size=256)
    assert load["output_tokens"] == sum(outs) and load["prompt_tokens"] == sum(map(len, prompts))
    assert load["output_tok_s"] == pytest.approx(sum(outs) / load["seconds"])
    # repeats: the median run, each on an empty prefix cache (no run reads the one before's blocks)
    cached_before = llm.llm_engine.stats.num_cached_prompt_tokens
    calls = []
    load = benchmark.throughput(llm, num_requests=5, min_len=3, max_len=20, repeats=3,
                                before_run=lambda: calls.append(llm.llm_engine.block_manager.num_cached_free_blocks))
    runs = load["runs_output_tok_s"]
    assert len(runs) == 3 and load["output_tok_s"] == sorted(runs)[1]
    assert calls == [0, 0, 0] and load["num_steps"] > 0
    # the warm-up went past one step's token budget (8 x 128 here), on prompts the runs do not share
    assert load["warm_up_requests"] >= 2
    assert llm.llm_engine.stats.num_cached_prompt_tokens == cached_before


def test_bench_command_prints_and_writes_json(folder, tmp_path, capsys):
    out = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", str(folder), "--device", "cpu", "--max-model-len", "64"]
    assert main(args + ["--input-len", "8", "--output-len", "4", "--repeats", "1", "--json", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("latency on cpu (NumPy): time to first token") and "decode" in line
    assert set(json.loads(out.read_text())) >= {"ttft_ms", "decode_tok_s", "e2e_tok_s"}
    # nano-vllm's prompts (up to 1,024 tokens) do not fit max_model_len 64: a clear error, not a traceback
    with pytest.raises(SystemExit, match="error: .*max_model_len"):
        main(["bench", "throughput", "--model", str(folder), "--device", "cpu", "--max-model-len", "64",
              "--max-num-seqs", "4", "--num-prompts", "3"])
