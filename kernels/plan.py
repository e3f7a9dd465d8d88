"""Copy plans: item byte streams x block tables -> the segment table a launch consumes.

An item is a flat byte stream of ``nbytes`` bytes living at ``item_offset`` of
a flat "items" buffer. Its block table is a list of extents ``(start, count)``
of ``block_bytes``-byte blocks of the arena, in stream order. Each extent
becomes one segment: ``count * block_bytes`` consecutive bytes (fewer for
the item's last extent) that are contiguous on both sides.

Launch table, one flat int64 tensor: the segment rows, then one row per program::

    segments [S, 4]   item_offset   byte offset in the items buffer
                      arena_offset  byte offset in the arena (start * block_bytes)
                      nbytes        bytes to copy
                      first_tile    global index of the segment's first tile
    programs [P, 3]   first_segment the segment holding the program's first tile
                      tile_begin    its contiguous range of global tiles
                      tile_end

A segment is cut into ``tile_bytes`` tiles of full-width accesses plus, when
its size is not a multiple of the access width, one byte-wise tail tile. The
step's tiles are split into ``P`` contiguous ranges of (nearly) equal length,
so each program reads only the segment rows of its own range.

Everything is validated here, on the host, before any launch: a table that
points outside the arena, gives one block to two items, or does not cover its
item exactly (``ceil(nbytes / block_bytes)`` blocks, no more, no fewer) never
reaches a kernel.

Access width: a vector access is only as wide as the largest power of two
dividing *every* address it touches, so the width is derived here, in one
place, from the absolute address of every segment's source and destination
(items base + item offset, arena base + arena offset). A misaligned vector
access is a sticky "misaligned address" error on a GPU; the Triton
interpreter never faults, so this is checked on addresses by the tests.

The passes of one contract, here: the small pass (one test per extent, for steps of a
few extents, where numpy's per-call overhead would dominate), the vectorised numpy
pass (fragmented steps of thousands of extents, and a step table's arrays as they
are), and the reference loop, which checks everything in order and names the first
fault. A fast pass that finds any fault hands the step on to the loop. The planner's
C pass (``plan_native.c``) implements the same contract without the interpreter;
:mod:`.planner` chooses which pass plans a step. Cost grows with extents, never with
blocks.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import add
from typing import NamedTuple

import numpy as np
import torch

from .step_table import PlanError, pair_of_integers

MAX_VEC_BYTES = 16
VEC_WIDTHS = (1, 2, 4, 8, 16)  # every access width a plan can pick
I64_MAX = (1 << 63) - 1  # the launch table's offsets are int64


@dataclass(frozen=True)
class LaunchConfig:
    """Persistent-grid size. Defaults from the H200 prototype (its figures:
    shared/bench/h200-baseline.md): the fewest programs and warps that come near the
    PCIe limit in each direction while leaving the SMs to concurrent compute; a
    program per row would take every SM."""

    num_programs: int
    num_warps: int
    tile_bytes: int = 16384
    # Segments (contiguous on both sides) of at least this many bytes go to the
    # copy engine, one ``copy_`` each on the same stream, the rest to the kernel.
    # None until measured on the GPU (profiling/bench.py's DMA rows decide).
    dma_min_bytes: int | None = None


PACK_CONFIG = LaunchConfig(num_programs=8, num_warps=8)
UNPACK_CONFIG = LaunchConfig(num_programs=16, num_warps=4)


class CopyPlan(NamedTuple):
    """One launch's plan (immutable; a named tuple: a third of a frozen dataclass's
    construction cost, which a step pays on the host path)."""

    table: torch.Tensor  # int64 [S * 4 + P * 3]: segment rows, then program rows (CPU)
    num_segments: int
    num_programs: int  # programs the launch runs: min(requested, num_tiles)
    vec_bytes: int  # widest access every address allows (1, 2, 4, 8 or 16)
    tile_bytes: int
    num_tiles: int
    nbytes: int  # bytes moved in all
    # Segments long enough for the copy engine: (item_offset, arena_offset, nbytes),
    # not in the table (see ``dma_min_bytes``).
    dma: tuple[tuple[int, int, int], ...] = ()
    # The sizes the planner checked every segment against (items buffer, arena); -1: a
    # plan built by hand, whose table the launch checks instead (launch_block_copy).
    items_bytes: int = -1
    arena_bytes: int = -1

    @property
    def segments(self) -> torch.Tensor:
        """int64 [S, 4]: item_offset, arena_offset, nbytes, first_tile."""
        return self.table[: 4 * self.num_segments].view(-1, 4)

    @property
    def programs(self) -> torch.Tensor:
        """int64 [P, 3]: first_segment, tile_begin, tile_end."""
        return self.table[4 * self.num_segments :].view(-1, 3)


def int64_tensor(buffer: array | bytearray) -> torch.Tensor:
    """The table as a tensor sharing ``buffer``'s memory (frombuffer refuses an empty one)."""
    if not buffer:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)


def leave_long_segments_to_dma(
    flat: array | list[int], vec: int, tile_bytes: int, min_bytes: int
) -> tuple[array, array, int, list[tuple[int, int, int]]]:
    """Segment rows without those of ``min_bytes`` or more (tiles renumbered), and those."""
    kept, first_tiles, dma, tile = array("q"), array("q"), [], 0
    for i in range(0, len(flat), 4):
        src, dst, take = flat[i], flat[i + 1], flat[i + 2]
        if take >= min_bytes:
            dma.append((src, dst, take))
            continue
        kept.extend((src, dst, take, tile))
        first_tiles.append(tile)
        tail = take % vec
        tile += -(-(take - tail) // tile_bytes) + (tail != 0)
    return kept, first_tiles, tile, dma


def segments_loop(
    item_offsets, item_nbytes, tables, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[array, list[int], int, int, int]:  # fmt: skip
    """(segment rows, first tiles, tiles, access width, bytes): one item, one extent
    at a time; raises PlanError naming the first fault."""
    segments: list[tuple[int, int, int]] = []  # (item_offset, arena_offset, nbytes)
    owned: list[tuple[int, int, int]] = []  # (start, count, item) to find blocks given twice
    align_bits = MAX_VEC_BYTES
    total = 0
    for item, (offset, nbytes, table) in enumerate(
        zip(item_offsets, item_nbytes, tables, strict=True)
    ):
        if nbytes < 0 or offset < 0 or offset + nbytes > items_bytes:
            raise PlanError(
                f"item {item}: bytes [{offset}, {offset + nbytes}) are not inside the items "
                f"buffer of {items_bytes} bytes"
            )
        pos = 0
        for extent in table:
            start, count = pair_of_integers(item, extent)
            if count <= 0 or start < 0 or start + count > num_blocks:
                raise PlanError(
                    f"item {item}: extent ({start}, {count}) is not inside the arena's blocks "
                    f"[0, {num_blocks}); block tables must come from this arena's allocator"
                )
            if pos >= nbytes:
                raise PlanError(
                    f"item {item} has {nbytes} bytes but its block table lists more blocks: "
                    "a whole extent would stay unwritten; give each item exactly its blocks"
                )
            take = min(count * block_bytes, nbytes - pos)
            if count * block_bytes - take >= block_bytes:
                raise PlanError(
                    f"item {item} has {nbytes} bytes ({-(-nbytes // block_bytes)} blocks of "
                    f"{block_bytes}) but its extent ({start}, {count}) runs "
                    f"{(count * block_bytes - take) // block_bytes} block(s) past its end: "
                    "give each item exactly its blocks"
                )
            src, dst = offset + pos, start * block_bytes
            segments.append((src, dst, take))
            owned.append((start, count, item))
            align_bits |= (items_base + src) | (arena_base + dst)
            pos += take
        if pos < nbytes:
            raise PlanError(
                f"item {item} has {nbytes} bytes but its block table covers only {pos} "
                f"({pos // block_bytes} blocks of {block_bytes})"
            )
        total += nbytes
    vec = align_bits & -align_bits
    rows: list[int] = []
    first_tiles: list[int] = []
    tile = 0
    for src, dst, take in segments:
        rows += (src, dst, take, tile)
        first_tiles.append(tile)
        tail = take % vec
        tile += (take - tail + tile_bytes - 1) // tile_bytes + (tail != 0)
    _check_disjoint(owned)
    return array("q", rows), first_tiles, tile, vec, total


def segments_small(
    item_offsets, item_nbytes, tables, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[list[int], list[int], int, int, int] | None:  # fmt: skip
    """What :func:`segments_loop` returns, with the least work per extent (steps of a
    few extents); None if anything is wrong (the loop then names the fault).

    One test per extent stands for three of the loop's: ``take`` is positive and
    less than a block short of ``span`` exactly when the count is positive, the
    item still has bytes left and the extent does not run a whole block past
    them. Arena bounds and overlaps are checked once, on the extents sorted by start.
    """
    rows: list[int] = []  # item_offset, arena_offset, nbytes, first_tile per segment
    extents: list[tuple[int, int]] = []
    align_bits = MAX_VEC_BYTES
    tile = 0
    try:
        for offset, nbytes, table in zip(item_offsets, item_nbytes, tables, strict=True):
            pos, end = offset, offset + nbytes
            if offset < 0 or end > items_bytes:
                return None
            for start, count in table:
                span = count * block_bytes
                take = end - pos
                if take > span:
                    take = span
                if take <= 0 or span - take >= block_bytes:
                    return None
                dst = start * block_bytes
                rows += (pos, dst, take, tile)
                extents.append((start, count))
                tail = take % MAX_VEC_BYTES  # tiles at full width; recounted below if narrower
                tile += (take - tail + tile_bytes - 1) // tile_bytes + (tail != 0)
                align_bits |= (items_base + pos) | (arena_base + dst)
                pos += take
            if pos != end:  # fewer bytes than the item's, or a negative size
                return None
        extents.sort()
    except (TypeError, ValueError):
        return None  # not (start, count) pairs of ints: the loop says where
    at = 0  # sorted by start: the first starts at block 0 or later, each next where the last ended
    for start, count in extents:
        if start < at:
            return None
        at = start + count
    if at > num_blocks:
        return None
    vec = align_bits & -align_bits
    if vec < MAX_VEC_BYTES:
        tile = 0
        for i in range(2, len(rows), 4):
            take = rows[i]
            rows[i + 1] = tile
            tail = take % vec
            tile += (take - tail + tile_bytes - 1) // tile_bytes + (tail != 0)
    return rows, rows[3::4], tile, vec, sum(item_nbytes)


def segments_vectorised(
    item_offsets, item_nbytes, tables, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[array, array, int, int, int] | None:  # fmt: skip
    """What :func:`segments_loop` returns, in whole-array passes; None if anything
    is wrong (the loop then names the fault).

    An item is covered exactly when its extents' blocks hold its bytes with less
    than a block to spare (``0 <= over < block_bytes``): then only each item's
    last extent is clipped, by ``over``. Extents are disjoint and inside the
    arena when, sorted separately, the k-th smallest end is at most the
    (k+1)-th smallest start, the smallest start is at least 0 and the largest
    end at most ``num_blocks``. Starts and counts are bounded by the arena
    before any product or sum, so int64 never wraps in a step that passes.
    """
    lens = np.array([len(table) for table in tables], np.int64)
    n = int(lens.sum())
    flat = chain.from_iterable(chain.from_iterable(tables))  # no tuple list in between
    try:
        extents = np.frombuffer(struct.pack(f"{2 * n}q", *flat), np.int64).reshape(n, 2)
    except (struct.error, TypeError):
        return None  # not (start, count) pairs of int64
    return segments_arrays(extents, lens, item_offsets, item_nbytes, block_bytes, num_blocks,
                            items_bytes, tile_bytes, items_base, arena_base)  # fmt: skip


def segments_arrays(
    extents, lens, item_offsets, item_nbytes, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[array, array, int, int, int] | None:  # fmt: skip
    """:func:`segments_vectorised` on the extents as an int64 [E, 2] array, ``lens[i]`` of
    them item i's (a step table's arrays, read as they are); None if anything is wrong."""
    if not len(item_offsets) or len(lens) != len(item_offsets) or len(lens) != len(item_nbytes):
        return None  # nothing to vectorise, or one count off: the loop says which
    if min(item_offsets) < 0 or min(item_nbytes) < 0:
        return None
    if max(map(add, item_offsets, item_nbytes)) > items_bytes:
        return None
    n = len(extents)
    if n == 0:
        return None
    starts, counts = extents.T
    first_starts = np.sort(starts)
    if first_starts[0] < 0 or first_starts[-1] >= num_blocks:
        return None
    if counts.min() <= 0 or counts.max() > num_blocks:
        return None  # (bounded first: no int64 product or sum below can wrap)
    rows = np.empty((n, 4), np.int64)  # item_offset, arena_offset, nbytes, first_tile
    src, dst, take, first = rows.T
    np.multiply(counts, block_bytes, out=take)  # whole extents, clipped below
    stream = np.zeros(n + 1, np.int64)  # where each extent starts in the step's byte stream
    np.cumsum(take, out=stream[1:])
    ends = np.cumsum(lens)  # one past each item's last extent
    item_start = stream[ends - lens]
    over = stream[ends] - item_start - np.asarray(item_nbytes, np.int64)
    if (over < 0).any() or (over >= block_bytes).any():
        return None  # an item not covered exactly
    has = lens > 0
    take[ends[has] - 1] -= over[has]
    np.add(stream[:-1], np.repeat(np.asarray(item_offsets, np.int64) - item_start, lens), out=src)
    np.multiply(starts, block_bytes, out=dst)
    last_ends = np.sort(starts + counts)
    if last_ends[-1] > num_blocks or (first_starts[1:] < last_ends[:-1]).any():
        return None  # past the arena's end, or blocks given twice
    bits = np.bitwise_or.reduce(src + items_base) | np.bitwise_or.reduce(dst + arena_base)
    vec = int((bits | MAX_VEC_BYTES) & -(bits | MAX_VEC_BYTES))
    tail = take % vec
    body = take - tail  # ceil(body / tile_bytes) without body + tile_bytes (int64 wraps there)
    tiles = body // tile_bytes + (body % tile_bytes != 0) + (tail != 0)
    np.cumsum(tiles, out=first)
    num_tiles = int(first[-1])
    first -= tiles
    return array("q", rows.tobytes()), array("q", first.tobytes()), num_tiles, vec, sum(item_nbytes)


def split_tiles(first_tiles: Sequence[int], num_tiles: int, programs: int) -> list[int]:
    """Program rows: ``num_tiles`` tiles in ``programs`` contiguous ranges of equal length
    (+-1), each with the segment its first tile falls in (every segment has a tile)."""
    rows: list[int] = []
    begin = 0
    for p in range(1, programs + 1):
        end = num_tiles * p // programs
        rows += (bisect_right(first_tiles, begin) - 1, begin, end)
        begin = end
    return rows


def _check_disjoint(owned: list[tuple[int, int, int]]) -> None:
    owned.sort()
    for (s0, c0, i0), (s1, c1, i1) in zip(owned, owned[1:], strict=False):
        if s1 < s0 + c0:
            raise PlanError(
                f"blocks given twice: extent ({s0}, {c0}) of item {i0} overlaps "
                f"extent ({s1}, {c1}) of item {i1}"
            )
