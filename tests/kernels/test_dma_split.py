"""Hybrid copies: segments of at least ``dma_min_bytes`` go to the copy engine (one
``copy_`` each), the rest to the kernel; together they copy every byte exactly once."""

import pytest
import torch
from test_block_copy import DEVICE, POISON, random_item

from ecoffload.kernels import (
    LaunchConfig,
    empty_items,
    pack,
    plan_batch,
    plan_copy,
    triton_available,
    unpack,
)
from ecoffload.kernels.reference import reference_pack

B = 4096
pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(not triton_available(DEVICE), reason="Triton cannot run here"),
]


def step():
    gen = torch.Generator().manual_seed(3)
    items = [random_item(gen, rows, 64, torch.bfloat16) for rows in (0, 200, 3, 96, 64)]
    # item 1: a 6-block extent, then its partly used last block; item 3: 3 blocks
    tables = [[], [(10, 6), (2, 1)], [(20, 1)], [(30, 3)], [(40, 2)]]
    return items, tables


@pytest.mark.parametrize(
    "threshold", [None, 3 * B, 1, 10**9], ids=["off", "3-blocks", "all", "none"]
)
def test_long_segments_go_to_the_copy_engine_and_every_byte_arrives(threshold):
    items, tables = step()
    config = LaunchConfig(num_programs=4, num_warps=4, dma_min_bytes=threshold)
    arena = torch.full((64 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    _, plan = plan_batch(items, tables, arena, B, config=config)
    kernel_bytes = int(plan.segments[:, 2].sum()) if plan.num_segments else 0
    dma_bytes = sum(n for _, _, n in plan.dma)
    assert kernel_bytes + dma_bytes == sum(t.nbytes for t in items)
    assert all(n >= (threshold or 0) for _, _, n in plan.dma)
    assert all(n < threshold for n in plan.segments[:, 2].tolist()) if threshold else not plan.dma
    expected = arena.clone()
    reference_pack(items, tables, expected, B)
    pack(items, tables, arena, B, config=config)
    assert torch.equal(arena, expected)  # every block outside the tables still poison
    outputs = empty_items([(t.dtype, t.shape) for t in items], DEVICE)
    for out in outputs:
        out.fill_(float("nan"))
    unpack(arena, tables, B, outputs, config=config)
    for got, want in zip(outputs, items, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_segments_kept_for_the_kernel_keep_their_tile_counts_tails_included():
    # 16-byte accesses; 4104 = one 4096-byte tile + an 8-byte tail tile, 1000 = 1 + 1
    sizes = [4104, 3 * B, 1000, 5000]
    offsets, tables = [0, 8192, 24576, 28672], [[(0, 2)], [(2, 3)], [(5, 1)], [(6, 2)]]
    kw = dict(block_bytes=B, arena_bytes=8 * B, items_bytes=40960, tile_bytes=4096)
    whole = plan_copy(offsets, sizes, tables, **kw)
    split = plan_copy(offsets, sizes, tables, dma_min_bytes=3 * B, **kw)

    def tiles(p):
        starts = p.segments[:, 3].tolist() + [p.num_tiles]
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    assert whole.vec_bytes == 16 and tiles(whole) == [2, 3, 2, 3]
    assert split.dma == ((8192, 2 * B, 3 * B),)
    assert split.segments[:, :3].tolist() == [[0, 0, 4104], [24576, 5 * B, 1000],
                                              [28672, 6 * B, 5000]]  # fmt: skip
    assert tiles(split) == [2, 2, 3] and split.num_tiles == 7
