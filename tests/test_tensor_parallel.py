"""Chapter 13: tensor parallelism. On CPU ranks (one process each, the NumPy backend) the split model gives one
rank's tokens, and in the CUDA simulator the GPU runner's shards do too; sizes that do not divide are refused before
any process starts; a rank that dies ends the engine with an error, and leaves no process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from compare import agrees, shared_logprob_gaps

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.distributed.sharding import (
    shard_config,
    shard_llama_weights,
    vocab_shard,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import fuse_llama_weights
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.runtime import is_simulator

TIMEOUT = 3.0  # seconds a collective waits for a rank, in these tests
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """8 query and 4 KV heads (so 2 and 4 ranks divide them), a vocabulary of 250 (4 ranks pad it to 252)."""
    config = tiny_llama_config(num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=250)
    return make_random_llama(tmp_path_factory.mktemp("tp_llama"), config, seed=13)


def generate(folder, n, prompts, params, device="cpu", **engine_args):
    llm = LLM(str(folder), device, tensor_parallel_size=n, distributed_timeout=30, **engine_args)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def assert_same_completions(ref, out, tie=1e-4, max_gap=1e-4):
    """Greedy tokens equal up to a near tie of the reference's top two (the all-reduce sums in another order), and
    the shared tokens' log-probabilities within max_gap."""
    checks = [agrees(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].token_ids, tie)
              for a, b in zip(ref, out)]
    gaps = np.concatenate([shared_logprob_gaps(a.outputs[0], b.outputs[0]) for a, b in zip(ref, out)])
    print(f"{sum(t for _, t in checks)} of {len(checks)} stopped at a near tie; largest |Δ log p| {gaps.max():.2e} "
          f"over {gaps.size} tokens")
    assert all(same for same, _ in checks)
    assert gaps.size > 0 and gaps.max() < max_gap


def test_shards_put_back_together_are_the_model(folder):
    """The ranks' q, k, v heads, gate/up rows and o/down columns, put side by side, are the whole fused tensors; the
    head's shards are the vocabulary padded with zero rows."""
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    whole = fuse_llama_weights(weights, config)
    n = 4
    shards = [fuse_llama_weights(shard_llama_weights(weights, config, r, n), shard_config(config, n))
              for r in range(n)]
    D, H, KVH = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    qkv = whole["layers.1.qkv_proj"]
    q, k, v = np.split(qkv, [H * D, (H + KVH) * D])
    for r, s in enumerate(shards):  # rank r: its query heads, then its KV heads' k and v
        h, kvh = H // n, KVH // n
        mine = np.concatenate([q[r * h * D:(r + 1) * h * D], k[r * kvh * D:(r + 1) * kvh * D],
                               v[r * kvh * D:(r + 1) * kvh * D]])
        np.testing.assert_array_equal(s["layers.1.qkv_proj"], mine)
    np.testing.assert_array_equal(np.concatenate([s["layers.0.o_proj"] for s in shards], 1), whole["layers.0.o_proj"])
    np.testing.assert_array_equal(np.concatenate([s["layers.0.down_proj"] for s in shards], 1),
                                  whole["layers.0.down_proj"])
    head = np.concatenate([s["lm_head"] for s in shards])
    assert head.shape[0] == 252
    np.testing.assert_array_equal(head[:250], whole["lm_head"])
    assert not head[250:].any()
    np.testing.assert_array_equal(vocab_shard(np.arange(10).reshape(5, 2), 2, 3), [[8, 9], [0, 0]])


@pytest.mark.parametrize("n", [2, 4])
def test_random_llama_on_n_ranks_gives_one_ranks_tokens(folder, n):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(40, 59)), [3]]
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    # rank 0 samples with the penalties; the other ranks are sent the batch without them
    penalized = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True,
                               repetition_penalty=1.3, presence_penalty=0.5)
    params = [greedy, greedy, greedy, penalized]
    ref = generate(folder, 1, prompts, params, max_num_seqs=4)
    out = generate(folder, n, prompts, params, max_num_seqs=4)
    assert_same_completions(ref, out)


def test_smollm2_on_three_ranks_gives_one_ranks_tokens():
    """SmolLM2's 9 query and 3 KV heads, and 1,536 MLP columns, over 3 ranks."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    ref = generate("smollm2", 1, prompts, params, max_num_seqs=2, max_model_len=256)
    out = generate("smollm2", 3, prompts, params, max_num_seqs=2, max_model_len=256)
    assert_same_completions(ref, out)


@pytest.mark.parametrize(("n", "overrides", "named"), [
    (4, {}, "num_key_value_heads = 2"),
    (3, {}, "num_attention_heads = 4, num_key_value_heads = 2, intermediate_size = 128"),
    (2, {"intermediate_size": 129}, "intermediate_size = 129"),
])
def test_sizes_that_do_not_divide_are_a_value_error(tmp_path, n, overrides, named):
    folder = make_random_llama(tmp_path, tiny_llama_config(**overrides))  # 4 query, 2 KV heads
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=f"tensor_parallel_size = {n} must divide.*{named}"):
        LLM(str(folder), "cpu", tensor_parallel_size=n)
    assert psutil.Process().children(recursive=True) == before  # refused before any rank started


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_ends_generate_with_an_error(folder, how):
    """SIGKILL: the others see the connection close at once; SIGSTOP (alive, silent): the collective times out.
    Either way generate raises within the timeout and no rank's process is left."""
    llm = LLM(str(folder), "cpu", tensor_parallel_size=2, distributed_timeout=TIMEOUT, max_num_seqs=2)
    executor = llm.llm_engine.model_runner
    pids = [p.pid for p in executor.processes]
    run, steps = executor.driver.execute_batch, []

    def execute_batch(batch):  # rank 0's third step: rank 1 goes away after it got the step
        steps.append(1)
        if len(steps) == 3:
            os.kill(pids[0], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        return run(batch)

    executor.driver.execute_batch = execute_batch
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="tensor parallelism: a collective failed"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - t0
    print(f"rank 1 {how}: generate raised after {seconds:.2f} s (timeout {TIMEOUT} s)")
    assert len(steps) == 3
    assert seconds < TIMEOUT + 0.5  # at most the collective's timeout, and a kill
    assert not any(psutil.pid_exists(pid) for pid in pids)
    llm.llm_engine.shutdown()  # a second stop does nothing


def test_cli_answers_paris_on_three_ranks():
    out = subprocess.run(
        [sys.executable, "-m", "tinyvllm_lib", "generate", "What is the capital of France?", "--chat",
         "--device", "cpu", "--tensor-parallel-size", "3", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    print(out.stdout, out.stderr[-300:])
    assert out.returncode == 0
    assert "Paris" in out.stdout


@pytest.mark.skipif(not is_simulator(), reason="the simulator's test: on a GPU the two-GPU issue runs NCCL")
def test_cuda_runner_on_two_ranks_equals_one_in_the_simulator(tmp_path, monkeypatch):
    """The GPU model's shards over the gloo communicator, with grouped heads (4 query heads over 2 KV heads: each
    rank's 2 query heads share its 1 KV head): rank 0 adds the residual in o_proj and down_proj, rank 1 writes its
    part alone, and the all-reduce sums them (test_cuda_model_adds_the_residual_on_rank_0_only checks the sum's
    parts); the tokens and log-probs are one rank's."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    config = tiny_llama_config(vocab_size=40, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    folder = make_random_llama(tmp_path, config, seed=5)
    engine = dict(max_num_seqs=1, max_model_len=16, max_num_batched_tokens=8, num_kv_blocks=4, block_size=4,
                  enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2)  # the runner-up: near ties are seen
    ref = generate(folder, 1, [[5, 6, 7]], params, "cuda", **engine)
    out = generate(folder, 2, [[5, 6, 7]], params, "cuda", **engine)
    assert_same_completions(ref, out)


class FirstAllReduce(Exception):
    """Raised by Recording at the model's first all-reduce: what it was handed."""


class Recording:
    """A communicator of one rank among two that records its first all-reduce's input and stops the pass there."""

    def __init__(self, rank):
        self.rank, self.world_size = rank, 2

    def all_reduce(self, x, stream=0):
        raise FirstAllReduce(x.copy_to_host())


@pytest.mark.skipif(not is_simulator(), reason="the simulator's test of the GPU model")
def test_cuda_model_adds_the_residual_on_rank_0_only(tmp_path):
    """o_proj accumulates into the residual on rank 0 and overwrites it elsewhere: the buffers the first all-reduce
    sums differ by exactly the embedding rows, so the sum holds the residual once."""
    from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
    from tinyvllm_lib.models.llama_cuda import LlamaCuda

    config = tiny_llama_config(vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    folder = make_random_llama(tmp_path, config, seed=3)
    full = ModelConfig.from_folder(folder)
    weights = shard_llama_weights(load_weights(folder, full, progress=False), full, 0, 2, split_embedding=False)
    ids = [5, 17, 33]
    sent = {}
    for rank in (0, 1):  # the same shard on both: only what the rank adds differs
        with pytest.raises(FirstAllReduce) as stop:
            LlamaCuda(shard_config(full, 2), weights, comm=Recording(rank)).forward(ids)
        sent[rank] = stop.value.args[0]
    embedding = bf16_bits_to_f32(weights["model.embed_tokens.weight"][ids])
    # rank 0: fl(embedding + partial), in float32 as the GEMV's epilogue adds; rank 1: the partial alone
    np.testing.assert_array_equal(sent[0], embedding.astype(np.float32) + sent[1])
    assert np.abs(sent[1]).max() > 0  # rank 1 sent its partial o_proj, not zeros


def test_torchrun_starts_the_ranks_instead(folder, tmp_path):
    """Under torchrun (RANK, WORLD_SIZE set) the same LLM call starts no process: rank 0 drives, rank 1 serves its
    steps and ends."""
    import socket

    script = tmp_path / "generate.py"
    script.write_text(
        "import os\n"
        "from tinyvllm_lib import LLM, SamplingParams\n"
        f"llm = LLM({str(folder)!r}, 'cpu', max_num_seqs=2, tensor_parallel_size=2, distributed_timeout=30)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)\n"
        "print('tokens', out[0].outputs[0].token_ids, flush=True)\n"
        "llm.llm_engine.shutdown()\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(script)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    print(run.stdout, run.stderr[-500:])
    assert run.returncode == 0
    lines = [line for line in run.stdout.splitlines() if line.startswith("tokens")]
    one = generate(folder, 1, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert lines == [f"tokens {one[0].outputs[0].token_ids}"]  # rank 0 only: rank 1 never returned from LLM()
