"""Chapter 08b's model runner: device="cuda" against device="cpu" on the same steps (in the simulator on a tiny
random Llama), the LM head's row gather, the GPU sampler, and on a GPU: no allocation in a decode step,
SmolLM2 and a 1B-shaped model."""

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.input_batch import InputBatch
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplingMetadata
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.kernels.gather import gather_rows
from tinyvllm_lib.models.random_llama import (
    LLAMA_3_2_1B_CONFIG,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.runtime import can_launch, has_gpu

needs_kernels = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
TINY = tiny_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=16, vocab_size=64)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("tiny"), TINY, seed=5)


def new_request(rid: str, prompt, **params) -> Request:
    p = SamplingParams(**({"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 5} | params))
    return Request(rid, None, prompt, p, p.max_tokens, eos_token_ids=[2], generator=np.random.default_rng(p.seed))


def run_steps(runner: ModelRunner, alloc: ContiguousAllocator, prompts: list[list[int]], num_decodes: int, **params):
    """Prefill the prompts in one step, then decode them together: per request its tokens and each step's
    {token: log-prob} (chosen + top 5), and the prompt log-probs (the runner's output for the first step)."""
    requests = [new_request(str(i), p, **params) for i, p in enumerate(prompts)]
    tables = alloc.block_tables([alloc.allocate() for _ in requests])
    prompt_logprobs = None
    for step_index in range(num_decodes + 1):
        num_new = [r.num_tokens - r.num_computed_tokens for r in requests]
        out = runner.execute(SchedulerOutput(requests, num_new, len(requests) if step_index == 0 else 0, tables))
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        for i, r in enumerate(requests):
            r.num_computed_tokens += num_new[i]
            s = out.sampled
            r.append_token(s.token_ids[i], s.logprobs[i], s.top_ids[i], s.top_logprobs[i])
    return requests, prompt_logprobs


def compare_runners(folder, prompts, num_decodes, max_model_len=32, attention_backend="auto", decode_kernel=None,
                    **params):
    """The same steps on the CPU (float32 cache) and on 'cuda' (bf16): greedy tokens and log-probs agree.
    decode_kernel: the decode launcher the 'cuda' runner must have picked."""
    results = []
    for device in ("cpu", "cuda"):
        alloc = ContiguousAllocator(len(prompts), max_model_len)
        config = EngineConfig(device=device, block_size=alloc.block_size, max_num_seqs=len(prompts),
                              max_num_batched_tokens=64, max_model_len=max_model_len,
                              attention_backend=attention_backend)
        runner = ModelRunner(folder, config, alloc.num_slots)
        if device == "cuda" and decode_kernel is not None:
            assert runner.decode_attention is decode_kernel
        results.append(run_steps(runner, alloc, prompts, num_decodes, **params))
    (ref, ref_prompt), (ours, our_prompt) = results
    gaps = []
    for a, b in zip(ref, ours):
        assert a.output_token_ids == b.output_token_ids
        for sa, sb in zip(a.logprobs, b.logprobs):  # each step: the chosen token and the reference's top 5
            gaps += [abs(sa[k] - sb[k]) for k in sa if k in sb]
    print(f"|Δ log p| over the chosen and top-5 tokens: mean {np.mean(gaps):.4f}, max {np.max(gaps):.4f}")
    assert np.mean(gaps) <= 0.05  # chapter 7's rule for bf16 kernels against float32 NumPy
    return ref_prompt, our_prompt


@needs_kernels
def test_cuda_runner_matches_cpu(tiny_folder, monkeypatch):
    # The simulator runs every GPU thread as a Python thread: two short prompts, one decode step.
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    prompts, steps = ([[5, 17, 33], [9, 2]], 1) if not has_gpu() else ([[5, 17, 33, 60, 8, 41], [9, 2], [1]], 4)
    ref_prompt, our_prompt = compare_runners(tiny_folder, prompts, steps, prompt_logprobs=0)
    for a, b in zip(ref_prompt, our_prompt):  # the prompt rows gathered for the head (prompt_logprobs=0)
        assert a[1] is None and b[1] is None  # no top tokens asked for
        assert a[0].shape == b[0].shape and np.abs(a[0] - b[0]).max() < 0.1


@needs_kernels
def test_cuda_runner_on_tensor_cores_matches_cpu(tiny_folder, monkeypatch):
    """Chapter 14: prefill and decode attention on the tensor cores (their twins in the simulator)."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    prompts, steps = ([[5, 17, 33], [9, 2]], 1) if not has_gpu() else ([[5, 17, 33, 60, 8, 41], [9, 2], [1]], 4)
    from tinyvllm_lib.kernels.tc_decode import tc_decode_attention

    compare_runners(tiny_folder, prompts, steps, attention_backend="tensor_cores",
                    decode_kernel=tc_decode_attention)


def test_attention_backend_is_checked(tiny_folder):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    folder_40 = tiny_llama_config(head_dim=40)
    from tinyvllm_lib.kernels.tc_attention import prefill_attention_for

    with pytest.raises(ValueError, match="multiple of 16"):
        prefill_attention_for("tensor_cores", folder_40["head_dim"])


def test_input_batch_from_a_step():
    alloc = ContiguousAllocator(3, 32, block_size=16)
    first, second = new_request("a", [4, 5, 6], prompt_logprobs=1), new_request("b", [7, 8])
    first.num_computed_tokens = 0
    second.output_token_ids, second.num_computed_tokens = [9], 2  # decoding: its output token 9 is new
    inputs = InputBatch.from_step(SchedulerOutput([first, second], [3, 1], 1, alloc.block_tables([0, 2])), 16)
    np.testing.assert_array_equal(inputs.token_ids, [4, 5, 6, 9])
    np.testing.assert_array_equal(inputs.positions, [0, 1, 2, 2])
    np.testing.assert_array_equal(inputs.metadata.slot_mapping, [0, 1, 2, 2 * 32 + 2])
    np.testing.assert_array_equal(inputs.logits_indices, [2, 3, 0, 1, 2])  # last rows first, then a's prompt rows
    assert inputs.prompt_rows == {0: slice(2, 5)}
    # each prompt row predicts the prompt's next token (the last row, past the prompt: 0, dropped later)
    targets, k = inputs.prompt_targets[0]
    np.testing.assert_array_equal(targets, [5, 6, 0])
    assert k == 1 and list(inputs.prompt_targets) == [0]
    assert inputs.num_sampled == 2 and not inputs.is_uniform_decode
    # planned ahead (chapter 11): one position further, its id left to the GPU
    ahead = InputBatch.from_step(SchedulerOutput([second], [1], 0, alloc.block_tables([2]), np.array([0])), 16)
    np.testing.assert_array_equal(ahead.token_ids, [0])
    np.testing.assert_array_equal(ahead.positions, [3])
    np.testing.assert_array_equal(ahead.metadata.seq_lens, [4])
    assert ahead.is_uniform_decode and ahead.prev_rows.tolist() == [0]


@needs_kernels
def test_gather_rows(rng):
    src = rng.integers(0, 2**16, (9, 40)).astype(np.uint16)
    idx = np.array([8, 0, 3, 3], np.int64)
    out = cuda.device_array((4, 40), np.uint16)
    gather_rows(cuda.to_device(src), cuda.to_device(idx), out)
    np.testing.assert_array_equal(out.copy_to_host(), src[idx])
    with pytest.raises(ValueError, match="rows of src"):
        gather_rows(src, np.array([9], np.int64), np.zeros((1, 40), np.uint16))
    with pytest.raises(TypeError, match="int64"):
        gather_rows(src, idx.astype(np.int32), np.zeros((4, 40), np.uint16))


def test_runner_refuses_a_step_too_large(tiny_folder):
    runner = ModelRunner(tiny_folder, EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32), 64)
    step = SchedulerOutput([new_request("a", list(range(9)))], [9], 1, np.zeros((1, 2), np.int32))
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        runner.execute(step)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="device"):  # the runner takes a resolved device only
        ModelRunner(tiny_folder, EngineConfig(device="auto", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32))


# In the simulator generation through the sampler kernels is slow: these run on a GPU only.


@pytest.mark.gpu
def test_decode_step_allocates_no_device_memory(tiny_folder, monkeypatch):
    from numba.cuda.cudadrv.driver import Context

    alloc = ContiguousAllocator(8, 64)
    runner = ModelRunner(tiny_folder, EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), alloc.num_slots)
    requests = [new_request(str(i), [3 + i, 4, 5], max_tokens=30, logprobs=None, temperature=0.7 if i % 2 else 0, seed=i)
                for i in range(8)]
    tables = alloc.block_tables([alloc.allocate() for _ in requests])

    def step(num_prefills):
        num_new = [r.num_tokens - r.num_computed_tokens for r in requests]
        out = runner.execute(SchedulerOutput(requests, num_new, num_prefills, tables))
        for i, r in enumerate(requests):
            r.num_computed_tokens += num_new[i]
            r.append_token(out.sampled.token_ids[i])

    step(8)
    step(0)  # warm-up: compile every decode kernel
    calls, memalloc = [], Context.memalloc
    free_before = cuda.current_context().get_memory_info().free
    monkeypatch.setattr(Context, "memalloc", lambda self, size: calls.append(size) or memalloc(self, size))  # count
    for _ in range(10):
        step(0)
    monkeypatch.undo()
    cuda.synchronize()
    assert calls == [], f"decode steps allocated {calls}"
    assert cuda.current_context().get_memory_info().free == free_before


@pytest.mark.gpu
def test_gpu_sampler_greedy_and_seeds(rng):
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    logits = rng.standard_normal((3, 256)).astype(np.float32)
    sampler = CudaSampler(256, 4)
    greedy = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 3, [rng] * 3)
    assert list(sampler(logits, greedy).token_ids) == list(logits.argmax(1))
    params = [SamplingParams(temperature=0.8, top_k=20, seed=3), SamplingParams(top_p=0.5, seed=3), SamplingParams(temperature=0)]

    def draw(seed):
        gens = [np.random.default_rng(seed) for _ in params]
        return list(sampler(logits, SamplingMetadata.from_params(params, gens)).token_ids)

    first = draw(11)
    assert first == draw(11) and first[2] == logits[2].argmax()
    kept_k = np.argsort(-logits[0])[:20]
    assert first[0] in kept_k


@pytest.mark.gpu
def test_gpu_sampler_distribution():
    """Chi-square against the NumPy sampler's target distribution, T = 0.7, top-k 5, top-p 0.9 (8 logits)."""
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    z = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    num = 20_000
    sampler = CudaSampler(8, num)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    gen = np.random.default_rng(1)
    got = sampler(np.tile(z, (num, 1)), SamplingMetadata.from_params([params] * num, [gen] * num)).token_ids
    p = np.exp(z[:5] / 0.7 - (z[:5] / 0.7).max())
    p /= p.sum()
    keep = (np.cumsum(p) - p) < 0.9
    expected = np.where(keep, p, 0) / p[keep].sum()
    counts = np.bincount(got, minlength=8)
    assert counts[5:].sum() == 0 and counts[:5][~keep].sum() == 0
    e = expected[keep] * num
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[int(keep.sum()) - 1]  # chi-square, p = 0.001
    assert ((counts[:5][keep] - e) ** 2 / e).sum() < critical


@pytest.mark.gpu
def test_smollm2_names_paris():
    llm = LLM("smollm2", device="cuda", max_num_seqs=4)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.gpu
def test_auto_picks_cuda_on_a_gpu(tiny_folder):
    assert LLM(tiny_folder, device="auto", max_model_len=32, max_num_seqs=2).device == "cuda"


@pytest.mark.gpu
def test_1b_shaped_decode_matches_cpu(tmp_path):
    folder = make_random_llama(tmp_path, LLAMA_3_2_1B_CONFIG | {"num_hidden_layers": 4}, seed=1)
    compare_runners(folder, [list(range(100, 140)), list(range(7, 20))], num_decodes=6, max_model_len=128)


def test_cuda_runner_computes_a_prompt_in_chunks_like_cpu(tiny_folder, monkeypatch):
    """A mixed batch, as chapter 10's scheduler makes them: step 1 a's first chunk (no token: it ends inside the
    prompt) and c's prompt; step 2 a's second chunk attending over the first through the cache (paged prefill on
    'cuda'), b's prompt from position 0, and c's decode. The CPU and 'cuda' runners agree."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    if not can_launch():
        pytest.skip("needs a GPU or the simulator")
    outs = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(tiny_folder, EngineConfig(device=device, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32), 64)
        a, b, c = new_request("a", [5, 6, 7, 8, 9, 10, 11]), new_request("b", [12, 13]), new_request("c", [3, 4, 5])
        tables = {"a": [3, 1], "b": [2, 0], "c": [0, 2]}
        rows = lambda *rs: np.array([tables[r.request_id] for r in rs], np.int32)  # noqa: E731
        first = runner.execute(SchedulerOutput([a, c], [4, 3], 2, rows(a, c)))
        assert len(first.sampled.token_ids) == 1  # c's token only: a's chunk ends inside its prompt
        a.num_computed_tokens, c.num_computed_tokens = 4, 3
        c.output_token_ids.append(int(first.sampled.token_ids[0]))
        outs.append(runner.execute(SchedulerOutput([a, b, c], [3, 2, 1], 2, rows(a, b, c))).sampled)
    cpu, cuda_ = outs
    assert cpu.token_ids.tolist() == cuda_.token_ids.tolist() and len(cpu.token_ids) == 3
    assert np.abs(cpu.logprobs - cuda_.logprobs).max() < 0.05
