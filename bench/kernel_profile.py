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
    """Run fn() under torch's profiler (GPU activity only): {"groups": {group: ms of busy time, see
    exclusive_times}, "busy_ms": the time some kernel ran, "summed_ms": the kernels' durations summed (more, where
    they overlap), "span_ms": first kernel's start to last kernel's end, "wall_ms": the profiled wall time,
    "kernels": how many, "spans": every activity's (start_us, end_us, name), sorted by start}. deferred: fn(start)
    is called instead, and recording begins when it calls start() (after its warm-up)."""
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
    # GPU activity (kernels, copies, memsets), not user annotations, which span the kernels inside them; one
    # stream (the engine's) is assumed: work on two streams at once would be counted once, by start order
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0
                   and not getattr(ev, "is_user_annotation", False))
    groups, summed = exclusive_times(spans)
    if not any(is_numba_kernel(ev.name) for ev in prof.events()):
        print(prof.key_averages().table(row_limit=25))
        raise RuntimeError("the profiler saw none of numba's kernels: its breakdown would leave them out")
    return {"groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "busy_ms": sum(groups.values()),
            "summed_ms": summed, "span_ms": (max(e for _, e, _ in spans) - spans[0][0]) / 1e3 if spans else 0.0,
            "wall_ms": 1e3 * wall, "kernels": len(spans), "spans": spans}


def exclusive_times(spans: list[tuple]) -> tuple[dict, float]:
    """Each group's share of the GPU's busy time, from (start_us, end_us, name) spans sorted by start: a kernel
    gets only the time after every kernel before it has ended. A kernel launched as a programmatic dependent (it
    starts early and waits in griddepcontrol.wait for the one before) would otherwise count the wait as its own,
    and the groups would sum to more than the span. Returns ({group: ms}, the kernels' durations summed, in ms)."""
    groups, covered, summed = {}, float("-inf"), 0.0
    for start, end, name in spans:
        own = max(0.0, end - max(start, covered))
        covered = max(covered, end)
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + own / 1e3
        summed += (end - start) / 1e3
    return groups, summed


def positions(spans: list[tuple], period: int) -> list[dict]:
    """Where a repeated sequence's time goes, launch by launch: spans (start_us, end_us, name), sorted by start,
    that repeat every `period` launches (the same decode step, replayed), folded by position in the period —
    {"group", "own_us": exclusive time (as exclusive_times counts it), "span_us": start to end, "gap_us": from the
    launch before's end to this one's start (below 0 where it started early)}, each a mean over the repeats. A
    trailing part-period is left out."""
    repeats = len(spans) // period
    out = [{"group": kernel_group(spans[j][2]), "own_us": 0.0, "span_us": 0.0, "gap_us": 0.0} for j in range(period)]
    covered = float("-inf")
    for i, (start, end, _) in enumerate(spans[: repeats * period]):
        slot = out[i % period]
        slot["own_us"] += max(0.0, end - max(start, covered)) / repeats
        slot["span_us"] += (end - start) / repeats
        if i:  # the first launch has no launch before it: one gap fewer
            slot["gap_us"] += (start - spans[i - 1][1]) / (repeats - (i % period == 0))
        covered = max(covered, end)
    return out


def print_groups(label: str, prof: dict) -> None:
    for g, ms in prof["groups"].items():
        print(f"{label}: {g:>28} {ms:9.3f} ms ({100 * ms / prof['busy_ms']:4.1f}%)", flush=True)
    print(f"{label}: {prof['kernels']} kernels, GPU busy {prof['busy_ms']:.2f} ms over a {prof['span_ms']:.2f} ms "
          f"span ({prof['summed_ms']:.2f} ms summed, overlaps counted twice); wall {prof['wall_ms']:.2f} ms",
          flush=True)
