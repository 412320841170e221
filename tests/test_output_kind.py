"""vLLM's RequestOutputKind (chapter 8b's SamplingParams, chapter 10's LLMEngine.step, chapter 9's LLM.generate),
and sampling parameters the GPU could not hold."""

import pytest

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("kind"), tiny_llama_config(vocab_size=256), seed=4)


def params(n: int, kind=RequestOutputKind.CUMULATIVE) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=kind)


def test_final_only_outputs_come_once_at_the_end(folder):
    engine = LLMEngine(folder, device="cpu", max_model_len=64, max_num_seqs=4)
    engine.add_request("every", [1, 2, 3], params(5))
    engine.add_request("final", [4, 5], params(5, RequestOutputKind.FINAL_ONLY))
    engine.add_request("gone", [6, 7], params(9, RequestOutputKind.FINAL_ONLY))
    seen = {"every": [], "final": [], "gone": []}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        step += 1
        if step == 2:
            engine.abort_request("gone")
    assert len(seen["every"]) == 5 and [len(o.outputs[0].token_ids) for o in seen["every"]] == [1, 2, 3, 4, 5]
    assert len(seen["final"]) == 1 and seen["final"][0].finished and len(seen["final"][0].outputs[0].token_ids) == 5
    # aborted: its one output says so, with the tokens it had
    assert len(seen["gone"]) == 1 and seen["gone"][0].outputs[0].finish_reason == "abort"
    assert len(seen["gone"][0].outputs[0].token_ids) == 2


def test_generate_gives_the_same_answers_streamed_or_not(folder, rng):
    llm = LLM(folder, device="cpu", max_model_len=64, max_num_seqs=4)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 9))).tolist() for _ in range(6)]
    quiet = llm.generate(prompts, params(6), use_tqdm=False)  # FINAL_ONLY inside
    pieces = []
    loud = llm.generate(prompts, params(6), use_tqdm=False, stream=lambda i, t: pieces.append(i))
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in loud]
    assert params(6).output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are not changed


@pytest.mark.parametrize(
    "bad",
    [{"output_kind": "final"}, {"top_k": 10**20}, {"top_k": 2**31}, {"top_p": 1e-46}, {"top_p": 0.0}],
)
def test_parameters_the_sampler_cannot_hold_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1 and SamplingParams(top_p=1e-30).top_p == 1e-30
