"""Chapter 15: the 8-bit formats (int8 with row scales, FP8 e4m3fn) against exhaustive decodes, ml_dtypes and
PyTorch; the quantized models and the API's quantization= argument."""

import math

import ml_dtypes
import numpy as np
import pytest

from tinyvllm_lib.quantization.formats import (
    FP8_E4M3_MAX,
    check_quantization,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    quantize,
)

ALL_FP8 = np.arange(256, dtype=np.uint16).astype(np.uint8)


def fp8_by_hand(code: int) -> float:
    """One e4m3fn code from its definition: S EEEE MMM, bias 7, S.1111.111 NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    value = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -value if s else value


def test_decode_every_code():
    ours = fp8_e4m3_decode(ALL_FP8)
    by_hand = np.array([fp8_by_hand(c) for c in range(256)], np.float32)
    assert np.array_equal(ours, by_hand, equal_nan=True)
    assert np.array_equal(ours, ALL_FP8.view(ml_dtypes.float8_e4m3fn).astype(np.float32), equal_nan=True)
    assert np.nanmax(ours) == FP8_E4M3_MAX and np.isnan(ours).sum() == 2 and not np.isinf(ours).any()


def test_every_code_encodes_to_itself():
    values = fp8_e4m3_decode(ALL_FP8)
    ok = ~np.isnan(values)
    assert np.array_equal(fp8_e4m3_encode(values)[ok], ALL_FP8[ok])


def random_in_range(rng, n):
    words = rng.integers(0, 2**32, size=n, dtype=np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        return words[np.abs(words) <= FP8_E4M3_MAX]


def ties_and_near_ties():
    values = fp8_e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)  # 0 .. 448, ascending
    mid = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    bits = mid.view(np.uint32)
    near = np.concatenate([bits - 1, bits + 1]).view(np.float32)  # just below and above each halfway point
    x = np.concatenate([mid, near])
    return np.concatenate([x, -x])


def test_encode_matches_ml_dtypes(rng):
    x = np.concatenate([ties_and_near_ties(), random_in_range(rng, 2_000_000)])
    ours, theirs = fp8_e4m3_encode(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bad = np.flatnonzero(ours != theirs)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {x[bad[:5]]}"


def test_encode_matches_torch(rng):
    torch = pytest.importorskip("torch")
    x = np.concatenate([ties_and_near_ties(), random_in_range(rng, 1_000_000)])
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_e4m3_encode(x), theirs)


@pytest.mark.parametrize(
    "x, code",
    [
        (1.0, 0x38),
        (448.0, 0x7E),
        (464.0, 0x7E),  # halfway to the NaN pattern's 480: ties to even, 448
        (1e9, 0x7E),  # saturates (ml_dtypes and torch make NaN here)
        (np.inf, 0x7E),
        (-np.inf, 0xFE),
        (np.nan, 0x7F),
        (-np.nan, 0xFF),
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # halfway to zero: ties to even
        (3 * 2.0**-10, 0x02),  # halfway between subnormals 1 and 2: to even, 2
        (-0.0, 0x80),
        (1.0625, 0x38),  # 1 + 2^-4: halfway between 1 and 1.125, to even
        (1.1875, 0x3A),  # 1 + 3 * 2^-4: halfway between 1.125 and 1.25, to even
    ],
)
def test_known_encodings(x, code):
    assert fp8_e4m3_encode(np.array([x], np.float32))[0] == code


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_rows(rng, method):
    w = (rng.standard_normal((37, 131)) * rng.uniform(0.01, 3, (37, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 0, codes 0
    q = quantize(w, method)
    assert q.codes.shape == w.shape and q.scales.shape == (37,) and q.scales.dtype == np.float32
    assert q.codes.dtype == (np.int8 if method == "int8" else np.uint8)
    assert q.codes.flags.c_contiguous and q.nbytes == w.size + 4 * 37
    top = np.max(np.abs(w), axis=1)
    assert np.allclose(q.scales, top / (127 if method == "int8" else 448), rtol=1e-6)
    back = q.dequantize()
    assert np.array_equal(back[3], np.zeros(131, np.float32))
    # every row's largest magnitude is a code's value: the largest code, exactly up to the scale's rounding
    assert np.allclose(np.max(np.abs(back), axis=1), top, rtol=1e-6)
    rounding = 2.0**-22 * np.abs(w)  # float32's rounding of the division and of the product
    if method == "int8":
        assert q.codes.min() >= -127
        assert np.all(np.abs(back - w) <= q.scales[:, None] / 2 + rounding)
        # round to nearest: the code is the nearest integer to w / s
        nonzero = q.scales > 0
        ratio = w[nonzero] / q.scales[nonzero, None]
        assert np.all(np.abs(q.codes[nonzero] - ratio) <= 0.5 + 1e-4)
    else:
        scale = np.broadcast_to(q.scales[:, None], w.shape)
        tiny = np.abs(w) < 2.0**-6 * scale
        bound = np.where(tiny, 2.0**-10 * scale, 2.0**-4 * np.abs(w)) + rounding
        assert np.all(np.abs(back - w) <= bound)
        assert not np.isnan(fp8_e4m3_decode(q.codes)).any()


def test_fp8_rows_match_ml_dtypes(rng):
    """A row quantized to FP8 is ml_dtypes' e4m3 of w / s (the scale keeps every value in range)."""
    w = rng.standard_normal((9, 200)).astype(np.float32)
    q = quantize(w, "fp8")
    theirs = (w / q.scales[:, None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(q.codes, theirs)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_row_with_nan_or_inf_is_refused(rng, bad):
    w = rng.standard_normal((4, 16)).astype(np.float32)
    w[2, 5] = bad
    with pytest.raises(ValueError, match="row 2 holds NaN or infinity"):
        quantize(w, "int8")


@pytest.mark.parametrize("bad", ["int4", "INT8", "fp16", "", 8])
def test_bad_quantization_names(bad):
    with pytest.raises(ValueError, match="quantization must be None"):
        check_quantization(bad)
    assert check_quantization(None) is None and check_quantization("fp8") == "fp8"


# --- the quantized model and the API ---

from tinyvllm_lib import LLM, SamplingParams  # noqa: E402
from tinyvllm_lib.cli import main  # noqa: E402
from tinyvllm_lib.engine.engine_config import EngineConfig  # noqa: E402
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32  # noqa: E402
from tinyvllm_lib.models.config import ModelConfig  # noqa: E402
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, fuse_llama_weights  # noqa: E402
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, decode_weight_bytes  # noqa: E402
from tinyvllm_lib.models.loader import llama_weight_shapes, load_weights  # noqa: E402
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config  # noqa: E402


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    config = tiny_llama_config(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=24, vocab_size=300, tie_word_embeddings=True)
    return make_random_llama(tmp_path_factory.mktemp("ch15") / "tiny", config, seed=3)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("head", [False, True])
def test_quantized_numpy_model_holds_the_dequantized_weights(tied_folder, method, head):
    config = ModelConfig.from_folder(tied_folder)
    weights = load_weights(tied_folder, config, progress=False)
    model = QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=head)
    fused = fuse_llama_weights(weights, config)
    for name in ("layers.0.qkv_proj", "layers.1.o_proj", "layers.0.gate_up_proj", "layers.1.down_proj"):
        want = quantize(bf16_bits_to_f32(fused[name]), method).dequantize()
        assert np.array_equal(model.matrices[name], want), name
        assert not np.array_equal(want, bf16_bits_to_f32(fused[name]))  # the quantization did change them
    head_bf16 = bf16_bits_to_f32(fused["embed_tokens"])
    assert np.array_equal(model.matrices["lm_head"], head_bf16) != head
    assert np.array_equal(model.embed_tokens, fused["embed_tokens"])  # the lookup stays bf16


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("head", [False, True])
def test_llm_quantization_is_the_quantized_model(tied_folder, method, head):
    """The engine (paged KV cache, one token a step) gives the teacher-forced log-probs of QuantizedLlamaNumpy with
    its head as quantize_lm_head asks, and not bf16's, nor those of the model with the other head."""
    prompt = [5, 17, 250, 3, 99, 42, 7]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    llm = LLM(str(tied_folder), "cpu", max_num_seqs=2, quantization=method, quantize_lm_head=head)
    assert llm.llm_engine.model_runner.model.quantize_lm_head is head
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    config = ModelConfig.from_folder(tied_folder)
    weights = load_weights(tied_folder, config, progress=False)
    ids = prompt + out.token_ids
    for name, model in (("quantized", QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=head)),
                        ("other head", QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=not head)),
                        ("bf16", LlamaNumpy(config, weights))):
        logits = model.forward(np.array(ids))[len(prompt) - 1 : -1].astype(np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        gaps = [abs(lp[t, tok] - out.logprobs[t][tok]) for t, tok in enumerate(out.token_ids)]
        if name == "quantized":
            assert max(gaps) < 1e-4, gaps
            assert list(lp.argmax(-1)) == out.token_ids
        else:
            assert max(gaps) > 1e-3, f"the engine's log-probs are those of {name}"


@pytest.mark.parametrize("bad", ["int4", "FP8", 8])
def test_bad_quantization_is_a_value_error(tied_folder, bad):
    with pytest.raises(ValueError, match="quantization must be None"):
        LLM(str(tied_folder), "cpu", quantization=bad)
    with pytest.raises(ValueError, match="quantization must be None"):
        EngineConfig(quantization=bad)


def test_quantize_lm_head_needs_a_format(tied_folder):
    with pytest.raises(ValueError, match="quantize_lm_head=True .* needs quantization='int8' or 'fp8'"):
        LLM(str(tied_folder), "cpu", quantize_lm_head=True)
    with pytest.raises(ValueError, match="quantize_lm_head must be True or False"):
        EngineConfig(quantization="int8", quantize_lm_head="yes")


def test_cli_generates_with_quantization(capsys):
    assert main(["generate", "The capital of France is", "--device", "cpu", "--quantization", "int8",
                 "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "3 new tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    for argv in (["generate", "x"], ["bench", "latency"], ["serve", "smollm2"]):  # each command passes the flag on
        with pytest.raises(SystemExit, match="needs quantization='int8' or 'fp8'"):
            main(argv + ["--device", "cpu", "--quantize-lm-head"])


def test_decode_weight_bytes(tied_folder):
    config = ModelConfig.from_folder(tied_folder)
    shapes = llama_weight_shapes(config)
    assert decode_weight_bytes(config, None) == 2 * sum(math.prod(s) for s in shapes.values())
    matrices = [s for n, s in shapes.items() if n.endswith("proj.weight")]
    codes_and_scales = sum(r * c + 4 * r for r, c in matrices)
    norms = 2 * sum(math.prod(s) for n, s in shapes.items() if "norm" in n)
    V, H = config.vocab_size, config.hidden_size
    assert decode_weight_bytes(config, "fp8") == codes_and_scales + norms + 2 * V * H
    assert decode_weight_bytes(config, "int8", lm_head=True) == codes_and_scales + norms + V * H + 4 * V + 2 * H


def test_tensor_parallel_ranks_quantize_their_shards(tied_folder):
    """Two CPU ranks with quantization: rank 0's model is the 8-bit one, its column-parallel rows are the whole
    model's 8-bit rows (a row is whole on its rank, so is its scale), and the answers follow one rank's 8-bit model
    (the row-parallel shards' scales are per shard, so not bit for bit)."""
    from tinyvllm_lib.distributed.sharding import shard_config, shard_llama_weights

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    one = LLM(str(tied_folder), "cpu", max_num_seqs=2, quantization="int8").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tied_folder), "cpu", max_num_seqs=2, quantization="int8", tensor_parallel_size=2,
              distributed_timeout=30)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
        model = llm.llm_engine.model_runner.driver.model
    finally:
        llm.llm_engine.shutdown()
    assert isinstance(model, QuantizedLlamaNumpy) and model.quantization == "int8"
    config = ModelConfig.from_folder(tied_folder)
    weights = load_weights(tied_folder, config, progress=False)
    whole = QuantizedLlamaNumpy(config, weights, "int8")
    rows = model.matrices["layers.0.qkv_proj"].shape[0]
    shard = fuse_llama_weights(shard_llama_weights(weights, config, 0, 2), shard_config(config, 2))
    assert np.array_equal(model.matrices["layers.0.qkv_proj"],
                          quantize(bf16_bits_to_f32(shard["layers.0.qkv_proj"]), "int8").dequantize())
    q_rows = config.num_attention_heads // 2 * config.head_dim  # rank 0's q heads are the whole model's first
    assert np.array_equal(model.matrices["layers.0.qkv_proj"][:q_rows], whole.matrices["layers.0.qkv_proj"][:q_rows])
    assert rows < whole.matrices["layers.0.qkv_proj"].shape[0]
    for a, b in zip(one, two):
        first = a.outputs[0].token_ids[0]
        assert b.outputs[0].token_ids[0] == first
        assert abs(a.outputs[0].logprobs[0][first] - b.outputs[0].logprobs[0][first]) < 0.05


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rank_quantizes_its_shard_of_the_head(tied_folder, device, monkeypatch):
    """quantize_lm_head under tensor parallelism: rank 1's model holds its vocabulary rows of the head in 8 bits,
    the whole 8-bit head's same rows (one scale a row, so sharding by rows changes none); on the GPU (the simulator
    here), where the embedding stays whole, its scratch is sized for its own rows, not the whole head's."""
    from types import SimpleNamespace

    from tinyvllm_lib.distributed.executor import make_rank_runner

    config = ModelConfig.from_folder(tied_folder)
    engine = EngineConfig(str(tied_folder), device, quantization="int8", quantize_lm_head=True, max_model_len=64,
                          max_num_seqs=2, max_num_batched_tokens=64)
    comm = SimpleNamespace(rank=1, world_size=2)
    if device == "cuda":
        monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")  # device="cuda" in the simulator
    model = make_rank_runner(tied_folder, engine, comm).model
    whole = quantize(bf16_bits_to_f32(load_weights(tied_folder, config, progress=False)["model.embed_tokens.weight"]),
                     "int8")
    rows = config.vocab_size // 2
    assert model.quantize_lm_head
    if device == "cpu":
        assert np.array_equal(model.matrices["lm_head"], whole.dequantize()[rows:])
        return
    head = model.weights["lm_head"]
    assert np.array_equal(head.codes.copy_to_host(), whole.codes[rows:])
    assert np.array_equal(head.scales.copy_to_host(), whole.scales[rows:])
    H = config.hidden_size
    gate_up = 2 * (config.intermediate_size // 2) * H  # the rank's gate-up rows
    assert model.scratch.size == max(rows * H, gate_up) < config.vocab_size * H  # not the whole head's


@pytest.mark.parametrize("argv", [["serve", "smollm2"], ["chat"], ["generate", "hi"], ["bench", "latency"],
                                  ["verify", "smollm2"]])
def test_every_engine_command_takes_quantization(argv):
    from tinyvllm_lib.cli import build_parser

    args = build_parser().parse_args(argv + ["--quantization", "fp8", "--quantize-lm-head"])
    assert (args.quantization, args.quantize_lm_head) == ("fp8", True)
    args = build_parser().parse_args(argv)
    assert (args.quantization, args.quantize_lm_head) == (None, False)  # bf16 by default
