"""ModelConfig from config.json in every form found in the wild, and its errors (chapters/02_safetensors.py)."""

import json

import pytest

from tinyvllm_lib.models.config import Llama3RopeScaling, ModelConfig, parse_rope

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json (transformers 4.42)
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}
LLAMA3 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
LLAMA_32_1B = {  # Llama 3.2 1B Instruct's config.json (transformers 4.45)
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {**LLAMA3, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
SIZES = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_smollm2_config():
    c = ModelConfig.from_dict(SMOLLM2)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (576, 9, 3, 64)
    assert c.rope_theta == 100000.0 and isinstance(c.rope_theta, float) and c.rope_scaling is None
    assert c.rope_type == "default" and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.dtype == "bfloat16"


def test_llama_32_1b_config_with_generation_config():
    c = ModelConfig.from_dict(
        LLAMA_32_1B, {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "top_p": 0.9}
    )
    assert c.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192) and c.rope_type == "llama3"
    assert c.rope_theta == 500000.0 and c.head_dim == 64 and c.num_key_value_heads == 8
    assert c.eos_token_ids == (128001, 128008, 128009) and c.max_position_embeddings == 131072


@pytest.mark.parametrize(
    "rope, theta, scaling",
    [
        ({"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "rope_type": "llama3"}}, 5e5, True),
        ({"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "type": "llama3"}}, 5e5, True),  # the older key
        ({"rope_theta": 1e4, "rope_scaling": None}, 1e4, False),
        ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "default"}}, 1e4, False),
        ({"rope_theta": 1e4, "rope_scaling": {"type": "default"}}, 1e4, False),
        ({"rope_theta": 2e4}, 2e4, False),
        ({}, 1e4, False),  # transformers' default theta
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, 1e5, False),  # transformers 5
        ({"rope_parameters": {**LLAMA3, "rope_type": "llama3", "rope_theta": 5e5}}, 5e5, True),
        ({"rope_theta": 3e5, "rope_parameters": {"rope_type": "default"}}, 3e5, False),  # theta outside the dict
        ({"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7e4}}, 7e4, False),
    ],
)
def test_every_rope_form(rope, theta, scaling):
    c = ModelConfig.from_dict({**SIZES, **rope})
    assert c.rope_theta == theta and (c.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)) == scaling
    assert parse_rope({**SIZES, **rope}) == (theta, c.rope_scaling)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "su", "mrope"])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type_is_a_clear_error(rope_type, key):
    with pytest.raises(ValueError, match=f"unsupported RoPE type '{rope_type}': this book implements default, llama3"):
        ModelConfig.from_dict({**SIZES, key: {"rope_type": rope_type, "factor": 4.0}})


@pytest.mark.parametrize(
    "rope, message",
    [
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 needs low_freq_factor, high_freq_factor, original_max",
        ),
        (
            {"rope_scaling": {**LLAMA3, "rope_type": "llama3", "high_freq_factor": 1.0}},
            "high_freq_factor > low_freq_factor",
        ),
        ({"rope_scaling": {**LLAMA3, "rope_type": "llama3", "factor": 0}}, "factor must be a positive number"),
        (
            {"rope_scaling": {**LLAMA3, "rope_type": "llama3", "original_max_position_embeddings": 8.5}},
            "original_max_position_embeddings",
        ),
        ({"rope_scaling": "llama3"}, "rope_scaling must be null or a dict"),
        ({"rope_parameters": [1, 2]}, "rope_parameters must be a dict"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "default"},
                }
            },
            "per-layer-type RoPE parameters",
        ),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number"),
        ({"rope_theta": "1e4"}, "rope_theta must be a positive number"),
    ],
)
def test_bad_rope_settings(rope, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**SIZES, **rope})


def test_defaults_for_optional_fields():
    c = ModelConfig.from_dict(SIZES)
    assert c.num_key_value_heads == 4 and c.head_dim == 8 and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 2048 and not c.tie_word_embeddings and c.rope_theta == 1e4
    assert c.bos_token_id is None and c.eos_token_ids == () and c.dtype == "bfloat16"
    explicit = ModelConfig(**SIZES, head_dim=16)  # head_dim need not be hidden / heads
    assert explicit.head_dim == 16 and explicit.num_key_value_heads == 4


@pytest.mark.parametrize(
    "eos, generation_eos, want",
    [(2, None, (2,)), ([2, 3], None, (2, 3)), (2, [3, 2], (2, 3)), (None, 5, (5,)), ([], [], ()), (None, None, ())],
)
def test_eos_ids_are_merged(eos, generation_eos, want):
    generation = None if generation_eos is None else {"eos_token_id": generation_eos}
    assert ModelConfig.from_dict({**SIZES, "eos_token_id": eos}, generation).eos_token_ids == want


@pytest.mark.parametrize("key, value", [("dtype", "float32"), ("torch_dtype", "float16"), ("torch_dtype", None)])
def test_dtype_from_either_key(key, value):
    assert ModelConfig.from_dict({**SIZES, key: value}).dtype == (value or "bfloat16")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"hidden_size": 30}, r"hidden_size \(30\) is not a multiple of num_attention_heads \(4\); give head_dim"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"hidden_size": -32}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer"),
        ({"intermediate_size": True}, "intermediate_size must be a positive integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
        ({"max_position_embeddings": -1}, "max_position_embeddings"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list"),
        ({"eos_token_id": [2, -1]}, "eos_token_id must be a token id or a list"),
        ({"eos_token_id": 100}, "must be below vocab_size"),
        ({"bos_token_id": 1.0}, "bos_token_id must be a token id"),
        ({"dtype": "int8"}, "dtype must be bfloat16, float16 or float32"),
        ({"model_type": "qwen2"}, "model_type 'qwen2' is not supported"),
        ({"attention_bias": True}, "without biases"),
        ({"hidden_act": "gelu"}, "SiLU"),
    ],
)
def test_invalid_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**SIZES, **change})


@pytest.mark.parametrize("key", list(SIZES))
def test_missing_required_size(key):
    config = {k: v for k, v in SIZES.items() if k != key}
    with pytest.raises(ValueError, match=f"config is missing {key}"):
        ModelConfig.from_dict(config)


def test_from_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    assert ModelConfig.from_folder(tmp_path).eos_token_ids == (128001, 128008, 128009)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128009, 7]}))
    assert ModelConfig.from_folder(tmp_path).eos_token_ids == (128001, 128008, 128009, 7)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_32_1B, "rope_scaling": {"rope_type": "yarn"}}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported RoPE type 'yarn'"):
        ModelConfig.from_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_folder(tmp_path / "nowhere")


def test_config_is_frozen():
    c = ModelConfig(**SIZES)
    with pytest.raises(AttributeError):
        c.hidden_size = 64


@pytest.mark.parametrize("scaling", [None, {**LLAMA3, "rope_type": "llama3"}])
def test_agrees_with_a_config_saved_by_transformers(tmp_path, scaling):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=16384,
        rope_theta=5e5,
        rope_scaling=scaling,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    theirs.save_pretrained(tmp_path)  # transformers 5 writes the rope_parameters form
    ours = ModelConfig.from_folder(tmp_path)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    params = theirs.rope_parameters
    assert ours.rope_theta == params["rope_theta"] and ours.rope_type == params["rope_type"]
    if scaling:
        assert ours.rope_scaling == Llama3RopeScaling(**{k: params[k] for k in LLAMA3})
    assert ours.eos_token_ids == (2, 3) and ours.bos_token_id == 1
