"""Types of the planner's C pass (``plan_native.c``, built by ``pip install``); each
function answers None where the Python passes must plan (see the C file's header)."""

from collections.abc import Sequence

import torch
from typing_extensions import Buffer

# (table: int64 bytes of segment rows then program rows, num_segments, num_programs,
#  vec_bytes, num_tiles, nbytes)
_Plan = tuple[bytearray, int, int, int, int, int]

def plan(
    item_offsets: Sequence[int],
    item_nbytes: Sequence[int],
    tables: Sequence[Sequence[tuple[int, int]]],
    block_bytes: int,
    arena_bytes: int,
    items_bytes: int,
    tile_bytes: int,
    items_base: int,
    arena_base: int,
    num_programs: int,
    /,
) -> _Plan | None: ...
def plan_step(
    item_offsets: Sequence[int],
    item_nbytes: Sequence[int],
    extents: Buffer,
    bounds: Buffer,
    block_bytes: int,
    arena_bytes: int,
    items_bytes: int,
    tile_bytes: int,
    items_base: int,
    arena_base: int,
    num_programs: int,
    /,
) -> _Plan | None: ...
def item_layout(
    tensors: Sequence[torch.Tensor], /
) -> tuple[int, list[int], list[int], int] | None: ...
def check_step(extents: Buffer, bounds: Buffer, num_blocks: int = -1, /) -> int | None:
    """-1 when the arrays are a step table's and every extent lies inside ``num_blocks``
    (-1: the arrays only), else the first extent outside; None for arrays that are not a
    step table's (step_table.py then names what is wrong)."""
