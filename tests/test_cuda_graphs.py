"""Chapter 11's CUDA graphs: the batch-size buckets, the packed decode inputs, and the graph
runner against the eager one. In the simulator a replay launches again, so these check the
padding and the packing; the GPU-marked tests check real captures, replayed while positions,
context lengths and sampling settings change."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from compare import agrees, shared_logprob_gaps

import tinyvllm_lib.engine.cuda_graphs as cuda_graphs_module
from tinyvllm_lib.engine.cuda_graphs import (
    CudaGraphs,
    GpuLogprobsSampler,
    cuda_graph_sizes,
    graph_size_for,
    prefill_graph_shapes,
    prefill_shape_for,
)
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.input_batch import InputBatch, PackedInputs, StepShape
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.kernels.decode_splits import split_rows
from tinyvllm_lib.kernels.logprobs import MAX_LOGPROBS
from tinyvllm_lib.kernels.sampling_radix import NUM_STEPS
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.runtime import can_launch, has_gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = tiny_llama_config(vocab_size=256, max_position_embeddings=1024)
    return make_random_llama(tmp_path_factory.mktemp("graphs"), config, seed=5)


def test_graph_sizes_are_vllms_buckets():
    assert cuda_graph_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert cuda_graph_sizes(1) == [1] and cuda_graph_sizes(12) == [1, 2, 4, 8, 12]
    sizes = cuda_graph_sizes(40)
    assert [graph_size_for(n, sizes) for n in (1, 3, 5, 8, 9, 33, 40, 41)] == [1, 4, 8, 8, 16, 40, 40, None]
    # a padded step splits its contexts as the step itself (chapter 8's split_rows): every size, every max_num_seqs
    for max_num_seqs in (1, 12, 40, 256, 300):
        sizes = cuda_graph_sizes(max_num_seqs)
        assert all(split_rows(graph_size_for(n, sizes)) == split_rows(n) for n in range(1, max_num_seqs + 1))


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_packed_inputs_round_trip_every_field(rng):
    packed = PackedInputs(max_tokens=24, max_rows=16, max_blocks=7)
    for tokens, rows, turn in ((1, 1, 0), (9, 5, 1), (24, 16, 0), (16, 16, 1)):
        host, device, (to, source) = packed.layout(tokens, rows, turn)
        want = {}
        for name, view in host.items():
            values = rng.integers(-5, 1000, view.shape) if view.dtype.kind == "i" else rng.random(view.shape)
            view[...] = values
            want[name] = view.copy()
            assert view.ctypes.data % view.dtype.itemsize == 0  # aligned
        to.copy_to_device(source)
        for name, view in device.items():
            np.testing.assert_array_equal(view.copy_to_host(), want[name], err_msg=name)
    with pytest.raises(ValueError, match="a packed step holds"):
        packed.layout(25, 1, 0)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
@pytest.mark.parametrize("turn", [0, 1])
def test_a_packed_step_feeds_forward_only_the_rows_it_says(rng, turn):
    """Either host buffer, whatever an earlier step left in it: a step the host knows whole has prev_rows -1 in
    every row (its ids stand), a step scheduled ahead has its own; padding rows -1 too."""
    packed = PackedInputs(max_tokens=8, max_rows=8, max_blocks=4)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    requests = []
    for i in range(3):
        r = new_request(f"r{i}", rng.integers(0, 100, 5).tolist(), params)
        r.output_token_ids.append(7)
        r.num_computed_tokens = 5
        requests.append(r)
    tables = np.array([[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]], np.int32)
    step = SchedulerOutput(requests, [1, 1, 1], 0, tables)
    host = packed.layout(4, 4, turn)[0]
    host["prev_rows"][:] = rng.integers(0, 3, 4)  # what an earlier step ahead left
    batch = InputBatch.from_step(step, 16)
    packed.pack(batch, turn, pad_to=4)
    assert host["prev_rows"].tolist() == [-1, -1, -1, -1] and host["token_ids"][:3].tolist() == [7, 7, 7]
    assert host["slot_mapping"][3] == -1 and host["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    ahead = InputBatch.from_step(SchedulerOutput(requests, [1, 1, 1], 0, tables, np.array([2, 0, 1])), 16)
    packed.pack(ahead, turn, pad_to=4)
    assert host["prev_rows"].tolist() == [2, 0, 1, -1] and host["token_ids"][:3].tolist() == [0, 0, 0]
    assert host["positions"][:3].tolist() == [6, 6, 6] and host["seq_lens"][:3].tolist() == [7, 7, 7]
    assert host["slot_mapping"][:3].tolist() == [16 * b + 6 for b in (1, 2, 3)]
    assert ahead.device is packed.layout(4, 4, turn)[1] and ahead.cudagraph_size == 4


def new_request(rid, prompt, params):
    return Request(rid, None, list(prompt), params, params.max_tokens, eos_token_ids=(), generator=np.random.default_rng(params.seed))


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """Smaller still than the tiny Llama: the simulator runs every GPU thread in Python."""
    config = tiny_llama_config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )
    return make_random_llama(tmp_path_factory.mktemp("graphs_small"), config, seed=6)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_graph_runner_decodes_like_the_eager_one_and_padding_writes_nothing(small_folder, monkeypatch, rng):
    """Three requests with contexts already in the cache (the same random K/V for both runners) decode; the graph
    runner replays the graph of 4, one padding row. A greedy, a seeded-sampled and (on a GPU) a top-k/top-p row
    give the eager runner's tokens and log-probs, and a step writes no cache slot but its rows' own."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),  # the top 3 too, from the GPU path
        SamplingParams(temperature=0.9, seed=7, max_tokens=8, logprobs=0),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=3, max_tokens=8, logprobs=0),
    ]
    steps = 6
    if not has_gpu():  # one step, and no top-k/top-p bisection: in Python threads they take minutes
        params, steps = [params[0], params[1], params[0]], 1
    contexts = [rng.integers(0, 128, n).tolist() for n in (5, 17, 30)]
    tables = np.array([[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0]], np.int32)
    results = []
    for with_graphs in (False, True):
        config = EngineConfig(device="cuda", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
        # log-probs: the host's (eager), the GPU's (graphs)
        runner = ModelRunner(small_folder, config, 128, sampler=GpuLogprobsSampler if with_graphs else None)
        replays = []
        if with_graphs:
            runner.graphs = CudaGraphs(runner, progress=False)
            assert sorted(runner.graphs.graphs) == [1, 2, 4]
            graph = runner.graphs.graphs[4]
            graph.replay = lambda g=graph, f=graph.replay: (replays.append(g), f())[1]  # count the replays
        cache_rng = np.random.default_rng(1)  # the same cache contents for both runners
        for layer in runner.kv_cache.k + runner.kv_cache.v:
            values = cache_rng.standard_normal(layer.shape).astype(ml_dtypes.bfloat16).view(np.uint16)
            layer.copy_to_device(values)
        requests = []
        for i, (c, sp) in enumerate(zip(contexts, params)):
            r = new_request(f"r{i}", c[:-1], sp)
            r.output_token_ids.append(c[-1])  # its last token is new: a decode row
            r.num_computed_tokens = len(c) - 1
            requests.append(r)
        tokens, logprobs, tops = [], [], []
        for _ in range(steps):
            step = SchedulerOutput(requests, [1, 1, 1], 0, tables)
            before = [a.copy_to_host() for a in runner.kv_cache.k + runner.kv_cache.v]
            # each row's new token sits at position num_tokens - 1
            slots = {int(16 * tables[i, (r.num_tokens - 1) // 16] + (r.num_tokens - 1) % 16) for i, r in enumerate(requests)}
            out = runner.execute(step)
            for b, layer in zip(before, runner.kv_cache.k + runner.kv_cache.v):
                a = layer.copy_to_host()
                changed = np.nonzero(np.any(b.reshape(len(b), -1) != a.reshape(len(a), -1), axis=1))[0]
                assert set(changed.tolist()) <= slots  # no slot but the three rows' own
            tokens.append(out.sampled.token_ids.tolist())
            logprobs.append(out.sampled.logprobs)
            tops.append((out.sampled.top_ids[:, :3].tolist(), out.sampled.top_logprobs[:, :3]))
            for r, t in zip(requests, out.sampled.token_ids):
                r.num_computed_tokens += 1
                r.output_token_ids.append(int(t))
        assert len(replays) == (steps if with_graphs else 0)  # every step replayed the graph of 4
        results.append((tokens, np.array(logprobs), tops))
    (eager_tokens, eager_lp, eager_top), (graph_tokens, graph_lp, graph_top) = results
    assert graph_tokens == eager_tokens
    assert np.abs(graph_lp - eager_lp).max() < 1e-2
    for (ei, ev), (gi, gv) in zip(eager_top, graph_top):  # the host's top 3 (eager) and the GPU's (graphs)
        assert ei[0] == gi[0] and np.abs(ev[0] - gv[0]).max() < 1e-2  # row 0 asked for them


def test_prefill_shapes_are_buckets_that_hold_every_step():
    """Every prefill or mixed step up to the largest bucket finds the smallest shape that holds its tokens, rows
    and sampled rows; a larger one finds none (it runs eagerly)."""
    shapes = prefill_graph_shapes(8192, 48)
    assert [s for s in shapes if s.tokens == 16] == [StepShape(16, 16, n, True) for n in (1, 4, 16)]
    assert {s.rows for s in shapes if s.tokens >= 64} == {48}
    for tokens, rows, sampled in [(1, 1, 1), (17, 3, 2), (100, 48, 5), (4096, 48, 48), (2000, 20, 0)]:
        shape = prefill_shape_for(tokens, rows, sampled, shapes)
        assert shape.tokens >= tokens and shape.rows >= rows and shape.sampled >= sampled
        smaller = [s for s in shapes if s.tokens >= tokens and s.rows >= rows and s.sampled >= sampled]
        assert shape == min(smaller, key=lambda s: (s.tokens, s.sampled))
    assert prefill_shape_for(4097, 1, 1, shapes) is None
    assert max(s.tokens for s in prefill_graph_shapes(100, 8)) == 100  # the step budget is the last bucket


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_a_mixed_step_replays_a_prefill_graph_like_the_eager_runner(small_folder, monkeypatch):
    """A step with a prompt from position 0 that ends mid-prompt (no token due), a prompt's last chunk after 6
    cached tokens, and a decode row: 13 tokens of 3 requests, 2 due a token, replay the prefill graph of 16
    tokens with the head on 4 rows. Greedy and seeded rows give the eager runner's tokens and log-probs, and the
    step writes the new tokens' slots with the eager runner's values and no other slot."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 128, n).tolist() for n in (10, 11, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=0),
              SamplingParams(temperature=0.9, seed=5, max_tokens=4, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)]
    tables = np.array([[1, 0, 0, 0], [2, 0, 0, 0], [3, 4, 0, 0]], np.int32)
    computed, new = [0, 6, 19], [7, 5, 1]
    results = []
    for with_graphs in (False, True):
        config = EngineConfig(device="cuda", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
        runner = ModelRunner(small_folder, config, 128, sampler=GpuLogprobsSampler)
        replays = []
        if with_graphs:
            runner.graphs = CudaGraphs(runner, progress=False)
            assert sorted(runner.graphs.prefill_graphs) == [StepShape(t, 4, n, True) for t in (16, 32) for n in (1, 4)]
            graph = runner.graphs.prefill_graphs[StepShape(16, 4, 4, True)]
            graph.replay = lambda g=graph, f=graph.replay: (replays.append(g), f())[1]
        cache_rng = np.random.default_rng(1)  # the same cache contents for both runners
        for layer in runner.kv_cache.k + runner.kv_cache.v:
            layer.copy_to_device(cache_rng.standard_normal(layer.shape).astype(ml_dtypes.bfloat16).view(np.uint16))
        requests = []
        for i, (prompt, sp, c) in enumerate(zip(prompts, params, computed)):
            r = new_request(f"r{i}", prompt if i < 2 else prompt[:-1], sp)
            if i == 2:
                r.output_token_ids.append(prompt[-1])  # its last token is new: a decode row
            r.num_computed_tokens = c
            requests.append(r)
        step = SchedulerOutput(requests, new, 2, tables)
        before = [a.copy_to_host() for a in runner.kv_cache.k + runner.kv_cache.v]
        out = runner.execute(step)
        after = [a.copy_to_host() for a in runner.kv_cache.k + runner.kv_cache.v]
        slots = {int(16 * tables[i, p // 16] + p % 16) for i in range(3) for p in range(computed[i], computed[i] + new[i])}
        for b, a in zip(before, after):
            changed = np.nonzero(np.any(b.reshape(len(b), -1) != a.reshape(len(a), -1), axis=1))[0]
            assert set(changed.tolist()) <= slots  # no slot but the new tokens' own
        assert len(replays) == with_graphs
        results.append((out.sampled.token_ids.tolist(), out.sampled.logprobs, after))
    (eager_ids, eager_lp, eager_cache), (graph_ids, graph_lp, graph_cache) = results
    assert len(eager_ids) == 2 and graph_ids == eager_ids
    assert np.abs(graph_lp - eager_lp).max() < 1e-5
    assert all(np.array_equal(e, g) for e, g in zip(eager_cache, graph_cache))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_gpu_graphs_give_the_eager_tokens(folder, model, rng, monkeypatch):
    """Real captures: 40 requests of varied lengths through LLM with graphs and with enforce_eager; requests
    finish at different steps, so the batch shrinks through the sizes and the contexts grow.

    Twice: with a graph for every batch size (no step is padded), and with vLLM's sizes, where a step of 25 rows
    runs as 32. Both must give every token, greedy or seeded, of the eager path, log-probs within 1e-4 (the eager
    path takes its log-probs on the host, the graphs on the GPU). The padded run does because decode attention
    chooses its splits for the rows rounded up to a graph's size (chapter 8's split_rows), in the eager path too;
    before it did, padded steps moved log-probs by up to 0.028 on SmolLM2 (measured on the H200), and with one
    split everywhere by 3e-6: the GEMMs at 32 rows gave the numbers of 25."""
    path = folder if model == "tiny" else "smollm2"
    vocab = 256 if model == "tiny" else 49152
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 200))).tolist() for _ in range(40)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 60)), logprobs=1, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            temperature=0.8, top_p=0.95, top_k=[0, 20][i % 4 == 1], seed=i, max_tokens=int(rng.integers(1, 60)), ignore_eos=True
        )
        for i in range(40)
    ]

    def run(eager: bool, every_size: bool = False):
        with monkeypatch.context() as m:
            if every_size:
                m.setattr(cuda_graphs_module, "cuda_graph_sizes", lambda n: list(range(1, n + 1)))
            llm = LLM(path, device="cuda", max_model_len=512, max_num_seqs=48, enforce_eager=eager)
            runner = llm.llm_engine.model_runner
            assert (runner.graphs is None) == eager
            assert eager or runner.graphs.sizes == (list(range(1, 49)) if every_size else cuda_graph_sizes(48))
            assert llm.llm_engine.async_scheduling != eager  # graphs overlap the host's work by default
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
        return outs

    eager = run(True)
    greedy = [i for i in range(40) if i % 2 == 0]
    for label, graphs in [("a graph for every size", run(False, every_size=True)), ("vLLM's sizes", run(False))]:
        same = sum(e.token_ids == g.token_ids for e, g in zip(eager, graphs))
        gaps = np.concatenate([shared_logprob_gaps(eager[i], graphs[i]) for i in greedy])
        print(f"{model}, {label}: {same}/40 identical, max |Δ log p| {gaps.max():.2e}")
        assert same == 40 and gaps.max() < 1e-4


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
@pytest.mark.parametrize("k", [0, 1, 20])
def test_gpu_logprobs_match_numpy(rng, k):
    from numba import cuda

    from tinyvllm_lib.engine.sampler import top_logprobs
    from tinyvllm_lib.kernels.logprobs import (
        MAX_LOGPROBS,
        gpu_logprobs,
        logprobs_workspace,
    )
    from tinyvllm_lib.kernels.softmax import log_softmax

    rows, vocab = 4, 700 if not has_gpu() else 128256
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[2, 100:110] = logits[2].max() + 2  # ten equal logits on top: smaller index first
    logits[3, :] = -1e30
    logits[3, 5] = 0.0  # one token holds all the mass
    picked = rng.integers(0, vocab, rows)
    chosen = cuda.device_array(rows, np.float32)
    ids, values = cuda.device_array((rows, MAX_LOGPROBS), np.int64), cuda.device_array((rows, MAX_LOGPROBS), np.float32)
    workspace = logprobs_workspace(rows)
    for _ in range(2):  # the tickets are back at zero after a launch
        gpu_logprobs(cuda.to_device(logits), cuda.to_device(picked), k, chosen, ids, values, workspace)
    assert not workspace["tickets"].copy_to_host().any()
    want = log_softmax(logits)
    np.testing.assert_allclose(chosen.copy_to_host(), want[np.arange(rows), picked], atol=2e-5, rtol=1e-5)
    if k:
        want_ids, want_values = top_logprobs(want, k)
        got_ids, got_values = ids.copy_to_host()[:, :k], values.copy_to_host()[:, :k]
        np.testing.assert_allclose(got_values, want_values, atol=2e-5, rtol=1e-5)
        assert (got_ids[:2] == want_ids[:2]).all()
        assert got_ids[2, : min(k, 10)].tolist() == list(range(100, 100 + min(k, 10)))
        assert got_ids[3, 0] == 5 and got_values[3, 0] == 0.0
    with pytest.raises(ValueError, match="k must be in"):
        gpu_logprobs(cuda.to_device(logits), cuda.to_device(picked), MAX_LOGPROBS + 1, chosen, ids, values, workspace)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
@pytest.mark.parametrize("k", [0, 3, MAX_LOGPROBS + 1])
def test_gpu_prompt_logprobs_are_the_hosts(rng, k):
    """A prompt chunk's log-probs on the GPU (GpuLogprobsSampler: the logprobs kernel, max_rows rows a launch) are
    the host's (CudaSampler: the rows copied, then NumPy), over more rows than one launch takes; past MAX_LOGPROBS
    the GPU sampler goes the host's way."""
    from numba import cuda

    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    rows, vocab, max_rows = 11, 300 if not has_gpu() else 128256, 4
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    d_logits = cuda.to_device(logits)
    want = CudaSampler(vocab, max_rows).prompt_logprobs(d_logits, targets, k)
    got = GpuLogprobsSampler(vocab, max_rows).prompt_logprobs(d_logits, targets, k)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=1e-5)
    if k == 0:
        assert got[1] is None and want[1] is None
    else:
        assert got[1].shape == (rows, k) and (got[1] == want[1]).all()
        np.testing.assert_allclose(got[2], want[2], atol=2e-5, rtol=1e-5)


def generate_counting_replays(llm, prompts, params, shapes: list | None = None) -> tuple[list, list[bool]]:
    """llm.generate's first completions, and for each replayed step whether it was planned ahead of its tokens
    (engine with graphs and the overlap); shapes, if given, gets each replayed step's shape."""
    engine, ahead = llm.llm_engine, []
    assert engine.async_scheduling and engine.model_runner.graphs is not None
    launch = engine.model_runner.execute_async

    def counted(step):
        out = launch(step)
        if out.cudagraph_size is not None:
            ahead.append(step.prev_rows is not None)
            if shapes is not None:
                shapes.append(out.cudagraph_shape)
        return out

    engine.model_runner.execute_async = counted
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)], ahead


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_llm_with_graphs_and_overlap_gives_the_cpu_engines_tokens(small_folder, monkeypatch, rng):
    """The whole engine in the simulator: two requests decode through replayed graphs, the second step launched
    before the first is post-processed (its ids fed forward by next_ids on the device), one request finishing a
    step before the other; the tokens are the NumPy engine's (compared as in the batching issue)."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 9)]
    # the second request (row 1) outlives the first: its ahead step feeds row 1's sample into row 0
    params = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)]
    want = [o.outputs[0] for o in LLM(small_folder, device="cpu", max_model_len=64).generate(prompts, params, use_tqdm=False)]
    llm = LLM(small_folder, device="cuda", max_model_len=64, max_num_seqs=2, num_kv_blocks=8)
    engine, shapes = llm.llm_engine, []
    got, ahead = generate_counting_replays(llm, prompts, params, shapes)
    for w, g in zip(want, got):
        same, _ = agrees(w.token_ids, w.logprobs, g.token_ids, tie=0.02)
        assert same and len(g.token_ids) == len(w.token_ids), (w.token_ids, g.token_ids)
    # decode 1 launched, decode 2 (the second request alone) launched ahead of it; the pool empty again
    assert ahead == [False, True] and engine.block_manager.num_used_blocks == 0
    # greedy rows that ask for log-probs: the graph of every sampling kernel, not the argmax_only one
    assert shapes and not any(s.argmax_only for s in shapes)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_greedy_steps_replay_the_argmax_only_graph(small_folder, monkeypatch, rng):
    """Decode steps whose rows are all greedy and ask for nothing more replay their size's argmax_only graph, whose
    sampler launches the argmax alone, and give the NumPy engine's tokens (its log-probs, asked of it alone, mark
    near ties). Rows that ask for log-probs replay the other graph: test_llm_with_graphs_and_overlap_... checks that
    (every sampling kernel of a replay costs minutes in the simulator's threads)."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 9)]
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    cpu = LLM(small_folder, device="cpu", max_model_len=64)
    llm = LLM(small_folder, device="cuda", max_model_len=64, max_num_seqs=2, num_kv_blocks=8)
    runner = llm.llm_engine.model_runner
    graphs, sampler = runner.graphs, runner.sampler
    assert sorted(graphs.argmax_graphs) == sorted(graphs.graphs) == [1, 2]
    # in the simulator a replay runs the step again: record what the sampler launches inside each replay
    shapes, replaying, launched = [], [], []
    replay, launch = graphs.replay, sampler.launch

    def counted_replay(shape):
        shapes.append(shape)
        replaying.append(shape)
        try:
            return replay(shape)
        finally:
            replaying.pop()

    def counted_launch(logits, stream, rows, steps=range(NUM_STEPS), penalize=True, logprobs=True):
        if replaying:
            launched.append((replaying[-1], list(steps), penalize, logprobs))
        return launch(logits, stream, rows, steps, penalize, logprobs)

    monkeypatch.setattr(graphs, "replay", counted_replay)
    monkeypatch.setattr(sampler, "launch", counted_launch)
    want = [o.outputs[0] for o in cpu.generate(prompts, replace(plain, logprobs=2), use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(prompts, plain, use_tqdm=False)]
    decode = [s for s in shapes if not s.prefill]
    assert decode and all(s.argmax_only for s in decode), shapes
    # the argmax graph's sampler is step 0 alone, no penalties, no log-probs
    decode_launches = [args for shape, *args in launched if not shape.prefill]
    assert len(decode_launches) == len(decode) and all(tuple(a) == ([0], False, False) for a in decode_launches)
    for w, g in zip(want, got):
        same, _ = agrees(w.token_ids, w.logprobs, g.token_ids, tie=0.02)
        assert same and len(g.token_ids) == len(w.token_ids), (w.token_ids, g.token_ids)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_penalized_requests_through_graphs_and_overlap_give_the_cpu_engines_tokens(small_folder, monkeypatch):
    """The penalties' counts on the device: two greedy requests with penalties decode through replayed graphs, a step
    launched ahead penalizing the token its host has not seen yet (counted by the step before, on the GPU); the tokens
    are the NumPy engine's, which the penalties changed, and the finished requests' slots are free again."""
    monkeypatch.setenv("TINYVLLM_SIM_CUDA", "1")
    rng = np.random.default_rng(3)  # fixed prompts
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 9)]
    # negative penalties: a random model rarely repeats on its own, so ask it to
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1, repetition_penalty=0.3,
                             frequency_penalty=-2.0),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, presence_penalty=-2.0,
                             repetition_penalty=1.5)]
    cpu = LLM(small_folder, device="cpu", max_model_len=64)
    want = [o.outputs[0] for o in cpu.generate(prompts, params, use_tqdm=False)]
    plain = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    unpenalized = [o.outputs[0].token_ids for o in cpu.generate(prompts, plain, use_tqdm=False)]
    assert [w.token_ids for w in want] != unpenalized
    llm = LLM(small_folder, device="cuda", max_model_len=64, max_num_seqs=2, num_kv_blocks=8)
    engine = llm.llm_engine
    got, ahead = generate_counting_replays(llm, prompts, params)
    for w, g in zip(want, got):
        same, _ = agrees(w.token_ids, w.logprobs, g.token_ids, tie=0.02)
        assert same and len(g.token_ids) == len(w.token_ids), (w.token_ids, g.token_ids)
    assert True in ahead  # some step ran ahead of its tokens
    slots = engine.model_runner.sampler.penalties
    slots.release_stale()
    assert slots.slot_of == {} and slots.owners == [None, None]
