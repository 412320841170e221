"""Chapter 07: the Llama forward pass — NumPy against transformers, the kernel model against NumPy.

Random-weight folders come from tinyvllm_lib.models.random_llama; SmolLM2 is the prepared
embedded model (~/.cache/tinyvllm, built on first use). The kernel model is compared with the
NumPy model run with the same bf16 roundings of the linear layers' inputs (bf16_activations=True):
what is left is the order of float32 sums, which bf16 roundings near a boundary can amplify, so
log-probabilities are compared at each position's five most likely tokens.
"""

import json

import numpy as np
import pytest

from tinyvllm_lib.kernels.rope import check_positions
from tinyvllm_lib.kernels.softmax import log_softmax
from tinyvllm_lib.layers.attention import CausalAttention
from tinyvllm_lib.measure import max_rel_error
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, fuse_llama_weights
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.random_llama import (
    LLAMA_3_2_1B_CONFIG,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.runtime import can_launch

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SMALL_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 64}  # short wavelengths: the scaling changes these positions

HF_CASES = {  # name -> config overrides: GQA, head_dim 64 and 128, llama3 scaling on and off, tied and untied
    "gqa-d64-untied": dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "gqa-d128-llama3-tied": dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1,
                                 head_dim=128, rope_scaling=SMALL_SCALING, tie_word_embeddings=True),
    "mha-d64-llama3-untied": dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=3,
                                  head_dim=64, rope_scaling=SMALL_SCALING, rope_theta=500000.0),
    "gqa-d16-tied-3layers": dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                 hidden_size=96, tie_word_embeddings=True, vocab_size=300),
}


def top_log_prob_gap(ours: np.ndarray, ref: np.ndarray, k: int = 5) -> tuple[float, float]:
    """(mean |Δ log p| over each position's k most likely tokens of ref, max |Δ log p| at its most likely token)."""
    top = np.argsort(-ref, axis=-1)[:, :k]
    rows = np.arange(ref.shape[0])[:, None]
    gap = np.abs(ours[rows, top] - ref[rows, top])
    return float(gap.mean()), float(gap[:, 0].max())


def assert_kernel_model_matches(ours: np.ndarray, ref: np.ndarray, tol: float = 0.05) -> None:
    mean_gap, top_gap = top_log_prob_gap(ours, ref)
    print(f"mean |Δ log p| over the top 5: {mean_gap:.4f}; at the top token: <= {top_gap:.4f}")
    assert mean_gap <= tol, f"kernel model log-probabilities differ by {mean_gap:.3f} on average over the top 5"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    is_clear = top2[:, 1] - top2[:, 0] > 0.1  # a clear first choice must not change
    assert np.array_equal(ours.argmax(-1)[is_clear], ref.argmax(-1)[is_clear]), "a greedy token changed"


@pytest.fixture(scope="module")
def smollm2():
    from tinyvllm_lib.models.smollm2 import resolve_model
    from tinyvllm_lib.tokenizer import Tokenizer

    folder = resolve_model("smollm2")
    return folder, Tokenizer.from_folder(folder).apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)


def hf_log_probs(folder, token_ids, positions) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)]), position_ids=torch.tensor([list(positions)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


# --- weights: random folders and the fused layout ---


def test_random_folder_is_seeded_and_complete(tmp_path):
    cfg = tiny_llama_config(rope_scaling=SMALL_SCALING)
    a = load_weights(make_random_llama(tmp_path / "a", cfg, seed=5), progress=False)
    b = load_weights(make_random_llama(tmp_path / "b", cfg, seed=5), progress=False)
    c = load_weights(make_random_llama(tmp_path / "c", cfg, seed=6), progress=False)
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    config = ModelConfig.from_folder(tmp_path / "a")
    assert config.rope_scaling is not None and config.rope_scaling.original_max_position_embeddings == 64
    assert "lm_head.weight" in a and not config.tie_word_embeddings
    tied = make_random_llama(tmp_path / "t", tiny_llama_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in load_weights(tied, progress=False)
    assert json.loads((tied / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ValueError):
        make_random_llama(tmp_path / "bad", tiny_llama_config(num_key_value_heads=3))


def test_fused_layout(tmp_path):
    cfg = tiny_llama_config()
    config = ModelConfig.from_dict(cfg)
    weights = load_weights(make_random_llama(tmp_path, cfg), config, progress=False)
    fused = fuse_llama_weights(weights, config)
    p = "model.layers.1."
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    qkv = fused["layers.1.qkv_proj"]
    assert qkv.shape == (q_rows + 2 * kv_rows, config.hidden_size) and qkv.dtype == np.uint16
    assert np.array_equal(qkv[:q_rows], weights[p + "self_attn.q_proj.weight"])
    assert np.array_equal(qkv[q_rows : q_rows + kv_rows], weights[p + "self_attn.k_proj.weight"])
    assert np.array_equal(qkv[q_rows + kv_rows :], weights[p + "self_attn.v_proj.weight"])
    gate_up = fused["layers.1.gate_up_proj"]
    assert np.array_equal(gate_up, np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]))
    assert fused["lm_head"] is weights["lm_head.weight"]
    tied = ModelConfig.from_dict(tiny_llama_config(tie_word_embeddings=True))
    assert fuse_llama_weights(weights, tied)["lm_head"] is fused["embed_tokens"]


def test_positions_and_tokens_are_checked(tmp_path):
    model = LlamaNumpy.from_folder(make_random_llama(tmp_path, tiny_llama_config()))
    assert np.array_equal(check_positions(None, 3), [0, 1, 2])
    for bad in ([0, 1], [0, -1, 2], [0.0, 1.0, 2.0]):
        with pytest.raises(ValueError):
            model.forward([1, 2, 3], positions=bad)
    with pytest.raises(ValueError):
        model.forward([1, 2, 256])  # outside the vocabulary
    with pytest.raises(ValueError):
        model.forward([])
    with pytest.raises(ValueError):
        model.forward([1, 2], positions=[0, 1024])  # past max_position_embeddings: no RoPE row for it


def test_numpy_forward_is_causal_and_relative_in_position(tmp_path, rng):
    model = LlamaNumpy.from_folder(make_random_llama(tmp_path, tiny_llama_config()))
    ids = rng.integers(0, 256, 9)
    full = model.forward(ids)
    assert full.shape == (9, 256) and full.dtype == np.float32
    np.testing.assert_allclose(model.forward(ids[:5]), full[:5], rtol=1e-5, atol=1e-5)  # later tokens change nothing
    shifted = model.forward(ids, positions=np.arange(9) + 7)  # RoPE sees only i - j: the same logits
    np.testing.assert_allclose(shifted, full, rtol=1e-3, atol=1e-3)
    gap = model.forward(ids, positions=np.r_[0:8, 30])  # the last token moved away: only its row changes
    np.testing.assert_allclose(gap[:8], full[:8], rtol=1e-5, atol=1e-5)
    assert np.abs(gap[8] - full[8]).max() > 1e-2


# --- the NumPy model against transformers ---


@pytest.mark.parametrize("name", list(HF_CASES))
def test_numpy_matches_transformers(tmp_path, rng, name):
    cfg = tiny_llama_config(**HF_CASES[name])
    folder = make_random_llama(tmp_path, cfg, seed=int(rng.integers(1000)))
    ids = rng.integers(0, cfg["vocab_size"], 14)
    positions = np.arange(14) + int(rng.integers(0, 40))  # explicit, not starting at 0
    ours = log_softmax(LlamaNumpy.from_folder(folder).forward(ids, positions))
    theirs = hf_log_probs(folder, ids, positions)
    err = np.abs(ours - theirs).max()
    print(f"{name}: max |log p - log p_hf| = {err:.2e}")
    assert err < 1e-3
    if cfg.get("rope_scaling"):  # the test can tell scaling from no scaling
        plain = tiny_llama_config(**{**HF_CASES[name], "rope_scaling": None})
        unscaled = log_softmax(LlamaNumpy.from_folder(make_random_llama(tmp_path / "plain", plain, seed=0)).forward(ids, positions))
        assert np.abs(unscaled - ours).max() > 1e-2


def test_numpy_matches_transformers_on_smollm2(smollm2):
    folder, ids = smollm2
    ids = ids[:24]
    ours = log_softmax(LlamaNumpy.from_folder(folder).forward(ids))
    err = np.abs(ours - hf_log_probs(folder, ids, range(len(ids)))).max()
    print(f"SmolLM2, {len(ids)} tokens: max |log p - log p_hf| = {err:.2e}")
    assert err < 1e-3


# --- the kernel model against the NumPy model ---


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
def test_kernel_model_matches_numpy_tiny(tmp_path, rng):
    """2 layers, hidden 32, 4 query / 2 KV heads of 8, vocab 64: small enough for the simulator (chapter 6's linear
    layers dominate there, at about a second of CPU per 16 output rows)."""
    from tinyvllm_lib.models.llama_cuda import LlamaCuda

    cfg = tiny_llama_config(hidden_size=32, intermediate_size=32, vocab_size=64, head_dim=8, tie_word_embeddings=True,
                            rope_scaling=SMALL_SCALING)
    folder = make_random_llama(tmp_path, cfg, seed=int(rng.integers(1000)))
    ids, positions = rng.integers(0, 64, 6), np.arange(3, 9)
    ours = log_softmax(LlamaCuda.from_folder(folder).forward(ids, positions))
    ref = log_softmax(LlamaNumpy.from_folder(folder, bf16_activations=True).forward(ids, positions))
    assert_kernel_model_matches(ours, ref)


@pytest.mark.gpu
def test_kernel_model_matches_numpy_smollm2(smollm2):
    from tinyvllm_lib.models.llama_cuda import LlamaCuda

    folder, ids = smollm2
    ours = log_softmax(LlamaCuda.from_folder(folder).forward(ids))
    assert_kernel_model_matches(ours, log_softmax(LlamaNumpy.from_folder(folder, bf16_activations=True).forward(ids)))
    assert_kernel_model_matches(ours, log_softmax(LlamaNumpy.from_folder(folder).forward(ids)), tol=0.1)  # all float32


@pytest.mark.gpu
def test_kernel_model_matches_numpy_llama_3_2_1b_shapes(tmp_path, rng):
    """Random weights with Llama 3.2 1B's exact shapes (2.5 GB, written on the fly)."""
    from tinyvllm_lib.models.llama_cuda import LlamaCuda

    folder = make_random_llama(tmp_path, LLAMA_3_2_1B_CONFIG, seed=int(rng.integers(1000)))
    ids, positions = rng.integers(0, 128256, 24), np.arange(100, 124)
    ours = log_softmax(LlamaCuda.from_folder(folder).forward(ids, positions))
    assert_kernel_model_matches(ours, log_softmax(LlamaNumpy.from_folder(folder, bf16_activations=True).forward(ids, positions)))


@pytest.mark.gpu
def test_kernel_model_prefill_lengths(tmp_path, rng):
    """Lengths around the attention tile (64) and the GEMV/GEMM switch (16), on one model."""
    from tinyvllm_lib.models.llama_cuda import LlamaCuda

    cfg = tiny_llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            vocab_size=1000, num_hidden_layers=3)
    folder = make_random_llama(tmp_path, cfg, seed=3)
    gpu, ref = LlamaCuda.from_folder(folder), LlamaNumpy.from_folder(folder, bf16_activations=True)
    for num_tokens in (1, 16, 17, 64, 65, 200):
        ids = rng.integers(0, 1000, num_tokens)
        assert_kernel_model_matches(log_softmax(gpu.forward(ids)), log_softmax(ref.forward(ids)))


def test_packed_sequences_equal_separate_forwards(tmp_path, rng):
    """One forward over two sequences back to back (CausalAttention with query_start_loc) = two forwards, to
    float32's rounding: the largest difference within 1e-5 of the largest logit. NumPy's matrix products over 11
    rows and over 7 may add in different orders, so a logit near zero, the sum of terms of the logits' size, may
    differ by more than 1e-5 of itself (a clean-clone CI drew 1.1e-5 on a logit of 0.098, 9e-7 of the largest);
    b's queries attending to a's keys, the bug this test is for, moves the logits by most of their size (0.88)."""
    model = LlamaNumpy.from_folder(make_random_llama(tmp_path, tiny_llama_config()))
    a, b = rng.integers(0, 256, 7), rng.integers(0, 256, 4)
    both = model.forward(np.concatenate([a, b]), np.r_[0:7, 0:4], CausalAttention(model.config, query_start_loc=[0, 7, 11]))
    assert max_rel_error(both[:7], model.forward(a)) < 1e-5
    assert max_rel_error(both[7:], model.forward(b)) < 1e-5
