"""Where a piece of GPU work spends its time: every kernel torch's profiler sees while `fn` runs (CUPTI traces
numba's launches and graph replays too, not only torch's), summed by group — the tinyvllm_lib module a numba kernel
comes from (its mangled name holds the module), "cublas" for cuBLAS' GEMMs, else the kernel name's first word.
Used by bench/ch11_throughput_profile.py."""

import re
import time


def kernel_group(name: str) -> str:
    """A profiled kernel's group (see the module's docstring)."""
    m = re.search(r"tinyvllm_lib(?:\d+\w+?)?7kernels(\d+)", name)
    if m:
        start = m.end()
        return name[start : start + int(m.group(1))]
    if re.search(r"gemm|nvjet|sm90_xmma|cublas|cutlass", name, re.I):
        return "cublas"
    return re.split(r"[<(\s]", name, maxsplit=1)[0][:40]


def profile_groups(fn) -> dict:
    """Run fn() under torch's profiler (GPU activity only): {"groups": {group: ms}, "busy_ms": the kernels' summed
    time, "span_ms": first kernel's start to last kernel's end, "wall_ms": fn's wall time, "kernels": how many}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    groups, first, last, count = {}, None, None, 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time_total <= 0:
            continue
        g = kernel_group(ev.name)
        groups[g] = groups.get(g, 0.0) + ev.device_time_total / 1e3
        first = ev.time_range.start if first is None else min(first, ev.time_range.start)
        last = ev.time_range.end if last is None else max(last, ev.time_range.end)
        count += 1
    if not groups:
        print(prof.key_averages().table(row_limit=25))
        raise RuntimeError("the profiler saw no GPU kernel")
    return {"groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "busy_ms": sum(groups.values()),
            "span_ms": (last - first) / 1e3, "wall_ms": 1e3 * wall, "kernels": count}


def print_groups(label: str, prof: dict) -> None:
    for g, ms in prof["groups"].items():
        print(f"{label}: {g:>28} {ms:9.3f} ms ({100 * ms / prof['busy_ms']:4.1f}%)", flush=True)
    print(f"{label}: {prof['kernels']} kernels, GPU busy {prof['busy_ms']:.2f} ms over a {prof['span_ms']:.2f} ms "
          f"span; wall {prof['wall_ms']:.2f} ms", flush=True)
