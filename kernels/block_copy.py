"""One-launch gather/scatter between a flat items buffer and arena blocks.

``pack`` copies items -> arena blocks, ``unpack`` arena blocks -> items; both
are the same persistent kernel with a ``TO_ARENA`` constexpr flag. The work is
a segment table (see :mod:`.plan`): per segment, a contiguous byte range on
each side. Segments are cut into ``TILE_BYTES`` tiles dealt round-robin to a
small, explicit number of programs, so a whole step is one launch that leaves
most SMs to compute, whatever the number of items and blocks.

Arguments are base tensors plus int64 byte offsets, never pointers loaded from
memory, so the same kernel runs on CUDA (the arena being the device alias of
CUDA-host-registered memory: zero-copy over PCIe) and on CPU tensors under
the Triton interpreter (``TRITON_INTERPRET=1``).

Compiled variants: Triton would specialise on ``num_segs`` (== 1, multiple of
16) and on each pointer's 16-byte alignment, compiling new variants (~0.7 s
each) mid-serving. Neither is specialised: the alignment the kernel may assume
is the plan's ``VEC`` (``tl.multiple_of``), derived from every absolute address.
A variant is therefore exactly :class:`KernelVariant` (direction, width, tile,
warps), and :func:`compile_variants` builds them ahead of the first copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .plan import CopyPlan


class KernelVariant(NamedTuple):
    """What selects one compiled kernel: its constexprs and launch options."""

    to_arena: bool
    vec: int
    tile_bytes: int
    num_warps: int


@triton.jit(
    do_not_specialize=["num_segs"],
    do_not_specialize_on_alignment=["items_ptr", "arena_ptr", "seg_ptr"],
)
def _block_copy_kernel(
    items_ptr,  # uint8, flat items buffer
    arena_ptr,  # uint8, flat arena
    seg_ptr,  # int64 [num_segs, 4]: item_offset, arena_offset, nbytes, first_tile
    num_segs,
    TO_ARENA: tl.constexpr,  # True: items -> arena (pack); False: arena -> items (unpack)
    VEC: tl.constexpr,  # bytes per access; every offset is a multiple of it
    TILE_BYTES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    offs_tile = tl.arange(0, TILE_BYTES).to(tl.int64)
    offs_tail = tl.arange(0, VEC).to(tl.int64)
    row = seg_ptr  # advanced by pointer increments: no index arithmetic to overflow
    for _ in range(num_segs):
        item_off = tl.load(row)
        arena_off = tl.load(row + 1)
        nbytes = tl.load(row + 2)
        first_tile = tl.load(row + 3)
        if TO_ARENA:
            src_ptr = tl.multiple_of(items_ptr + item_off, VEC)
            dst_ptr = tl.multiple_of(arena_ptr + arena_off, VEC)
        else:
            src_ptr = tl.multiple_of(arena_ptr + arena_off, VEC)
            dst_ptr = tl.multiple_of(items_ptr + item_off, VEC)
        # Whole VEC-byte words go in full-width accesses; the tail (< VEC bytes,
        # only at an item's end) in one extra byte-wise tile.
        n_vec = (nbytes // VEC) * VEC
        n_tiles = tl.cdiv(n_vec, TILE_BYTES)
        first = (pid - first_tile % nprog + nprog) % nprog  # this program's first tile
        for t in range(first, n_tiles, nprog):
            offs = t * TILE_BYTES + offs_tile
            mask = offs < n_vec
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        if (n_vec < nbytes) & (pid == (first_tile + n_tiles) % nprog):
            offs = n_vec + offs_tail
            mask = offs < nbytes
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        row += 4


def launch_block_copy(
    items: torch.Tensor,
    arena: torch.Tensor,
    plan: CopyPlan,
    *,
    to_arena: bool,
    num_programs: int,
    num_warps: int,
) -> None:
    """Run one planned copy; ``items`` and ``arena`` are flat uint8 tensors on one device.

    ``items`` is the base the plan's item offsets count from; the segments may
    address bytes past its end (other tensors of the batch on the same device).
    """
    for name, t in (("items", items), ("arena", arena)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a flat contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    if items.device != arena.device:
        raise ValueError(f"items are on {items.device} but the arena is on {arena.device}")
    if num_programs <= 0 or num_warps <= 0:
        raise ValueError(
            f"num_programs and num_warps must be positive, got {num_programs}, {num_warps}"
        )
    if plan.num_segments == 0:
        return
    segments = plan.segments
    if arena.device.type != "cpu":
        segments = segments.to(arena.device, non_blocking=True)
    grid = (min(num_programs, plan.num_tiles),)
    _block_copy_kernel[grid](
        items, arena, segments, plan.num_segments,
        TO_ARENA=to_arena, VEC=plan.vec_bytes, TILE_BYTES=plan.tile_bytes, num_warps=num_warps,
    )  # fmt: skip


def compile_variants(variants: Iterable[KernelVariant], device: torch.device) -> None:
    """Compile each variant for ``device`` now, launching nothing (CUDA only)."""
    with torch.cuda.device(device):
        for v in variants:
            # dtypes stand for the tensors: only their element types reach the key.
            _block_copy_kernel.warmup(
                torch.uint8, torch.uint8, torch.int64, 0,
                TO_ARENA=v.to_arena, VEC=v.vec, TILE_BYTES=v.tile_bytes, num_warps=v.num_warps,
                grid=(1,),
            )  # fmt: skip
