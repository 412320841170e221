"""Where a piece of GPU work spends its time: every kernel torch's profiler sees while `fn` runs, summed by group —
the tinyvllm_lib module a numba kernel comes from (its name holds the module's path: "kernels.rmsnorm",
"engine.sampler_cuda"), "cublas" for cuBLAS' GEMMs, else the kernel name's first word after "void". CUPTI, under torch's profiler,
should see numba's launches and graph replays as well as torch's; profile_groups raises if it sees no numba kernel,
rather than report a breakdown without them. Used by bench/ch11_throughput_profile.py and
bench/ch14_tensor_cores.py (--only breakdown)."""

import re
import time


def is_numba_kernel(name: str) -> bool:
    """Whether a profiled kernel is one of tinyvllm_lib's (numba's): CUPTI names it demangled
    ("tinyvllm_lib::kernels::rmsnorm::..."), other tools mangled ("...12tinyvllm_lib7kernels...")."""
    return "tinyvllm_lib::" in name or "12tinyvllm_lib" in name


def kernel_group(name: str) -> str:
    """A profiled kernel's group (see the module's docstring)."""
    if m := re.search(r"tinyvllm_lib::(\w+)::(\w+)", name):  # demangled, as CUPTI gives it
        return f"{m.group(1)}.{m.group(2)}"
    at = name.find("12tinyvllm_lib")
    if at >= 0:  # Itanium mangling: each name in the path is its length, then itself
        parts, i = [], at + len("12tinyvllm_lib")
        while len(parts) < 2 and (m := re.match(r"\d+", name[i:])):
            size = int(m.group())
            parts.append(name[i + m.end() : i + m.end() + size])
            i += m.end() + size
        return ".".join(parts)
    if re.search(r"gemm|nvjet|sm90_xmma|cublas|cutlass", name, re.I):
        return "cublas"
    name = re.sub(r"^void\s+", "", name)  # torch's kernels: "void at::native::..."
    return re.split(r"[<(\s]", name, maxsplit=1)[0][:40]


def profile_groups(fn, deferred: bool = False) -> dict:
    """Run fn() under torch's profiler (GPU activity only): {"groups": {group: ms}, "busy_ms": the kernels' summed
    time, "span_ms": first kernel's start to last kernel's end, "wall_ms": the profiled wall time, "kernels": how
    many}. deferred: fn(start) is called instead, and recording begins when it calls start() (after its warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof, t0 = profile(activities=[ProfilerActivity.CUDA]), []

    def start():
        torch.cuda.synchronize()
        prof.start()
        t0.append(time.perf_counter())

    if deferred:
        fn(start)
    else:
        start()
        fn()
    if not t0:
        raise RuntimeError("fn never called start()")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0[0]
    prof.stop()
    groups, first, last, count = {}, None, None, 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time_total <= 0:
            continue
        g = kernel_group(ev.name)
        groups[g] = groups.get(g, 0.0) + ev.device_time_total / 1e3
        first = ev.time_range.start if first is None else min(first, ev.time_range.start)
        last = ev.time_range.end if last is None else max(last, ev.time_range.end)
        count += 1
    if not any(is_numba_kernel(ev.name) for ev in prof.events()):
        print(prof.key_averages().table(row_limit=25))
        raise RuntimeError("the profiler saw none of numba's kernels: its breakdown would leave them out")
    return {"groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "busy_ms": sum(groups.values()),
            "span_ms": (last - first) / 1e3, "wall_ms": 1e3 * wall, "kernels": count}


def print_groups(label: str, prof: dict) -> None:
    for g, ms in prof["groups"].items():
        print(f"{label}: {g:>28} {ms:9.3f} ms ({100 * ms / prof['busy_ms']:4.1f}%)", flush=True)
    print(f"{label}: {prof['kernels']} kernels, GPU busy {prof['busy_ms']:.2f} ms over a {prof['span_ms']:.2f} ms "
          f"span; wall {prof['wall_ms']:.2f} ms", flush=True)
