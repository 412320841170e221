"""Chapter 11 on the GPU: decode attention over one sequence (batch 1) at each grid setting — warps a block,
keys a split, blocks the grid aims for, prefetching the next step's rows — at the contexts batch 1's benchmark sees (128 to 384 tokens) and at
1,024. Each setting is checked against float64, then timed replayed from a CUDA graph with the K/V sets rotated
past L2. The settings DecodeAttentionConfig.for_rows(1) picks are marked is_default. Records to
book/data/ch11_attention_one_row.json.

    python bench/ch11_attention_one_row.py          (~1 minute on an H200)
"""

import numpy as np
from ch11_fusion_proto import sweep_bs1_attention

from tinyvllm_lib.measure import Recorder

GRID = {"num_warps": (2, 4, 8, 16), "split_keys": (64, 384, 4096), "target_blocks": (1, 1024), "min_split_keys": (8,),
        "prefetch": (False, True)}


def main() -> None:
    rec = Recorder("ch11_attention_one_row")
    sweep_bs1_attention(rec, np.random.default_rng(0), contexts=(128, 256, 384, 1024), grid=GRID, save=False)
    print("saved", rec.save())


if __name__ == "__main__":
    main()
