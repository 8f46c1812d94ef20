"""The attention kernel's launch grid, and where a CTA's coordinates come from (pure Python).

CUDA caps a grid at 2^31 - 1 blocks along x and 65535 along y and z. The first attention kernel
put the query index in grid z, so a kld window of 65,536 queries failed to launch
(CUDA_LAUNCH_INVALID_CONFIG, issue 17). Queries and KV splits now share grid x (split fastest, so
the CTAs of one query are neighbours in launch order); head tiles stay in y (a few at most).

`cta_coords` is the kernel's decoding of block x written in Python; the CPU test checks that it
inverts the grid for many shapes, and that the limits are refused with a clear error.
"""

from __future__ import annotations

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


def attention_grid(num_queries: int, head_tiles: int, num_splits: int) -> tuple[int, int, int]:
    """(x, y, z) of the attention launch: x = num_queries * num_splits, y = head tiles, z = 1."""
    if num_queries < 1 or head_tiles < 1 or num_splits < 1:
        raise ValueError(f"empty grid: {num_queries} queries, {head_tiles} head tiles, {num_splits} splits")
    x = num_queries * num_splits
    if x > MAX_GRID_X:
        raise ValueError(f"{num_queries} queries x {num_splits} KV splits exceed the {MAX_GRID_X} CTAs a grid row holds")
    if head_tiles > MAX_GRID_YZ:
        raise ValueError(f"{head_tiles} head tiles exceed the grid's y limit {MAX_GRID_YZ}")
    return x, head_tiles, 1


def cta_coords(block_x: int, block_y: int, num_splits: int) -> tuple[int, int, int]:
    """(split, head tile, query) of the CTA at (block_x, block_y), as the kernel computes it."""
    return block_x % num_splits, block_y, block_x // num_splits
