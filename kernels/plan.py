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

Fast passes of one contract, and a reference. First choice, on every step:
the C pass (``plan_native.c``, built at install time, loaded by
:mod:`.native`): from a :class:`~.step_table.StepTable`'s int64 arrays
(read through the buffer protocol) or from per-item tables of pairs, tens of
nanoseconds per extent (BENCHMARKS.md, "Host cost of a step's copy"). Where it was
not built (or
``ECOFFLOAD_NATIVE_PLAN=0``), the Python passes: a step table's arrays go
to the numpy pass as they are; per-item tables by size, one test per extent
for steps of a few extents (numpy's per-call overhead would dominate
there), and the vectorised numpy pass for fragmented steps (thousands of
extents), where interpreted work per extent would cost milliseconds. The reference is
the plain loop, which
checks everything in order. When a fast pass finds any fault it hands the
step on, and the loop names the first fault precisely. Cost grows with
extents, never with blocks.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import chain
from operator import add
from typing import NamedTuple

import numpy as np
import torch

from . import native
from .step_table import PlanError, StepTable, Tables, step_arrays

MAX_VEC_BYTES = 16
VECTORISE_FROM = 128  # extents per step from which numpy's whole-array passes pay
VEC_WIDTHS = (1, 2, 4, 8, 16)  # every access width a plan can pick
_I64_MAX = (1 << 63) - 1


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


def plan_copy(
    item_offsets: Sequence[int],
    item_nbytes: Sequence[int],
    tables: Tables,
    *,
    block_bytes: int,
    arena_bytes: int,
    items_bytes: int,
    tile_bytes: int = 16384,
    items_base: int = 0,
    arena_base: int = 0,
    num_programs: int = 1,
    dma_min_bytes: int | None = None,
) -> CopyPlan:
    """Build and validate the segment table for one launch.

    Args:
        item_offsets, item_nbytes: where each item's bytes sit in the items buffer.
        tables: each item's extents, in stream order, covering exactly its
            ``ceil(nbytes / block_bytes)`` blocks: per-item sequences of
            ``(start, count)`` pairs, or a :class:`StepTable` (int64 arrays, read
            by the C pass through the buffer protocol; planned in numpy without it).
        block_bytes: arena block size; arena_bytes: the arena's size in bytes.
        items_bytes: size of the items buffer (offsets are checked against it).
        tile_bytes: bytes one program copies per loop iteration.
        items_base, arena_base: absolute addresses of the items buffer and of the
            arena (``data_ptr()``); the access width divides every segment's
            ``items_base + item_offset`` and ``arena_base + arena_offset``.
        num_programs: programs to split the tiles between (fewer if there are
            fewer tiles).
        dma_min_bytes: segments of at least this many bytes are left to the copy
            engine (``CopyPlan.dma``) instead of the kernel; None: none are.
    """
    step = tables if isinstance(tables, StepTable) else None
    c_pass = native.planner() if dma_min_bytes is None else None  # the DMA split: Python only
    if c_pass is not None:  # first: it also makes every check below (None if one fails)
        planned = plan_in_c(c_pass, item_offsets, item_nbytes, tables, block_bytes,
                            arena_bytes, items_bytes, tile_bytes, items_base, arena_base,
                            num_programs)  # fmt: skip
        if planned is not None:
            return planned
    if num_programs <= 0:
        raise PlanError(f"num_programs must be positive, got {num_programs}")
    if tile_bytes <= 0:  # no tile would advance (0), or the program count goes negative
        raise PlanError(f"tile_bytes must be positive, got {tile_bytes}")
    if arena_bytes < 0:
        raise PlanError(f"arena_bytes must not be negative, got {arena_bytes}")
    if arena_bytes > _I64_MAX or items_bytes > _I64_MAX:  # the table's offsets are int64
        raise PlanError(
            f"an arena of {arena_bytes} bytes or items buffer of {items_bytes}: past int64, "
            "which the launch table's offsets are"
        )
    arrays = None
    if step is not None:  # the arrays as the C pass reads them, bounds checked (mutable)
        arrays = extents, bounds = step_arrays(step.extents, step.bounds)
        tables = StepTable.__new__(StepTable)  # the loop below reads these arrays, no others
        tables.extents, tables.bounds = extents, bounds
    if not (len(item_offsets) == len(tables) == len(item_nbytes)):
        raise PlanError(
            f"expected one offset and one block table per item, got {len(item_offsets)} "
            f"offsets and {len(tables)} tables for {len(item_nbytes)} items"
        )
    if block_bytes <= 0 or arena_bytes % block_bytes:
        raise PlanError(
            f"arena of {arena_bytes} bytes is not a whole number of {block_bytes}-byte blocks"
        )
    args = (item_offsets, item_nbytes, tables, block_bytes, arena_bytes // block_bytes,
            items_bytes, tile_bytes, items_base, arena_base)  # fmt: skip
    if arrays is not None:  # arrays already: numpy plans them whatever their size
        segments = _segments_arrays(arrays[0], np.diff(arrays[1]), *args[:2], *args[3:])
    elif sum(map(len, tables)) >= VECTORISE_FROM:
        segments = _segments_vectorised(*args)
    else:
        segments = _segments_small(*args)
    flat, first_tiles, num_tiles, vec, total = segments or _segments_loop(*args)
    dma: list[tuple[int, int, int]] = []
    if dma_min_bytes is not None:
        flat, first_tiles, num_tiles, dma = _leave_long_segments_to_dma(
            flat, vec, tile_bytes, dma_min_bytes
        )
    programs = min(num_programs, num_tiles)
    program_rows = _split_tiles(first_tiles, num_tiles, programs)
    if isinstance(flat, array):
        flat.extend(program_rows)
    else:  # the small pass's list: one conversion
        flat = array("q", flat + program_rows)
    table = _int64_tensor(flat)
    return CopyPlan(table, len(first_tiles), programs, vec, tile_bytes, num_tiles, total,
                    tuple(dma), items_bytes, arena_bytes)  # fmt: skip


def plan_in_c(c_pass, item_offsets, item_nbytes, tables, block_bytes, arena_bytes, items_bytes,
              tile_bytes, items_base, arena_base, num_programs) -> CopyPlan | None:  # fmt: skip
    """:func:`plan_copy`'s plan from the C pass (``native.planner()``), or None where it
    declines (then the Python passes plan, or name what is wrong). Positional, no
    defaults: the host path of every step calls it (a keyword call of
    :func:`plan_copy` costs about a microsecond more)."""
    try:
        if isinstance(tables, StepTable):  # the arrays, through the buffer protocol (C checks)
            planned = c_pass.plan_step(item_offsets, item_nbytes, tables.extents, tables.bounds,
                                       block_bytes, arena_bytes, items_bytes, tile_bytes,
                                       items_base, arena_base, num_programs)  # fmt: skip
        else:
            planned = c_pass.plan(item_offsets, item_nbytes, tables, block_bytes, arena_bytes,
                                  items_bytes, tile_bytes, items_base, arena_base,
                                  num_programs)  # fmt: skip
    except (OverflowError, TypeError):  # past int64, or not an int: the Python passes
        return None
    if planned is None:
        return None
    rows, num_segments, programs, vec, num_tiles, total = planned
    return CopyPlan(_int64_tensor(rows), num_segments, programs, vec, tile_bytes, num_tiles,
                    total, (), items_bytes, arena_bytes)  # fmt: skip


def _int64_tensor(buffer: array | bytearray) -> torch.Tensor:
    """The table as a tensor sharing ``buffer``'s memory (frombuffer refuses an empty one)."""
    if not buffer:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)


def _leave_long_segments_to_dma(
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


def _segments_loop(
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
        for start, count in table:
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


def _segments_small(
    item_offsets, item_nbytes, tables, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[list[int], list[int], int, int, int] | None:  # fmt: skip
    """What :func:`_segments_loop` returns, with the least work per extent (steps of a
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


def _segments_vectorised(
    item_offsets, item_nbytes, tables, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[array, array, int, int, int] | None:  # fmt: skip
    """What :func:`_segments_loop` returns, in whole-array passes; None if anything
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
    return _segments_arrays(extents, lens, item_offsets, item_nbytes, block_bytes, num_blocks,
                            items_bytes, tile_bytes, items_base, arena_base)  # fmt: skip


def _segments_arrays(
    extents, lens, item_offsets, item_nbytes, block_bytes, num_blocks, items_bytes, tile_bytes,
    items_base, arena_base,
) -> tuple[array, array, int, int, int] | None:  # fmt: skip
    """:func:`_segments_vectorised` on the extents as an int64 [E, 2] array, ``lens[i]`` of
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


def _split_tiles(first_tiles: Sequence[int], num_tiles: int, programs: int) -> list[int]:
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
