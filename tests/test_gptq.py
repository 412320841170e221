"""Chapter 15's GPTQ: the same codes' grid and scales as round-to-nearest, a smaller output error, round-to-nearest
itself where the inputs are uncorrelated, and the probe's XᵀX."""

import numpy as np
import pytest

from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.quantization.formats import INT8_MAX, quantize
from tinyvllm_lib.quantization.gptq import HessianProbe, gptq_quantize


def output_error(w, q, H):
    E = (w - q.dequantize()).astype(np.float64)
    return float(np.trace(E @ H @ E.T))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_gptq_lowers_the_output_error_on_the_same_grid(method):
    rng = np.random.default_rng()
    K = 192
    X = rng.standard_normal((1024, K)) @ (rng.standard_normal((K, K)) * np.exp(rng.uniform(-2, 1, K)))
    H = X.T @ X
    w = rng.standard_normal((80, K)).astype(np.float32)
    plain, gptq = quantize(w, method), gptq_quantize(w, H, method, block=64)  # blocks: 3 of them
    assert gptq.method == method and gptq.codes.dtype == plain.codes.dtype and gptq.shape == w.shape
    assert np.array_equal(gptq.scales, plain.scales)
    if method == "int8":
        assert np.abs(gptq.codes.astype(np.int16)).max() <= INT8_MAX
    else:
        assert np.all(np.isfinite(gptq.dequantize()))
    assert output_error(w, gptq, H) < 0.7 * output_error(w, plain, H)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_uncorrelated_equal_inputs_give_round_to_nearest(method):
    """H⁻¹ diagonal: no error to move, so every code is round-to-nearest's. GPTQ divides by the scale in float64,
    quantize in float32: a value within float32's rounding of a tie between two codes may go either way, and only
    there may the codes differ (a few runs in a hundred draw such a value)."""
    rng = np.random.default_rng()
    w = rng.standard_normal((40, 96)).astype(np.float32)
    got, want = gptq_quantize(w, 7.0 * np.eye(96), method, block=32), quantize(w, method)
    differ = got.codes != want.codes
    x = w.astype(np.float64) / want.scales.astype(np.float64)[:, None]  # in units of the row's scale
    a = (got.dequantize().astype(np.float64) / want.scales[:, None])[differ]
    b = (want.dequantize().astype(np.float64) / want.scales[:, None])[differ]
    assert np.allclose(np.abs(x[differ] - a), np.abs(x[differ] - b), rtol=0, atol=1e-5 * np.abs(x[differ]).max(initial=1))


def test_bad_operands_are_value_errors():
    w = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, np.eye(6), "int8")
    with pytest.raises(ValueError, match="int8"):
        gptq_quantize(w, np.eye(8), "int4")


def test_the_probe_sums_each_inputs_xtx_and_changes_nothing(tmp_path):
    config = tiny_llama_config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=200)
    folder = make_random_llama(tmp_path / "tiny", config, seed=5)
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    rng = np.random.default_rng()
    a, b = rng.integers(0, config.vocab_size, 9), rng.integers(0, config.vocab_size, 5)
    probe, plain = HessianProbe(config, weights), LlamaNumpy(config, weights)
    assert np.array_equal(probe.forward(a), plain.forward(a))
    probe.forward(b)
    assert sorted(probe.hessians) == sorted(n for n in plain.matrices if n != "lm_head")
    # layer 0's QKV input is the normed embedding: its XᵀX over both sequences
    x = np.concatenate([rmsnorm_ref(plain.embed(ids), plain.norms["layers.0.input_layernorm"], config.rms_norm_eps)
                        for ids in (a, b)]).astype(np.float64)
    np.testing.assert_allclose(probe.hessians["layers.0.qkv_proj"], x.T @ x, rtol=1e-5, atol=1e-6)
    # GPTQ's tensors are what the quantized model holds
    name = "layers.1.down_proj"
    q = gptq_quantize(probe.matrices[name], probe.hessians[name], "int8")
    model = QuantizedLlamaNumpy(config, weights, "int8", tensors={name: q})
    assert np.array_equal(model.matrices[name], q.dequantize())
    with pytest.raises(ValueError, match="fp8"):
        QuantizedLlamaNumpy(config, weights, "fp8", tensors={name: q})
