"""One-launch gather/scatter between a flat items buffer and arena blocks.

``pack`` copies items -> arena blocks, ``unpack`` arena blocks -> items; both
are the same persistent kernel with a ``TO_ARENA`` constexpr flag. The work is
a segment table (see :mod:`.plan`): per segment, a contiguous byte range on
each side, cut into ``TILE_BYTES`` tiles. A small, explicit number of
programs each copy one contiguous range of the step's tiles and read only the
segment rows of that range, so a whole step is one launch that leaves most
SMs to compute, whatever the number of items and blocks.

Arguments are base tensors plus int64 byte offsets, never pointers loaded from
memory, so the same kernel runs on CUDA (the arena being the device alias of
CUDA-host-registered memory: zero-copy over PCIe) and on CPU tensors under
the Triton interpreter (``TRITON_INTERPRET=1``).

Compiled variants: Triton would specialise on each pointer's 16-byte
alignment (and on integer arguments: there are none), compiling new variants
(each a noticeable stall) mid-serving. Alignment is not specialised: the alignment the
kernel may assume is the plan's ``VEC`` (``tl.multiple_of``), derived from
every absolute address.
A variant is therefore exactly :class:`KernelVariant` (direction, width, tile,
warps), and :func:`compile_variants` builds them ahead of the first copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .plan import VEC_WIDTHS, CopyPlan


class KernelVariant(NamedTuple):
    """What selects one compiled kernel: its constexprs and launch options."""

    to_arena: bool
    vec: int
    tile_bytes: int
    num_warps: int


@triton.jit(do_not_specialize_on_alignment=["items_ptr", "arena_ptr", "seg_ptr", "prog_ptr"])
def _block_copy_kernel(
    items_ptr,  # uint8, the items' base (only its address is read)
    arena_ptr,  # uint8, flat arena
    seg_ptr,  # int64 [S, 4]: item_offset, arena_offset, nbytes, first_tile
    prog_ptr,  # int64 [P, 3]: first_segment, tile_begin, tile_end
    TO_ARENA: tl.constexpr,  # True: items -> arena (pack); False: arena -> items (unpack)
    VEC: tl.constexpr,  # bytes per access; every address is a multiple of it
    TILE_BYTES: tl.constexpr,
):
    work = prog_ptr + 3 * tl.program_id(0).to(tl.int64)
    tile = tl.load(work + 1)  # this program's tiles: [tile, tile_end), contiguous
    tile_end = tl.load(work + 2)
    row = seg_ptr + 4 * tl.load(work)  # the segment its first tile falls in
    offs_tile = tl.arange(0, TILE_BYTES).to(tl.int64)
    offs_tail = tl.arange(0, VEC).to(tl.int64)
    while tile < tile_end:
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
        # Whole VEC-byte words go in full-width tiles; the tail (< VEC bytes,
        # only at an item's end) is the segment's last tile, copied byte-wise.
        n_vec = (nbytes // VEC) * VEC
        n_tiles = tl.cdiv(n_vec, TILE_BYTES)
        stop = tl.minimum(tile_end - first_tile, n_tiles + (n_vec < nbytes).to(tl.int64))
        for t in range(tile - first_tile, tl.minimum(stop, n_tiles)):
            offs = t * TILE_BYTES + offs_tile
            mask = offs < n_vec
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        if stop > n_tiles:
            offs = n_vec + offs_tail
            mask = offs < nbytes
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        tile = first_tile + stop
        row += 4


def launch_block_copy(
    items: torch.Tensor,
    arena: torch.Tensor,
    plan: CopyPlan,
    *,
    to_arena: bool,
    num_warps: int,
    items_bytes: int | None = None,
) -> None:
    """Run one planned copy; ``items`` and ``arena`` are contiguous uint8 tensors on one
    device (``arena`` flat).

    ``items`` is the base the plan's item offsets count from: only its address
    and device are read, so any shape will do (the engine passes the lowest
    item viewed as uint8, not flattened: one torch call less per step), and
    the segments may address bytes past its end (other tensors of the batch on
    the same device) up to ``items_bytes``, the batch's span from the base that
    the caller vouches for (None: the base's own bytes). The grid is the plan's
    program count. On CUDA the launch table goes up from page-locked memory
    (:func:`upload_table`): the host never waits.

    Refused (ValueError) before anything runs: a plan that addresses more of the
    arena, or of the items, than given. A plan from the planner carries the sizes
    it checked every segment against (two compares here); one built by hand has
    its table checked whole (:func:`plan_reach`).
    """
    if items.dtype != torch.uint8 or not items.is_contiguous():
        raise ValueError(
            f"items must be a contiguous uint8 tensor, got {items.dtype} {tuple(items.shape)}"
        )
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise ValueError(
            f"arena must be a flat contiguous uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
        )
    if items.device != arena.device:
        raise ValueError(f"items are on {items.device} but the arena is on {arena.device}")
    if num_warps <= 0:
        raise ValueError(f"num_warps must be positive, got {num_warps}")
    if plan.num_programs == 0:
        return
    items_reach, arena_reach = plan.items_bytes, plan.arena_bytes
    if items_reach < 0 or arena_reach < 0:  # not the planner's: its table says
        items_reach, arena_reach = plan_reach(plan, items.data_ptr(), arena.data_ptr())
    if arena_reach > arena.numel():
        raise ValueError(
            f"the plan addresses the arena's bytes up to offset {arena_reach}, the arena "
            f"given holds {arena.numel()}: plan the copy against this arena (plan_batch)"
        )
    if items_bytes is None:  # the base's own bytes
        items_bytes = items.numel()
    if items_reach > items_bytes:
        raise ValueError(
            f"the plan addresses the items' bytes up to offset {items_reach} from the base, "
            f"which holds {items_bytes} from there: pass items_bytes= for a batch of "
            "several tensors (their span from the base), or plan the copy for these items "
            "(plan_batch)"
        )
    table = plan.table
    if table.device != arena.device:
        table = upload_table(table, arena.device)
    rows = 4 * plan.num_segments  # one table, one upload: segment rows, then program rows
    _block_copy_kernel[(plan.num_programs,)](
        items, arena, table[:rows], table[rows:],
        TO_ARENA=to_arena, VEC=plan.vec_bytes, TILE_BYTES=plan.tile_bytes,
        num_warps=num_warps,  # pyright: ignore[reportCallIssue]  (a launch option Triton's types omit)
    )  # fmt: skip


def plan_reach(plan: CopyPlan, items_base: int, arena_base: int) -> tuple[int, int]:
    """(items bytes, arena bytes) a plan built by hand addresses: the highest end of a
    segment on each side, once its table is checked to be one the kernel walks within:
    rows and programs as many as the plan says, no negative offset or size, first tiles
    in order, each program's tiles within its first segment's and the plan's, the access
    width dividing every absolute address. ValueError (what is wrong) otherwise."""
    s, p, vec, tile = plan.num_segments, plan.num_programs, plan.vec_bytes, plan.tile_bytes
    table = plan.table.cpu().numpy()
    if table.size != 4 * s + 3 * p or vec not in VEC_WIDTHS or tile <= 0 or tile % vec:
        raise ValueError(
            f"a plan of {s} segments and {p} programs (width {vec}, tile {tile} bytes) whose "
            f"table holds {table.size} numbers: expected {4 * s + 3 * p}, a width of "
            f"{VEC_WIDTHS} dividing the tile: use plan_copy or plan_batch"
        )
    seg, prog = table[: 4 * s].reshape(s, 4), table[4 * s :].reshape(p, 3)
    item_off, arena_off, nbytes, first = seg.T
    if s and (min(item_off.min(), arena_off.min(), nbytes.min()) < 0):
        raise ValueError("a segment with a negative offset or size: use plan_copy or plan_batch")
    n_vec = nbytes // vec * vec
    ends = first + -(-n_vec // tile) + (n_vec < nbytes)  # each segment's tiles end there
    tiles = int(ends[-1]) if s else 0
    if s and (first[0] != 0 or (first[1:] != ends[:-1]).any()):
        raise ValueError("segment rows whose first tiles do not follow each other from 0: "
                         "use plan_copy or plan_batch")  # fmt: skip
    for k, (at, begin, end) in enumerate(prog.tolist()):
        if begin >= end:
            continue
        if not 0 <= at < s:
            raise ValueError(f"program {k} starts at segment {at} of {s}: use plan_copy")
        if not first[at] <= begin < ends[at] or end > tiles:
            raise ValueError(f"program {k} runs tiles [{begin}, {end}) of {tiles}, from segment "
                             f"{at}'s [{first[at]}, {ends[at]}): use plan_copy")  # fmt: skip
    if s and (((item_off + items_base) % vec).any() or ((arena_off + arena_base) % vec).any()):
        raise ValueError(f"a segment whose address the width {vec} does not divide: use plan_copy")
    if not s:
        return 0, 0
    return int((item_off + nbytes).max()), int((arena_off + nbytes).max())


def upload_table(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (CPU) on ``device``, enqueued on the current stream without a host wait.

    A copy from pageable memory may block the host until the stream is idle,
    i.e. until the model's queued compute drains; from pinned memory it is a
    true asynchronous DMA. Torch's pinned-memory allocator records the copy on
    the stream and reuses the staging block only once it has completed.
    """
    staging = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
    staging.copy_(table)
    return staging.to(device, non_blocking=True)


def compile_variants(variants: Iterable[KernelVariant], device: torch.device) -> None:
    """Compile each variant for ``device`` now, launching nothing (CUDA only)."""
    with torch.cuda.device(device):
        for v in variants:
            # dtypes stand for the tensors: only their element types reach the key.
            _block_copy_kernel.warmup(
                torch.uint8, torch.uint8, torch.int64, torch.int64,
                TO_ARENA=v.to_arena, VEC=v.vec, TILE_BYTES=v.tile_bytes, num_warps=v.num_warps,
                grid=(1,),
            )  # fmt: skip
