"""Figures for chapter 10 (paging): fragmentation, block tables, the prefix tree and a
chunked-prefill timeline. Each function takes its data and returns a Figure.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.plots import new_figure

EMPTY, CACHED, SHARED = "#eeeeee", "#cccccc", "#444444"  # slots, blocks, blocks
CENTER = dict(ha="center", va="center", fontsize=7)
BELOW = dict(loc="upper center", fontsize=7, frameon=False)  # a legend under the axes
KIND_STYLE = {
    "prefill-chunk": dict(hatch="///"),
    "prefill": {},
    "decode": dict(alpha=0.45),
}


def request_colors(names) -> dict:
    """One colour per request, in the order given (the book's tab10 cycle)."""
    return {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}


def fragmentation(prompt_lens, output_lens, max_model_len: int, block_size: int):
    """Cache slots reserved and used by requests running at once, per scheme."""
    tokens = np.asarray(prompt_lens) + np.asarray(output_lens)
    used = int(tokens.sum())
    reserved = {
        "contiguous": len(tokens) * max_model_len,
        "blocks": sum(cdiv(int(n), block_size) for n in tokens) * block_size,
    }
    return {
        scheme: {"reserved": r, "used": used, "waste": 1 - used / r}
        for scheme, r in reserved.items()
    }


def plot_fragmentation(prompt_lens, output_lens, max_model_len: int, block_size: int):
    """The slots each scheme reserves: the part that holds tokens, and the waste."""
    numbers = fragmentation(prompt_lens, output_lens, max_model_len, block_size)
    labels = [
        f"contiguous rows\n({max_model_len} slots each)",
        f"blocks of {block_size}\n(as tokens arrive)",
    ]
    fig, ax = new_figure(width=8, height=2.2)
    for y, n in enumerate(numbers.values()):
        empty = n["reserved"] - n["used"]
        ax.barh(y, n["used"], color="#1f77b4")
        ax.barh(y, empty, left=n["used"], color=EMPTY, ec="#999999", hatch="//")
        ax.text(n["used"] / 2, y, f"{n['used']:,} tokens", color="white", **CENTER)
        label = f"  {empty:,} empty ({n['waste']:.1%})"
        ax.text(n["reserved"], y, label, va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, numbers["contiguous"]["reserved"] * 1.3)
    ax.set_xlabel(
        f"KV cache slots reserved for {len(prompt_lens)} running requests", fontsize=8
    )
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)
    return fig


def draw_block(ax, x, y, fill, color, text="", text_color="k", **kw):
    """One block at (x, y): an outlined box, its first `fill` fraction in `color`."""
    ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, ec="k", lw=0.5, **{"fc": EMPTY, **kw}))
    ax.add_patch(plt.Rectangle((x, y), 0.9 * fill, 0.8, fc=color, lw=0))
    ax.text(x + 0.45, y + 0.4, text, color=text_color, **CENTER)


def draw_block_tables(block_manager, request_ids, token_counts):
    """The pool (top) and each request's block table (below it), an arrow from each
    table entry to its physical block; token_counts[i]: tokens request_ids[i] holds.
    """
    bm, b, colors = block_manager, block_manager.block_size, request_colors(request_ids)
    fill, holder = np.zeros(bm.num_blocks), {}
    fig, ax = new_figure(width=9, height=3.0)
    x = (bm.num_blocks - sum(len(bm.block_tables[r]) + 1 for r in request_ids)) / 2
    for r, n in zip(request_ids, token_counts):
        table = bm.block_tables[r]
        ax.text(x + 0.45 * len(table), -0.25, f"{r}'s table", **CENTER)
        for i, block_id in enumerate(table):
            fill[block_id], holder[block_id] = np.clip(n / b - i, 0, 1), r
            draw_block(ax, x + i, 0, fill[block_id], colors[r], text=block_id)
            arrow = dict(arrowstyle="->", color=colors[r], lw=0.8, alpha=0.7)
            ax.annotate("", (block_id + 0.45, 2), (x + i + 0.45, 0.8), arrowprops=arrow)
        x += len(table) + 1
    for i, block in enumerate(bm.blocks):
        is_cached = block.ref_count == 0 and block.block_hash is not None
        color = SHARED if block.ref_count > 1 else colors.get(holder.get(i), SHARED)
        ref = f"×{block.ref_count}" if block.ref_count > 1 else ""
        style = dict(fc=CACHED, hatch="///") if is_cached else {}
        draw_block(ax, i, 2, fill[i], color, ref, text_color="white", **style)
        ax.text(i + 0.45, 2.95, i, **CENTER)
    ax.text(-0.3, 2.4, "physical\nblocks", ha="right", va="center", fontsize=8)
    legend = [
        Patch(fc=SHARED, label="shared (×ref_count)"),
        Patch(fc=CACHED, ec="k", lw=0.5, hatch="///", label="cached, no holder"),
        Patch(fc=EMPTY, ec="k", lw=0.5, label="free / empty slots"),
    ]
    ax.legend(handles=legend, ncol=3, bbox_to_anchor=(0.5, 0.02), **BELOW)
    ax.set_xlim(-2.5, max(bm.num_blocks, x))
    ax.set_ylim(-0.5, 3.2)
    ax.axis("off")
    return fig


def draw_prefix_tree(block_manager, request_ids):
    """The block tables as a tree: a node per physical block (its id and ref_count),
    an edge from each block to the next one in some request's table.
    """
    bm, colors = block_manager, request_colors(request_ids)
    children, depth, owner = {}, {}, {}
    for r in request_ids:
        for i, block_id in enumerate(bm.block_tables[r]):
            depth[block_id], owner[block_id] = i, owner.get(block_id, r)
            children.setdefault(block_id, [])
            parent = bm.block_tables[r][i - 1] if i else None
            if parent is not None and block_id not in children[parent]:
                children[parent].append(block_id)
    y, leaves = {}, iter(range(len(depth)))

    def place(block_id):  # leaves one per row, a parent level with its children
        kids = children[block_id]
        y[block_id] = np.mean([place(c) for c in kids]) if kids else next(leaves)
        return y[block_id]

    for root in dict.fromkeys(bm.block_tables[r][0] for r in request_ids):
        place(root)
    fig, ax = new_figure(width=8, height=0.5 * max(y.values()) + 1.0)
    for parent, kids in children.items():
        for c in kids:
            ax.plot([depth[parent], depth[c]], [y[parent], y[c]], c="#999999", zorder=0)
    for block_id, d in depth.items():
        ref = bm.blocks[block_id].ref_count
        fc = SHARED if ref > 1 else colors[owner[block_id]]
        box = dict(boxstyle="round", fc=fc, ec="none")
        text = f"block {block_id}\nref {ref}"
        ax.text(d, y[block_id], text, color="white", bbox=box, **CENTER)
        if not children[block_id]:
            name, at = owner[block_id], (d, y[block_id])
            ax.annotate(
                name, at, (24, 0), textcoords="offset points", va="center", fontsize=8
            )
    ax.set_xlim(-0.5, max(depth.values()) + 0.8)
    ax.set_ylim(max(y.values()) + 0.6, -0.6)
    ax.set_xticks(range(max(depth.values()) + 1))
    ax.set_xlabel("logical block (index in the block table)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    return fig


def plot_chunked_timeline(steps, budget: int | None = None):
    """Tokens computed per engine step, stacked by request: hatched, a prompt chunk
    (no token yet); solid, a prompt's last part; light, a one-token decode.
    """
    names = list(dict.fromkeys(name for step in steps for name, _, _ in step))
    colors = request_colors(names)
    fig, ax = new_figure(width=8, height=3.0)
    for s, step in enumerate(steps):
        bottom = 0
        for name, n, kind in step:
            style = dict(color=colors[name], ec="white", lw=0.5, **KIND_STYLE[kind])
            ax.bar(s, n, 0.8, bottom, **style)
            if kind != "decode":
                box = dict(fc=colors[name], ec="none", pad=1)
                ax.text(s, bottom + n / 2, f"{name}: {n}", bbox=box, **CENTER)
            bottom += n
    if budget is not None:
        ax.axhline(budget, color="k", ls="--", lw=1)
        ax.text(-0.4, budget, "token budget", va="bottom", fontsize=7)
        ax.set_ylim(0, budget * 1.15)
    legend = [Patch(fc=colors[r], label=r) for r in names] + [
        Patch(fc="white", ec="#777777", hatch="///", label="prompt chunk"),
        Patch(fc="#777777", alpha=0.45, label="decode"),
    ]
    ax.legend(handles=legend, ncol=len(legend), bbox_to_anchor=(0.5, -0.2), **BELOW)
    ax.set_xticks(range(len(steps)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("engine step", fontsize=8)
    ax.set_ylabel("tokens computed", fontsize=8)
    ax.tick_params(labelsize=8)
    return fig


if __name__ == "__main__":
    import os

    from tinyvllm_lib.engine.block_manager import BlockManager

    os.makedirs("/tmp/ch10figs", exist_ok=True)
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(20, 600, 12), rng.integers(10, 400, 12)
    print(fragmentation(prompts, outputs, 2048, 16))
    plot_fragmentation(prompts, outputs, 2048, 16).savefig("/tmp/ch10figs/frag.png")

    bm = BlockManager(num_blocks=20, block_size=4)
    system = list(range(100, 108))  # a system prompt: two full blocks
    prompts = {
        "a": system + [1, 2, 3, 4, 5, 6, 7],
        "b": system + [1, 2, 3, 4, 9, 9],
        "c": system + [5, 6, 7, 8, 9, 10, 11, 12, 13],
        "d": [50, 51, 52, 53, 54, 55],
    }
    old = list(range(70, 79))  # a finished request: its full blocks stay cached
    bm.allocate("old", old, len(old))
    bm.cache_blocks("old", old, len(old))
    bm.free("old")
    for r, p in prompts.items():
        bm.allocate(r, p, len(p))
        bm.cache_blocks(r, p, len(p))
    names, counts = list(prompts), [len(p) for p in prompts.values()]
    draw_block_tables(bm, names, counts).savefig("/tmp/ch10figs/tables.png")
    draw_prefix_tree(bm, names).savefig("/tmp/ch10figs/tree.png")

    # a, b, c decode while d's 45-token prompt is computed in chunks of 13
    steps = [[("a", 6, "prefill"), ("b", 5, "prefill"), ("c", 4, "prefill")]]
    for left in (45, 32, 19, 6, 0, 0, 0):
        step = [(r, 1, "decode") for r in ("a", "b", "c")]
        if left:
            step.append(
                ("d", min(13, left), "prefill-chunk" * (left > 13) or "prefill")
            )
        else:
            step.append(("d", 1, "decode"))
        steps.append(step)
    plot_chunked_timeline(steps, budget=16).savefig("/tmp/ch10figs/chunked.png")
