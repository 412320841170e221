"""Chapter 15's checkpoints: quantize_folder writes a folder of 8-bit codes and row scales that LLM(folder) loads as
they are, on the CPU and onto the GPU (the simulator): round to nearest gives exactly what quantizing at load gives,
GPTQ's folder holds gptq_quantize's codes, two ranks take exact shards; a contradicting quantization= and a corrupted
folder are ValueErrors; the quantize command round trip."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.cli import main
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import fuse_llama_weights
from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, stored_scales
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.models.safetensors_io import SafetensorsFile
from tinyvllm_lib.quantization.calibration import collect_hessians
from tinyvllm_lib.quantization.checkpoint import (
    load_quantized_model,
    load_quantized_weights,
)
from tinyvllm_lib.quantization.formats import quantize
from tinyvllm_lib.quantization.gptq import gptq_quantize
from tinyvllm_lib.quantization.quantizer import quantize_folder
from tinyvllm_lib.runtime import can_launch

METHODS = ("int8", "fp8")
FUSED = ("layers.0.qkv_proj", "layers.1.o_proj", "layers.0.gate_up_proj", "layers.1.down_proj")
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [10, 11, 12]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
STORED = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}  # how to write the reader's bits back


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Tied head; every input size a multiple of 8 (the GPU's 8-bit GEMV); 4 query and 2 KV heads (two ranks)."""
    config = tiny_llama_config(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=24, vocab_size=300, tie_word_embeddings=True)
    return make_random_llama(tmp_path_factory.mktemp("ckpt") / "bf16", config, seed=7)


@pytest.fixture(scope="module")
def rtn(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("rtn")
    return {m: quantize_folder(src, root / m, m, "rtn", progress=False) for m in METHODS}


def generate(folder, **engine_args):
    return LLM(str(folder), "cpu", max_num_seqs=2, **engine_args).generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("method", METHODS)
def test_an_rtn_checkpoint_is_quantizing_at_load(src, rtn, method):
    """The folder's codes and scales, loaded as they are, make the model quantization= makes from the bf16 folder:
    the same matrices, log-probs and greedy tokens, bit for bit; and not bf16's."""
    folder = rtn[method]
    header = SafetensorsFile(folder / "model.safetensors").header
    assert header["model.layers.0.self_attn.k_proj.weight"].dtype == {"int8": "I8", "fp8": "F8_E4M3"}[method]
    assert header["model.layers.0.self_attn.k_proj.weight_scale"].dtype == "F32"
    assert header["model.layers.0.self_attn.k_proj.weight_scale"].shape == (2 * 24,)
    assert header["model.embed_tokens.weight"].dtype == "BF16" and "lm_head.weight_scale" not in header
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "tinyvllm", "format": method, "rounding": "rtn", "lm_head": False,
                  "calibration_tokens": 0}

    llm = LLM(str(folder), "cpu", max_num_seqs=2)
    assert llm.llm_engine.engine_config.quantization == method  # from the folder
    loaded = llm.llm_engine.model_runner.model
    at_load = LLM(str(src), "cpu", max_num_seqs=2, quantization=method).llm_engine.model_runner.model
    assert isinstance(loaded, QuantizedLlamaNumpy) and loaded.quantization == method
    assert loaded.matrices.keys() == at_load.matrices.keys()
    for name, w in at_load.matrices.items():
        assert np.array_equal(loaded.matrices[name], w), name
    ours = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b, c in zip(ours, generate(src, quantization=method), generate(src)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exactly
        assert a.outputs[0].logprobs[0] != c.outputs[0].logprobs[0]  # bf16's differ


@pytest.mark.parametrize("method", METHODS)
def test_a_gptq_checkpoint_holds_gptq_quantizes_codes(src, tmp_path, method):
    rng = np.random.default_rng(0)
    calibration = [rng.integers(0, 300, n) for n in (40, 25, 31)]
    folder = quantize_folder(src, tmp_path / "gptq", method, "gptq", calibration=calibration, progress=False)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["rounding"], qc["calibration_tokens"], qc["calibration_sequences"]) == ("gptq", 96, 3)
    config = ModelConfig.from_folder(src)
    weights = load_weights(src, config, progress=False)
    hessians = collect_hessians(config, weights, calibration)
    stored = load_quantized_weights(folder, config)
    codes, scales = fuse_llama_weights(stored, config), stored_scales(stored, config)
    assert sorted(scales) == sorted(hessians)  # every 8-bit matrix, and only those
    differs_from_rtn = 0
    for name, bits in fuse_llama_weights(weights, config).items():
        if name not in hessians:
            assert np.array_equal(codes[name], bits), name  # bf16 as in the source
            continue
        want = gptq_quantize(bf16_bits_to_f32(bits), hessians[name], method)
        assert np.array_equal(codes[name], want.codes) and np.array_equal(scales[name], want.scales), name
        differs_from_rtn += not np.array_equal(want.codes, quantize(bf16_bits_to_f32(bits), method).codes)
    assert differs_from_rtn == len(hessians)
    model = LLM(str(folder), "cpu").llm_engine.model_runner.model
    want = gptq_quantize(bf16_bits_to_f32(fuse_llama_weights(weights, config)["layers.1.o_proj"]),
                         hessians["layers.1.o_proj"], method)
    assert np.array_equal(model.matrices["layers.1.o_proj"], want.dequantize())


def stacked_from_file(folder, layer: int, parts: tuple[str, ...], suffix: str) -> np.ndarray:
    """The file's own arrays of one fused matrix, read straight from the safetensors."""
    f = SafetensorsFile(folder / "model.safetensors")
    return np.concatenate([f.get(f"model.layers.{layer}.{p}.{suffix}") for p in parts])


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("method", METHODS)
def test_the_gpu_model_holds_the_files_codes(src, rtn, method):
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda

    model = load_quantized_model(rtn[method], "cuda", method)
    assert isinstance(model, QuantizedLlamaCuda)
    for layer, fused, parts in [(0, "qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                (1, "gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")), (1, "down_proj", ("mlp.down_proj",))]:
        w = model.weights[f"layers.{layer}.{fused}"]
        assert isinstance(w, QuantizedLinear) and w.method == method
        assert np.array_equal(w.codes.copy_to_host(), stacked_from_file(rtn[method], layer, parts, "weight"))
        assert np.array_equal(w.scales.copy_to_host(), stacked_from_file(rtn[method], layer, parts, "weight_scale"))
    assert not isinstance(model.weights["lm_head"], QuantizedLinear)
    # tensors= as on the CPU: codes made elsewhere, used as they are
    config = ModelConfig.from_folder(src)
    weights = load_weights(src, config, progress=False)
    w = bf16_bits_to_f32(fuse_llama_weights(weights, config)["layers.1.o_proj"])
    q = gptq_quantize(w, np.cov(np.random.default_rng(1).standard_normal((96, 400))), method)
    gpu = QuantizedLlamaCuda(config, weights, method, tensors={"layers.1.o_proj": q})
    assert np.array_equal(gpu.weights["layers.1.o_proj"].codes.copy_to_host(), q.codes)
    assert not np.array_equal(q.codes, quantize(w, method).codes)


def test_a_contradicting_quantization_is_a_value_error(rtn):
    with pytest.raises(ValueError, match="holds int8 weights.*quantization='fp8'"):
        LLM(str(rtn["int8"]), "cpu", quantization="fp8")
    with pytest.raises(ValueError, match="holds fp8 weights"):
        load_quantized_model(rtn["fp8"], "cpu", "int8")
    llm = LLM(str(rtn["fp8"]), "cpu", quantization="fp8")  # repeating the folder's format is fine
    assert llm.llm_engine.engine_config.quantization == "fp8"


def test_a_checkpoint_takes_quantize_lm_head(src, rtn):
    """A folder quantized offline keeps its head bf16; quantize_lm_head rounds the head as it loads, with the folder's
    own format (no quantization= needed), as quantize_lm_head does from the bf16 folder."""
    llm = LLM(str(rtn["int8"]), "cpu", max_num_seqs=2, quantize_lm_head=True)
    model = llm.llm_engine.model_runner.model
    at_load = LLM(str(src), "cpu", max_num_seqs=2, quantization="int8", quantize_lm_head=True)
    assert model.quantize_lm_head and llm.llm_engine.engine_config.quantization == "int8"
    assert np.array_equal(model.matrices["lm_head"], at_load.llm_engine.model_runner.model.matrices["lm_head"])
    assert not np.array_equal(model.matrices["lm_head"], LLM(str(rtn["int8"]), "cpu").llm_engine.model_runner
                              .model.matrices["lm_head"])  # and not the bf16 head


def corrupt_tensors(name):
    def change(tensors):
        if name == "missing scale":
            del tensors["model.layers.1.mlp.up_proj.weight_scale"]
        elif name == "a scale too short":
            tensors["model.layers.0.self_attn.o_proj.weight_scale"] = np.ones(95, np.float32)
        elif name == "float64 scales":
            tensors["model.layers.0.self_attn.q_proj.weight_scale"] = np.ones(96, np.float64)
        elif name == "bf16 codes":
            tensors["model.layers.1.mlp.down_proj.weight"] = np.ones((96, 160), ml_dtypes.bfloat16)
        elif name == "transposed codes":
            tensors["model.layers.1.mlp.down_proj.weight"] = np.ones((160, 96), np.int8)
        elif name == "a NaN scale":
            tensors["model.layers.0.mlp.gate_proj.weight_scale"] = np.full(160, np.nan, np.float32)
        elif name == "a scale of a bf16 tensor":
            tensors["model.norm.weight_scale"] = np.ones(96, np.float32)
    return change


@pytest.mark.parametrize("fault, match", [
    ("missing scale", "up_proj.weight_scale' is missing"), ("a scale too short", r"needs F32 \[96\]"),
    ("float64 scales", "is F64"), ("bf16 codes", "is BF16"), ("transposed codes", r"\[160, 96\]"),
    ("a NaN scale", "NaN"), ("a scale of a bf16 tensor", "norm.weight_scale"),
    ("quant_method", "quant_method 'gptq'"), ("format", "'int4'"), ("lm_head", "lm_head"),
])
def test_a_corrupted_checkpoint_is_a_value_error(rtn, tmp_path, fault, match):
    folder = tmp_path / "corrupt"
    shutil.copytree(rtn["int8"], folder)
    if fault in ("quant_method", "format", "lm_head"):
        raw = json.loads((folder / "config.json").read_text())
        raw["quantization_config"].update({"quant_method": {"quant_method": "gptq"}, "format": {"format": "int4"},
                                           "lm_head": {"lm_head": True}}[fault])
        (folder / "config.json").write_text(json.dumps(raw))
    else:
        f = SafetensorsFile(rtn["int8"] / "model.safetensors")
        tensors = {n: f.get(n).view(STORED.get(f.header[n].dtype, f.get(n).dtype)) for n in f.names()}
        corrupt_tensors(fault)(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), "cpu")


def test_two_ranks_take_exact_shards_of_a_checkpoint(rtn):
    """Rank 0's rows of q, k, v, gate, up (and their scales) and columns of o and down (with every row's scale) are
    the one-rank model's values exactly; the answers are one rank's, up to the order of the all-reduce's sums."""
    one = LLM(str(rtn["int8"]), "cpu", max_num_seqs=2)
    whole = one.llm_engine.model_runner.model
    llm = LLM(str(rtn["int8"]), "cpu", max_num_seqs=2, tensor_parallel_size=2, distributed_timeout=30)
    try:
        two = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        model = llm.llm_engine.model_runner.driver.model
    finally:
        llm.llm_engine.shutdown()
    assert isinstance(model, QuantizedLlamaNumpy)
    q_rows, kv_rows = 2 * 24, 24  # rank 0's heads are the first of each kind
    qkv, mine = whole.matrices["layers.0.qkv_proj"], model.matrices["layers.0.qkv_proj"]
    assert np.array_equal(mine, np.concatenate([qkv[:q_rows], qkv[96 : 96 + kv_rows], qkv[144 : 144 + kv_rows]]))
    assert np.array_equal(model.matrices["layers.1.o_proj"], whole.matrices["layers.1.o_proj"][:, :q_rows])
    assert np.array_equal(model.matrices["layers.0.down_proj"], whole.matrices["layers.0.down_proj"][:, :80])
    for a, b in zip(one.generate(PROMPTS, PARAMS, use_tqdm=False), two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        gaps = [abs(a.outputs[0].logprobs[t][tok] - b.outputs[0].logprobs[t][tok])
                for t, tok in enumerate(a.outputs[0].token_ids)]
        assert max(gaps) < 1e-4, gaps


def test_the_quantize_command_round_trip(src, tmp_path, capsys):
    dst = tmp_path / "fp8"
    assert main(["quantize", str(src), str(dst), "--quantization", "fp8", "--rounding", "rtn"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(dst)
    for a, b in zip(generate(dst), generate(src, quantization="fp8")):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    with pytest.raises(SystemExit, match="not empty"):
        main(["quantize", str(src), str(dst), "--quantization", "int8", "--rounding", "rtn"])
    with pytest.raises(SystemExit, match="holds 8-bit weights already"):
        main(["quantize", str(dst), str(tmp_path / "again"), "--quantization", "int8", "--rounding", "rtn"])
    with pytest.raises(SystemExit, match="no tokenizer.json"):  # GPTQ calibrates on chat
        main(["quantize", str(src), str(tmp_path / "gptq"), "--quantization", "int8"])
    with pytest.raises(SystemExit):
        main(["quantize", str(src), str(tmp_path / "x"), "--quantization", "int8", "--rounding", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err


def test_the_quantize_command_calibrates_gptq_on_chat(tmp_path, capsys):
    """A tiny random Llama with SmolLM2's tokenizer: the command asks it two of the calibration questions, and the
    folder's XᵀX is that of the two chats (the prompt and the model's greedy answer)."""
    from tinyvllm_lib.models.smollm2 import resolve_model
    from tinyvllm_lib.quantization.calibration import (
        CALIBRATION_QUESTIONS,
        chat_calibration,
    )

    smol = resolve_model("smollm2")
    src = make_random_llama(tmp_path / "bf16", tiny_llama_config(vocab_size=49152, tie_word_embeddings=True), seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smol / name, src / name)
    dst = tmp_path / "int8"
    assert main(["quantize", str(src), str(dst), "--quantization", "int8", "--num-calibration-samples", "2",
                 "--dampening-frac", "0.05"]) == 0
    calibration = chat_calibration(src, 2)
    assert len(calibration) == 2 and all(len(ids) > 20 for ids in calibration)
    llm = LLM(str(src), "cpu")
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": CALIBRATION_QUESTIONS[1]}],
                                                     tokenize=True)
    assert list(calibration[1][: len(prompt)]) == list(prompt)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["calibration_tokens"] == sum(map(len, calibration)) and qc["dampening_frac"] == 0.05
    config = ModelConfig.from_folder(src)
    weights = load_weights(src, config, progress=False)
    H = collect_hessians(config, weights, calibration)["layers.1.gate_up_proj"]
    w = bf16_bits_to_f32(fuse_llama_weights(weights, config)["layers.1.gate_up_proj"])
    stored = load_quantized_weights(dst, config)
    assert np.array_equal(fuse_llama_weights(stored, config)["layers.1.gate_up_proj"],
                          gptq_quantize(w, H, "int8", damp=0.05).codes)
    assert isinstance(LLM(str(dst), "cpu").llm_engine.model_runner.model, QuantizedLlamaNumpy)
    assert not isinstance(llm.llm_engine.model_runner.model, QuantizedLlamaNumpy)  # the source: bf16
