"""The loop over key tiles in a tensor-core kernel's SASS, for the tests that check it keeps its fragments in
registers (no LDL/STL there)."""

import re


def key_tile_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop that holds every HMMA of a kernel's SASS
    (the loop over key tiles): from its backward branch's target to the branch. Branch
    targets are addresses (cuobjdump) or labels such as `(.L_x_12)` (nvdisasm, as
    numba's inspect_sass prints them)."""
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line):
            code.append((int(m.group(1), 16), m.group(2)))
            labels.update((label, code[-1][0]) for label in pending)
            pending = []
    hmma = [a for a, ins in code if re.search(r"\bHMMA\b", ins)]
    assert hmma, "no HMMA in the SASS"
    loops = []
    for a, ins in code:
        m = re.search(r"\bBRA\b.*?(?:0x([0-9a-f]+)|\((\.L_x_\d+)\))", ins)
        if m:
            target = int(m.group(1), 16) if m.group(1) else labels.get(m.group(2), a + 1)
            if target <= hmma[0] and a >= hmma[-1]:
                loops.append((target, a))
    assert loops, "no loop around the HMMA"
    first, last = min(loops, key=lambda tb: tb[1] - tb[0])
    return [ins for a, ins in code if first <= a <= last]
