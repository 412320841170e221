# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 13. Outgrowing one GPU: tensor parallelism

# %%
#| default_exp distributed.sharding

# %%
#| export
from dataclasses import replace

import numpy as np

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.models.config import ModelConfig

# the Hugging Face tensors each split takes: by rows (output features) or by columns
# (input features)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """ValueError unless world_size divides the query heads, the KV heads and the MLP's
    width (every rank owns whole heads).
    """
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"tensor_parallel_size must be a positive integer, got {world_size!r}"
        )
    bad = [f"{name} = {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size = {world_size} must divide num_attention_heads, "
            f"num_key_value_heads and intermediate_size; it does not divide "
            f"{', '.join(bad)}"
        )


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's config: its share of the heads and of the MLP's width (what its
    layer loop, KV cache and attention read); the rest as the model's.
    """
    check_tensor_parallel(config, world_size)
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        tie_word_embeddings=False,  # a shard's head is always its own tensor
    )


def vocab_shard(table: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank's rows of a (vocab, hidden) table: the vocabulary padded with zero rows to
    a multiple of world_size, then cut in equal parts.
    """
    rows = cdiv(len(table), world_size)
    part = table[rank * rows : (rank + 1) * rows]
    if len(part) == rows:
        return np.ascontiguousarray(part)
    padded = np.zeros((rows, table.shape[1]), table.dtype)
    padded[: len(part)] = part
    return padded


def shard_llama_weights(
    weights: dict[str, np.ndarray], config: ModelConfig, rank: int, world_size: int,
    split_embedding: bool = True,
) -> dict[str, np.ndarray]:
    """Rank's tensors of a Llama checkpoint (Hugging Face names), Megatron's way: q, k,
    v, gate and up by rows (whole heads), o and down by columns, the head by the
    vocabulary; the embedding too where split_embedding, else whole.
    """
    check_tensor_parallel(config, world_size)

    def part(w: np.ndarray, axis: int) -> np.ndarray:
        size = w.shape[axis] // world_size
        cut = slice(rank * size, (rank + 1) * size)
        return np.ascontiguousarray(w[cut] if axis == 0 else w[:, cut])

    shard = {}
    for name, w in weights.items():
        kind = name.split(".")[-2]  # "model.layers.0.self_attn.q_proj.weight"
        if kind in COLUMN_PARALLEL:  # (out, in): a rank's output features
            shard[name] = part(w, 0)
        elif kind in ROW_PARALLEL:  # a rank's input features
            shard[name] = part(w, 1)
        elif kind not in ("embed_tokens", "lm_head"):
            shard[name] = w  # the norms: every rank has them whole
    embed = weights["model.embed_tokens.weight"]
    head = weights["lm_head.weight"] if "lm_head.weight" in weights else embed
    shard["lm_head.weight"] = vocab_shard(head, rank, world_size)
    if split_embedding:  # tied: the same rows, one array
        shard["model.embed_tokens.weight"] = (
            shard["lm_head.weight"] if head is embed
            else vocab_shard(embed, rank, world_size)
        )
    else:
        shard["model.embed_tokens.weight"] = embed
    return shard

# %%
#| export distributed.gloo_communicator
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tinyvllm_lib.distributed.communicator import Communicator

IDLE_TIMEOUT = timedelta(days=365)  # how long a rank waits for the next step


def _on_host(x, stream) -> np.ndarray:
    """x as a C-contiguous host array (a device array is copied, and waited for)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    host = x.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host


class GlooCommunicator(Communicator):
    """The collectives of torch.distributed's gloo backend, over host memory: NumPy
    arrays in place, device arrays through a copy to the host and back (the CUDA
    simulator's ranks). Every collective gives up after the group's timeout.
    """

    def __init__(self, rank: int, world_size: int, step_group):
        self.rank, self.world_size = rank, world_size
        # the steps travel in a group of their own, which may wait while rank 0 idles
        self.step_group = step_group

    def all_reduce(self, x, stream=0):
        host = _on_host(x, stream)
        dist.all_reduce(torch.from_numpy(host))
        if isinstance(x, np.ndarray):
            return host  # x itself where it was contiguous
        x.copy_to_device(host, stream=stream)
        return x

    def all_gather(self, x, out=None, stream=0):
        host = _on_host(x, stream)
        parts = [torch.empty(host.shape, dtype=torch.float32)
                 for _ in range(self.world_size)]
        dist.all_gather(parts, torch.from_numpy(host))
        full = np.concatenate([p.numpy() for p in parts], axis=-1)
        if out is None:
            return full
        out.copy_to_device(np.ascontiguousarray(full[:, : out.shape[1]]), stream=stream)
        return out

    def broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.step_group)
        return box[0]


def init_distributed(
    rank: int, world_size: int, init_method: str, timeout: float
) -> GlooCommunicator:
    """Join the ranks' process group (torch.distributed's rendezvous at init_method;
    "env://" reads MASTER_ADDR and MASTER_PORT, as under torchrun).
    """
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    step_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return GlooCommunicator(rank, world_size, step_group)


def launched_by_torchrun() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) where a launcher such as torchrun set them, else
    None.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))

# %%
#| export distributed.nccl_communicator
import numpy as np

from tinyvllm_lib.distributed.communicator import Communicator
from tinyvllm_lib.kernels.checks import device_pointer


def _stream_handle(stream) -> int:
    """The CUDA stream a numba stream wraps, as an integer (0: the default stream)."""
    return 0 if isinstance(stream, int) else int(stream)


class NcclCommunicator(Communicator):
    """NCCL's all-reduce and all-gather through CuPy's bindings (cupy.cuda.nccl),
    called with numba device arrays' pointers on the kernels' own stream, so a CUDA
    graph can capture them. Steps still travel through `host` (a GlooCommunicator),
    which also hands NCCL's unique id from rank 0 to the others. float32 only.
    """

    def __init__(self, host: Communicator):
        import cupy
        from cupy.cuda import nccl

        self.nccl, self.cupy, self.host = nccl, cupy, host
        self.rank, self.world_size = host.rank, host.world_size
        unique_id = host.broadcast(nccl.get_unique_id() if host.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)
        self._gathered = None  # (world_size, rows, cols) float32: all_gather's scratch

    def _check(self, x) -> None:
        if x.dtype != np.float32 or not x.is_c_contiguous():
            raise TypeError("NCCL collectives here take C-contiguous float32 arrays")

    def all_reduce(self, x, stream=0):
        self._check(x)
        p = device_pointer(x)
        self.comm.allReduce(p, p, x.size, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM,
                            _stream_handle(stream))
        return x

    def all_gather(self, x, out=None, stream=0):
        """x (rows, cols) of every rank -> out (rows, <= world_size * cols)."""
        from numba import cuda

        self._check(x)
        rows, cols = x.shape
        need = self.world_size * x.size
        if self._gathered is None or self._gathered.size < need:
            self._gathered = cuda.device_array(need, np.float32)
        gathered = self._gathered[:need]
        self.comm.allGather(device_pointer(x), device_pointer(gathered), x.size,
                            self.nccl.NCCL_FLOAT32, _stream_handle(stream))
        # (world_size, rows, cols) -> (rows, world_size * cols), cut to out's width,
        # by CuPy on the same stream
        cp = self.cupy
        with cp.cuda.ExternalStream(_stream_handle(stream)):
            parts = cp.asarray(gathered).reshape(self.world_size, rows, cols)
            side_by_side = parts.transpose(1, 0, 2).reshape(rows, -1)
            cp.asarray(out)[...] = side_by_side[:, : out.shape[1]]
        return out

    def broadcast(self, obj=None):
        return self.host.broadcast(obj)

# %%
#| export distributed.executor
import contextlib
import os
import socket
import weakref
from dataclasses import replace

import torch.distributed as dist
import torch.multiprocessing as mp

from tinyvllm_lib.distributed.gloo_communicator import (
    init_distributed,
    launched_by_torchrun,
)
from tinyvllm_lib.distributed.sharding import (
    check_tensor_parallel,
    shard_config,
    shard_llama_weights,
)
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.input_batch import InputBatch
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.runtime import has_gpu

# a rank's process does its math on one CPU thread (set before it imports NumPy)
ONE_THREAD = {name: "1" for name in
              ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
JOIN_SECONDS = 5.0  # how long a stopping rank gets before it is terminated


def make_rank_runner(folder, config: EngineConfig, comm, sampler=None) -> ModelRunner:
    """This rank's ModelRunner: the device's model on its shard of the weights (and so
    a KV cache of its own heads), talking to the other ranks through comm.
    """
    from tinyvllm_lib.models.llama_cuda import LlamaCuda
    from tinyvllm_lib.models.llama_numpy import LlamaNumpy

    full = ModelConfig.from_folder(folder)
    weights = shard_llama_weights(
        load_weights(folder, full, progress=False), full, comm.rank, comm.world_size,
        split_embedding=config.device == "cpu",  # the GPU looks rows up whole
    )
    model = (LlamaNumpy if config.device == "cpu" else LlamaCuda)(
        shard_config(full, comm.world_size), weights, comm=comm
    )
    return ModelRunner(folder, config, sampler=sampler, model=model)


def make_communicator(rank, world_size, init_method, config: EngineConfig):
    """The ranks' communicator: NCCL between GPUs, gloo between CPU processes (and the
    CUDA simulator's); the steps travel over gloo either way.
    """
    host = init_distributed(rank, world_size, init_method, config.distributed_timeout)
    if config.device == "cuda" and has_gpu():
        from tinyvllm_lib.distributed.nccl_communicator import NcclCommunicator

        return NcclCommunicator(host)
    return host


def run_worker(rank, world_size, folder, config, init_method, sampler=None,
               local_rank=None) -> None:
    """What a rank other than 0 runs: join the group, build its runner, then run
    each step rank 0 broadcasts, until it broadcasts None.
    """
    if config.device == "cuda" and has_gpu():
        from numba import cuda

        cuda.select_device(rank if local_rank is None else local_rank)
    comm = make_communicator(rank, world_size, init_method, config)
    try:
        runner = make_rank_runner(folder, config, comm, sampler)
        while (message := comm.broadcast()) is not None:
            method, argument = message  # ("init_kv_cache", slots) or ("execute_batch",
            getattr(runner, method)(argument)  # batch)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(values: dict):
    """os.environ with `values` set, for processes started inside (restored after)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_ranks(comm, processes: list, politely: bool) -> None:
    """Tell the ranks to stop (politely: a None step), wait, terminate what is left,
    leave the process group.
    """
    if politely and comm is not None and all(p.is_alive() for p in processes):
        with contextlib.suppress(Exception):
            comm.broadcast(None)
    for p in processes:  # after a failure a rank gets a second, not five
        p.join(JOIN_SECONDS if politely else 0.1)
        if p.is_alive():
            p.terminate()
            p.join(JOIN_SECONDS if politely else 1.0)
        if p.is_alive():
            p.kill()
            p.join()
    if dist.is_initialized():
        dist.destroy_process_group()

# %%
#| export distributed.executor
class MultiprocExecutor:
    """vLLM's name: rank 0's ModelRunner in this process, one process per other rank
    (started with spawn, or by torchrun), and one broadcast of each step's InputBatch
    before every rank runs it on its shard. Where the engine holds a ModelRunner it
    holds this: init_kv_cache, execute, shutdown; the rest is rank 0's runner's.
    """

    def __init__(self, folder, config: EngineConfig, sampler=None):
        n = config.tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_folder(folder), n)  # before any start
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is running in this process already: "
                "shutdown() it first"
            )
        self.processes, self.comm, self.failed = [], None, False
        launched = launched_by_torchrun()
        if launched is not None:  # every rank is a process torchrun started
            rank, world_size, local_rank = launched
            if world_size != n:
                raise ValueError(
                    f"tensor_parallel_size = {n}, but the launcher started "
                    f"WORLD_SIZE = {world_size} processes"
                )
            if rank != 0:  # this process serves rank 0's steps, then ends
                run_worker(rank, n, folder, config, "env://", sampler, local_rank)
                raise SystemExit(0)
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            spawn = mp.get_context("spawn")
            with environment(ONE_THREAD):
                for rank in range(1, n):
                    p = spawn.Process(
                        target=run_worker, name=f"tinyvllm-rank-{rank}", daemon=True,
                        args=(rank, n, folder, config, init_method, sampler),
                    )
                    p.start()
                    self.processes.append(p)
        # at exit, or when the engine is dropped, the ranks stop with it
        self._stop = weakref.finalize(self, stop_ranks, None, self.processes, False)
        try:
            self.comm = make_communicator(0, n, init_method, config)
            self._stop.detach()
            self._stop = weakref.finalize(
                self, stop_ranks, self.comm, self.processes, True
            )
            self.driver = make_rank_runner(folder, config, self.comm, sampler)
        except BaseException:
            self.failed = True
            self.shutdown()
            raise

    def __getattr__(self, name):
        if name == "driver":  # not made yet
            raise AttributeError(name)
        return getattr(self.driver, name)  # device, config, kv_cache_dtype, graphs, ...

    def _broadcast_and_run(self, method: str, argument, for_others=None):
        """Every rank runs runner.method(argument) (the others get for_others where
        given); rank 0's result.
        """
        for i, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                self.failed = True
                self.shutdown()
                raise RuntimeError(
                    f"tensor parallelism: rank {i} (pid {p.pid}) exited with code "
                    f"{p.exitcode}; the engine stops"
                )
        try:
            others = argument if for_others is None else for_others
            self.comm.broadcast((method, others))
            return getattr(self.driver, method)(argument)
        except Exception as error:
            self.failed = True
            self.shutdown()
            raise RuntimeError(
                f"tensor parallelism: a collective failed ({error}); a rank stopped "
                "or did not answer within distributed_timeout, and the engine stops"
            ) from error

    def init_kv_cache(self, num_slots: int) -> None:
        self._broadcast_and_run("init_kv_cache", num_slots)

    def execute(self, step):
        """The step's batch, made once here, broadcast, and run by every rank."""
        self.driver._check(step)
        batch = InputBatch.from_step(step, self.driver.block_size)
        # the other ranks need the arrays, not the requests behind them
        return self._broadcast_and_run(
            "execute_batch", batch, replace(batch, sampled_requests=None)
        )

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (at once after a failure)."""
        if self._stop.detach() is not None:  # not stopped yet
            stop_ranks(self.comm, self.processes, politely=not self.failed)
