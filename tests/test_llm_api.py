"""Chapter 08's public API end to end: LLM / SamplingParams / RequestOutput, checked against
transformers (float32, CPU) on random-weight Llama folders and SmolLM2; stopping, streaming,
seeds, log-probs, every bad input, and the command line (generate, chat, verify)."""

import io
import json
import sys

import numpy as np
import pytest

from tinyvllm_lib import LLM, LLMEngine, SamplingParams
from tinyvllm_lib.cli import main
from tinyvllm_lib.engine.config import resolve_device
from tinyvllm_lib.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import RequestOutputKind
from tinyvllm_lib.engine.verify import (
    default_prompt,
    greedy_agreement,
    verify_against_transformers,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.random_llama import (
    LLAMA3_ROPE_SCALING,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.runtime import has_gpu

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SCALING = LLAMA3_ROPE_SCALING | {"original_max_position_embeddings": 64}  # short, so the scaling shows in 50 positions
RANDOM_CONFIGS = {
    "gqa-4-2-hd64-untied": tiny_llama_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512),
    "gqa-8-2-hd64-llama3-tied": tiny_llama_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                                  vocab_size=512, rope_scaling=SCALING, tie_word_embeddings=True),
    "gqa-4-1-hd128-llama3-untied": tiny_llama_config(hidden_size=192, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                                     vocab_size=384, rope_scaling=SCALING),
    "mha-4-4-hd128-tied": tiny_llama_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                                            vocab_size=384, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def smol_answer(smol):
    """The greedy answer to the question, streamed (pieces recorded)."""
    pieces = []
    out = smol.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False, stream=lambda i, t: pieces.append(t))[0]
    return out, pieces


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    """A random-weight Llama without a tokenizer: prompts are token ids."""
    folder = make_random_llama(tmp_path_factory.mktemp("tiny"), tiny_llama_config(), seed=2)
    return LLM(folder, device="cpu", max_model_len=64, seed=0)


def greedy_ids(llm: LLM, prompt, n: int = 12) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


# --- the acceptance test ---


def test_smollm2_names_paris(smol_answer):
    out, _ = smol_answer
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason in ("stop", "length") and completion.token_ids
    assert out.prompt.startswith("<|im_start|>") and out.prompt_token_ids[-1] != completion.token_ids[0]
    assert out.finished and completion.finished()


def test_public_names():
    import tinyvllm_lib

    assert {"LLM", "SamplingParams"} <= set(tinyvllm_lib.__all__)


# --- against transformers ---


def test_greedy_agreement_rule():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.4, 0.4 - 1e-4, 0.2 + 1e-4], [0.1, 0.1, 0.8]]))
    assert greedy_agreement([0, 0, 0, 2], ref) == (4, True)
    assert greedy_agreement([0, 1, 0, 2], ref) == (1, False)  # a real mismatch
    assert greedy_agreement([0, 0, 1, 0], ref) == (2, True)  # a near tie at step 2: stop comparing there
    assert greedy_agreement([0, 0, 2, 0], ref) == (2, False)  # not within 1e-3 of the best


@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_random_llama_matches_transformers(tmp_path, name):
    pytest.importorskip("transformers")
    folder = make_random_llama(tmp_path, RANDOM_CONFIGS[name], seed=4)
    llm = LLM(folder, device="cpu", max_model_len=128)
    prompt = np.random.default_rng(0).integers(0, RANDOM_CONFIGS[name]["vocab_size"], 20).tolist()
    result = verify_against_transformers(llm, prompt, num_steps=32, tolerance=1e-3)
    assert result.passed, result.report()
    assert result.greedy_steps == 32, result.report()  # random logits spread over units: no near ties expected


def test_smollm2_matches_transformers(smol):
    pytest.importorskip("transformers")
    result = verify_against_transformers(smol, default_prompt(smol), num_steps=32, tolerance=1e-3)
    assert result.passed, result.report()


# --- stopping ---


def test_max_tokens_finishes_with_length(tiny):
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None
    assert out.text == "" and out.logprobs is None and out.cumulative_logprob is None


def test_stop_token_ids(tiny):
    tokens = greedy_ids(tiny, [5, 6, 7], 12)
    k = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])  # first new token from step 2 on
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[k]]),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop" and out.stop_reason == tokens[k]


def test_every_eos_id_stops_unless_ignored(tmp_path):
    folder = make_random_llama(tmp_path, tiny_llama_config(), seed=2)
    tokens = greedy_ids(LLM(folder, device="cpu", max_model_len=64), [5, 6, 7], 12)
    k = next(i for i in range(3, 12) if tokens[i] not in tokens[:i] and tokens[i] != 2)
    # three eos ids, as Llama 3.2 has: config.json's (2) and two more from generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 250, tokens[k]]}))
    llm = LLM(folder, device="cpu", max_model_len=64)
    assert llm.config.eos_token_ids == (2, 250, tokens[k])
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop" and out.stop_reason is None
    ignored = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert ignored.outputs[0].token_ids == tokens and ignored.outputs[0].finish_reason == "length"


def test_stop_string_truncates_before_it(smol, smol_answer):
    answer = smol_answer[0].outputs[0].text
    assert "Paris" in answer
    pieces = []
    out = smol.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16, stop=["Paris", "zzz"]), use_tqdm=False,
                    stream=lambda i, t: pieces.append(t))[0].outputs[0]
    assert out.text == answer[: answer.index("Paris")] and out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "".join(pieces) == out.text  # nothing of the stop string leaked into the stream
    kept = smol.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16, stop="Paris", include_stop_str_in_output=True),
                     use_tqdm=False)[0].outputs[0]
    assert kept.text == answer[: answer.index("Paris") + len("Paris")]


def test_stop_string_spanning_tokens_is_held_back():
    tok = FakeTokenizer()
    params = SamplingParams(max_tokens=20, stop=["cd"])
    request = Request("0", None, [], params, 20, eos_token_ids=[], tokenizer=tok)
    streamed = []
    for t in tok.encode("abcdef"):
        request.append_token(t)
        streamed.append(request.stream_delta())
        if request.is_finished:
            break
    assert request.text == "ab" and request.stop_reason == "cd" and "".join(streamed) == "ab"
    assert streamed[:2] == ["", "a"]  # "b" waited: it might have begun a stop string


def test_find_stop_string_earliest_in_the_new_text():
    assert find_stop_string("hello world", 5, ["o", "w"]) == ("w", 6)
    assert find_stop_string("hello world", 4, ["o w"]) is None  # it ended before the new text ("orld")
    assert find_stop_string("hello world", 5, ["o w"]) == ("o w", 4)  # it ends in the new text ("world")


# --- streaming ---


class FakeTokenizer:
    """One token per UTF-8 byte, so every multi-byte character spans tokens."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streamed_pieces_join_to_the_full_decode(smol_answer, smol):
    out, pieces = smol_answer
    completion = out.outputs[0]
    assert "".join(pieces) == completion.text == smol.tokenizer.decode(completion.token_ids)
    assert len(pieces) > 3


@pytest.mark.parametrize("text", ["I love 🦙 and 東京! ✨", "日本語のテキスト", "ok 👍🏽 👨‍👩‍👧"])
def test_multibyte_characters_across_tokens(smol, text):
    for tok in (smol.tokenizer, FakeTokenizer()):
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, tok.encode("Say: "))
        pieces = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
        assert "" in pieces  # some steps held an incomplete character back


def test_deferred_text_is_the_incremental_text(smol, rng):
    """A FINAL_ONLY request without stop strings decodes once, at the end: the same text, token for token."""
    for tok in (smol.tokenizer, FakeTokenizer()):
        vocab = getattr(tok, "vocab_size", None) or 256
        for trial in range(40):
            prompt = rng.integers(0, vocab, 7).tolist()
            ids = rng.integers(0, vocab, 50).tolist() if trial % 2 else tok.encode("I love 🦙 and 東京! ✨ " * 3)
            texts = []
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
                params = SamplingParams(max_tokens=len(ids), output_kind=kind)
                request = Request("0", None, prompt, params, len(ids), eos_token_ids=[], tokenizer=tok)
                assert request.defer_text == (kind is RequestOutputKind.FINAL_ONLY)
                for t in ids:
                    request.append_token(t)
                texts.append(request.text)
            assert texts[0] == texts[1]
    # an abort keeps what was generated, decoded then
    tok = FakeTokenizer()
    ids = tok.encode("abc")
    request = Request("0", None, [], SamplingParams(max_tokens=10, output_kind=RequestOutputKind.FINAL_ONLY), 10,
                      eos_token_ids=[], tokenizer=tok)
    for t in ids:
        request.append_token(t)
    assert request.text == ""
    request.abort()
    assert request.output().outputs[0].text == "abc" and request.finish_reason == "abort"
    # a caller that reads the text as it grows (the server's thread) gets it token by token, whatever the kind
    streamed = Request("1", None, [], SamplingParams(max_tokens=10, output_kind=RequestOutputKind.FINAL_ONLY), 10,
                       eos_token_ids=[], tokenizer=tok, streams_text=True)
    assert not streamed.defer_text
    for t in ids:
        streamed.append_token(t)
    assert streamed.text == "abc"


def test_incomplete_character_at_the_end_is_flushed():
    tok = FakeTokenizer()
    ids = tok.encode("a🦙")[:-1]  # the emoji's last byte never comes
    request = Request("0", None, [], SamplingParams(max_tokens=len(ids)), len(ids), eos_token_ids=[], tokenizer=tok)
    streamed = []
    for t in ids:
        request.append_token(t)
        streamed.append(request.stream_delta())
    assert request.finish_reason == "length" and "".join(streamed) == request.text == tok.decode(ids) == "a\ufffd"


# --- seeds and log-probs ---


def test_same_seed_same_tokens(tmp_path, tiny):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    a = tiny.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    tiny.generate([[9, 9]], SamplingParams(temperature=1.0, max_tokens=5), use_tqdm=False)  # moves the global generator
    b = tiny.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    other = LLM(tiny.folder, device="cpu", max_model_len=64, seed=99)
    c = other.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b == c
    d = tiny.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=16, seed=1235, ignore_eos=True), use_tqdm=False)
    assert d[0].outputs[0].token_ids != a


def test_unseeded_requests_follow_the_llm_seed(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(seed):
        llm = LLM(tiny.folder, device="cpu", max_model_len=64, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [5, 6, 7]], params, use_tqdm=False)]

    first, again, other = run(0), run(0), run(1)
    assert first == again and first != other
    assert first[0] != first[1]  # one generator shared by the two requests, so they differ


def test_logprobs_and_prompt_logprobs(tiny):
    params = SamplingParams(temperature=0.8, max_tokens=6, logprobs=3, prompt_logprobs=2, seed=0, ignore_eos=True)
    out = tiny.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for step, token in zip(completion.logprobs, completion.token_ids):
        assert next(iter(step)) == token and 3 <= len(step) <= 4 and all(v <= 0 for v in step.values())
    assert completion.cumulative_logprob == pytest.approx(sum(s[t] for s, t in zip(completion.logprobs, completion.token_ids)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    for step, token in zip(out.prompt_logprobs[1:], [6, 7, 8]):
        assert token in step and 2 <= len(step) <= 3
    greedy = tiny.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0].outputs[0]
    for step, token in zip(greedy.logprobs, greedy.token_ids):
        assert max(step, key=step.get) == token  # greedy picks the most likely


def test_a_steps_logprobs_keep_the_chosen_tokens_value_and_the_first_of_repeated_ids():
    """append_token's log-prob dict: the chosen token first with its own log-prob (not the top list's), then
    the top k in order, an id met again keeping its first value; NumPy scalars (the sampler's rows) or Python
    numbers (the scheduler's lists) alike."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    top_ids, top_values = [7, 3, 7, 9, 11], [-0.25, -1.5, -2.0, -3.0, -4.0]
    want = {7: -0.5, 3: -1.5}  # 7 is chosen; k = 3 reads [7, 3, 7]: the repeat of 7 keeps the chosen value
    for cast in (list, lambda x: np.asarray(x, np.float32 if isinstance(x[0], float) else np.int64)):
        request = Request("0", None, [1, 2], params, 8, eos_token_ids=[])
        request.append_token(7, -0.5, cast(top_ids), cast(top_values))
        request.append_token(9, -0.75, cast([9, 3, 4]), cast([-0.125, -1.0, -2.0]))
        assert request.logprobs == [want, {9: -0.75, 3: -1.0, 4: -2.0}]
        assert list(request.logprobs[0]) == [7, 3] and list(request.logprobs[1]) == [9, 3, 4]
        assert all(type(i) is int and type(v) is float for step in request.logprobs for i, v in step.items())
        assert request.cumulative_logprob == -1.25


def test_many_prompts_and_params(tiny):
    prompts = [[5, 6, 7], {"prompt_token_ids": [8, 9]}, np.array([3, 4])]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3)]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9], [3, 4]]
    assert outs[0].outputs[0].token_ids == greedy_ids(tiny, [5, 6, 7], 1)
    assert tiny.generate([], use_tqdm=False) == []


# --- bad input: a clear ValueError, and the engine still works ---


def expect_value_error(llm: LLM, match: str, *args, **kwargs) -> str:
    before = greedy_ids(llm, [5, 6, 7], 4)
    with pytest.raises(ValueError, match=match) as err:
        (llm.chat if kwargs.pop("chat", False) else llm.generate)(*args, use_tqdm=False, **kwargs)
    assert greedy_ids(llm, [5, 6, 7], 4) == before  # still generates, the same as before
    return str(err.value)


def test_prompt_longer_than_max_model_len(tiny):
    message = expect_value_error(tiny, "max_model_len", [[1] * 70])
    assert "70" in message and "64" in message
    message = expect_value_error(tiny, "max_model_len", [[1] * 64])
    assert "64" in message


def test_prompt_plus_max_tokens_too_long(tiny):
    message = expect_value_error(tiny, "max_tokens", [[1] * 50], SamplingParams(max_tokens=20))
    assert all(str(n) in message for n in (50, 20, 70, 64))
    out = tiny.generate([[1] * 50], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"  # fills max_model_len


def test_empty_prompts(tiny, smol):
    expect_value_error(tiny, "empty", [[]])
    expect_value_error(tiny, "empty", [[5, 6], []])
    with pytest.raises(ValueError, match="empty"):
        smol.generate("", use_tqdm=False)


def test_other_bad_prompts(tiny):
    expect_value_error(tiny, "outside the vocabulary", [[5, 6, 256]])
    expect_value_error(tiny, "no tokenizer", ["some text"])
    expect_value_error(tiny, "stop strings need a tokenizer", [[5, 6]], SamplingParams(stop=["x"]))
    expect_value_error(tiny, "2 sampling params for 1 prompts", [[5, 6]], [SamplingParams(), SamplingParams()])
    expect_value_error(tiny, "no chat template", QUESTION, chat=True)
    expect_value_error(tiny, "prompt 0 must be", [[5, 6.5]])
    with pytest.raises(TypeError, match="SamplingParams"):
        tiny.generate([[5, 6]], {"temperature": 0}, use_tqdm=False)


def test_one_engine_config_goes_from_llm_to_the_runner(tiny):
    """LLM's keyword arguments become one EngineConfig (vLLM's names), checked when made; the engine completes
    it for its model and the runner reads that same object."""
    from tinyvllm_lib.engine.engine_config import EngineConfig

    llm = LLM(tiny.folder, device="cpu", max_model_len=64, max_num_seqs=3, seed=7)
    c = llm.llm_engine.engine_config
    assert llm.llm_engine.model_runner.engine_config is c
    assert (c.device, c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens, c.seed) == ("cpu", 64, 3, 8192, 7)
    engine = LLMEngine(EngineConfig(tiny.folder, "cpu", max_model_len=32, num_kv_blocks=9))
    assert engine.engine_config.num_kv_blocks == 9 and engine.stats.kv_blocks_total == 9
    with pytest.raises(TypeError, match="not both"):
        LLMEngine(EngineConfig(tiny.folder, "cpu"), max_num_seqs=2)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny.folder, device="cpu", max_num_seq=2)  # a misspelt field is no silent default
    for bad, match in [({"block_size": 12}, "power of two"), ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                       ({"max_model_len": 1}, "max_model_len"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
                       ({"seed": 1.5}, "seed"), ({"max_num_seqs": True}, "max_num_seqs")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_bad_engine_arguments(tiny):
    with pytest.raises(ValueError, match="smollm2"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny.folder, device="tpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny.folder, device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(tiny.folder, device="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny.folder, device="cpu", max_model_len=64, max_num_batched_tokens=32)  # a prompt must fit in one step
    if not has_gpu():
        with pytest.raises(RuntimeError, match="cuda"):
            LLM(tiny.folder, device="cuda")
        assert LLM(tiny.folder, device="auto", max_model_len=64).device == "cpu"


def test_cpu_cache_dtypes(tiny):
    runner = tiny.llm_engine.model_runner
    assert runner.device == "cpu" and runner.kv_cache.dtype == "float32"
    bm = tiny.llm_engine.block_manager
    assert runner.kv_cache.num_slots == bm.num_blocks * bm.block_size
    bf16 = LLM(tiny.folder, device="cpu", max_model_len=64, max_num_seqs=2, kv_cache_dtype="bfloat16")
    assert bf16.llm_engine.model_runner.kv_cache.dtype == "bfloat16"
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") == ("cuda" if has_gpu() else "cpu")


def test_config_keeps_llama_3_eos_ids():
    config = ModelConfig.from_dict(tiny_llama_config(eos_token_id=[2, 3]), {"eos_token_id": [3, 4]})
    assert config.eos_token_ids == (2, 3, 4)


# --- the command line ---


@pytest.fixture
def cli_llm(monkeypatch, smol):
    """The command line's engine is the module's SmolLM2 (loading it again would only cost time)."""
    import tinyvllm_lib.cli as cli

    monkeypatch.setattr(cli, "load_llm", lambda args, model: smol)
    return smol


def test_cli_generate_streams_the_answer(cli_llm, capsys, smol_answer):
    assert main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == smol_answer[0].outputs[0].text
    assert "finish_reason" in captured.err


def test_cli_chat_keeps_the_conversation(cli_llm, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n/exit\n"))
    assert main(["chat", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and out.count("> ") == 3
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))  # then end of input
    assert main(["chat", "--max-tokens", "2"]) == 0


def test_cli_bad_input_is_an_error_message(cli_llm):
    with pytest.raises(SystemExit, match="temperature"):
        main(["generate", "hi", "--temperature", "-1"])


def test_cli_verify_passes_on_a_random_folder(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = make_random_llama(tmp_path, RANDOM_CONFIGS["gqa-8-2-hd64-llama3-tied"], seed=5)
    assert main(["verify", str(folder), "--device", "cpu", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "8/8" in out


@pytest.mark.parametrize("ids", [
    [5, 0, 255], (7,), np.array([3, 4], np.int16), [True, 2], [np.int64(9), 1],  # taken in NumPy
    [1.0, 2], [[1, 2]], [2**70, 1], [-1, 2], [5, 256], [], "text",  # left to the checks one at a time
    np.array([True, False]),  # an array of NumPy's bools is no ids to them
    [np.uint64(3), 4],  # NumPy makes it float64: left to them too, which take it
])
def test_token_ids_checked_in_numpy_as_one_at_a_time(ids):
    """The NumPy check of a prompt's ids takes what the token-by-token rule takes, as the same Python ints, and
    leaves everything else to normalize_prompt's checks one token at a time."""
    from tinyvllm_lib.engine.inputs import checked_token_ids, normalize_prompt

    ok = (isinstance(ids, (list, tuple, np.ndarray)) and len(ids) > 0
          and all(isinstance(t, (int, np.integer)) and 0 <= t < 256 for t in ids))
    fast = checked_token_ids(ids, 256)
    if fast is not None:
        assert ok and fast == [int(t) for t in ids] and all(type(t) is int for t in fast)
    else:
        assert not ok or any(isinstance(t, np.uint64) for t in ids)
    if ok:
        assert normalize_prompt({"prompt_token_ids": ids}, None, 256)[1] == [int(t) for t in ids]
    else:
        with pytest.raises(ValueError):
            normalize_prompt({"prompt_token_ids": ids}, None, 256)
