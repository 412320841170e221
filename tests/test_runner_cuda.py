"""The CUDA backend of the engine: LLM(device="cuda") against device="cpu" (the simulator runs it on a tiny
random Llama when TINYVLLM_SIM_CUDA=1, set here), the GPU sampler, and on a GPU SmolLM2 and a 1B-shaped model."""

import numpy as np
import pytest

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.sampler import SamplingMetadata
from tinyvllm_lib.models.llama_numpy import log_softmax
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama, tiny_llama_config
from tinyvllm_lib.runtime import can_launch, has_gpu

pytestmark = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")


@pytest.fixture(autouse=True)
def cuda_in_simulator(monkeypatch):
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("tiny"), tiny_llama_config(), seed=5)


def top_gap(ours: np.ndarray, ref: np.ndarray, k: int = 5) -> float:
    """Mean |Δ log p| over each position's k most likely tokens of ref (chapter 7's rule)."""
    top = np.argsort(-ref, axis=-1)[:, :k]
    rows = np.arange(ref.shape[0])[:, None]
    return float(np.abs(ours[rows, top] - ref[rows, top]).mean())


def greedy_agrees(ours: np.ndarray, ref: np.ndarray, margin: float = 0.1) -> bool:
    top2 = np.sort(ref, axis=-1)[:, -2:]
    is_clear = top2[:, 1] - top2[:, 0] > margin
    return bool(np.all(ours.argmax(-1)[is_clear] == ref.argmax(-1)[is_clear]))


def step_log_probs(llm, prompt, num_steps, ref_tokens=None):
    """Prefill + cached decode through the runner: log-probs of every prompt position and of each decode step."""
    runner, slots = llm.runner, llm.slots
    row = slots.allocate()
    try:
        n = len(prompt)
        pos = np.arange(n)
        logits = runner.execute(prompt, pos, slots.metadata([row], [pos]))
        rows = [np.asarray(logits.copy_to_host() if hasattr(logits, "copy_to_host") else logits)]
        ids = list(prompt)
        for step in range(num_steps):
            ids.append(int(rows[-1][-1].argmax()) if ref_tokens is None else ref_tokens[step])
            p = np.array([len(ids) - 1])
            logits = runner.execute(ids[-1:], p, slots.metadata([row], [p]))
            rows.append(np.asarray(logits.copy_to_host() if hasattr(logits, "copy_to_host") else logits))
        return log_softmax(np.concatenate(rows)), ids[n:]
    finally:
        slots.free(row)


def compare_devices(folder, prompt, num_steps, max_model_len=64):
    cpu = LLM(folder, device="cpu", max_model_len=max_model_len, max_num_seqs=2)
    gpu = LLM(folder, device="cuda", max_model_len=max_model_len, max_num_seqs=2)
    assert gpu.device == "cuda"
    ref, tokens = step_log_probs(cpu, prompt, num_steps)
    ours, _ = step_log_probs(gpu, prompt, num_steps, ref_tokens=tokens)  # teacher-forced on the CPU's tokens
    gap = top_gap(ours, ref)
    print(f"mean |Δ log p| over the top 5: {gap:.4f}")
    assert gap <= 0.05 and greedy_agrees(ours, ref)
    return cpu, gpu


def test_cuda_runner_matches_cpu(tiny_folder):
    # The simulator runs every GPU thread as a Python thread: a short prompt and one cached step there.
    prompt, num_steps = ([5, 17, 99, 3], 1) if not has_gpu() else ([5, 17, 99, 3, 250, 8, 41], 3)
    compare_devices(tiny_folder, prompt, num_steps)


# In the simulator every GPU thread is a Python thread: generation through the sampler kernels takes
# many minutes there, so these run on a GPU only. The simulator still checks the runner against the
# CPU (test_cuda_runner_matches_cpu) and the sampler kernels compile to PTX (tests/test_ptx.py).
@pytest.mark.gpu
def test_llm_cuda_greedy_and_prompt_logprobs(tiny_folder):
    cpu = LLM(tiny_folder, device="cpu", max_model_len=32, max_num_seqs=1)
    gpu = LLM(tiny_folder, device="cuda", max_model_len=32, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    a, b = (llm.generate([[7, 8, 9, 10, 200]], params, use_tqdm=False)[0] for llm in (cpu, gpu))
    for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert abs(next(iter(pa.values())) - next(iter(pb.values()))) < 0.05
    assert len(b.outputs[0].token_ids) == 3 and len(b.outputs[0].logprobs) == 3


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
    llm = LLM("smollm2", device="cuda")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.gpu
def test_auto_picks_cuda_on_a_gpu(tiny_folder):
    assert LLM(tiny_folder, device="auto", max_model_len=32).device == "cuda"


@pytest.mark.gpu
def test_1b_shaped_decode_matches_cpu(tmp_path):
    folder = make_random_llama(tmp_path, LLAMA_3_2_1B_CONFIG | {"num_hidden_layers": 4}, seed=1)
    compare_devices(folder, list(range(100, 140)), num_steps=8, max_model_len=128)
