"""Which pass plans a step: the one module that chooses.

A launch needs two things worked out on the host, each by a C pass or by Python passes
of one contract:

- the items' layout (the lowest-addressed item, each item's byte offset from it and
  its size): the C pass's ``item_layout`` (asking each tensor three things through
  torch is most of a small step's host cost in Python), else
  :func:`.items.python_item_layout`, which also names what is wrong where the C pass
  declines;
- the copy plan (:class:`.plan.CopyPlan`): the C pass (``plan_step`` over a
  :class:`~.step_table.StepTable`'s int64 arrays, ``plan`` over per-item pairs), else
  the Python passes of :mod:`.plan`: a step table's arrays to the numpy pass, per-item
  pairs (a table made by ``StepTable.of_pairs`` among them) to the small pass below
  :data:`VECTORISE_FROM` extents and to the vectorised pass from it, and the reference
  loop where a fast pass finds a fault (it names the first). A DMA split
  (``LaunchConfig.dma_min_bytes``) is planned in Python only.

The C pass is loaded once per process by :func:`.native.planner` (None where it was
not built or ``ECOFFLOAD_NATIVE_PLAN=0``). The step table's checks
(:mod:`.step_table`) also run in C where it is loaded: they check tables, they do not
plan them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import native
from .items import ItemViews, byte_size, byte_view_of, plain_byte_view, python_item_layout
from .plan import (
    I64_MAX,
    CopyPlan,
    LaunchConfig,
    int64_tensor,
    leave_long_segments_to_dma,
    segments_arrays,
    segments_loop,
    segments_small,
    segments_vectorised,
    split_tiles,
)
from .step_table import PlanError, StepTable, Tables, step_arrays

VECTORISE_FROM = 128  # extents per step from which numpy's whole-array passes pay


class StepPlan(NamedTuple):
    """What a launch needs from the host: where the items lie and the plan over them."""

    base: torch.Tensor | None  # the lowest-addressed non-empty item as uint8; None: all empty
    offsets: Sequence[int]  # each item's byte offset from ``base``
    plan: CopyPlan


class ItemLayout(NamedTuple):
    """Where a list of tensors lies (:func:`item_layout`)."""

    base: torch.Tensor | None  # the lowest-addressed non-empty item as uint8; None: all empty
    offsets: list[int]  # each item's byte offset from ``base``
    nbytes: list[int]  # each item's size in bytes
    span: int  # bytes from ``base`` to the end of the highest item


# A named tuple's own __new__ is a Python function; every step's record is made by the
# C constructor it calls (``tuple.__new__(StepPlan, fields)``), in half the time.
_step_plan = tuple.__new__


def plans_pairs_in_c() -> bool:
    """Whether per-item tables of pairs are planned by the C pass (it reads a few tuples
    in less time than numpy takes to make arrays of them); without it, the numpy pass
    reads a :class:`~.step_table.StepTable`'s arrays."""
    return native.planner() is not None


def plan_items(
    tensors: Sequence[torch.Tensor],
    tables: Tables,
    arena: torch.Tensor,
    block_bytes: int,
    config: LaunchConfig,
) -> StepPlan:
    """The layout of ``tensors`` and the plan of one launch over them and ``arena``;
    validates everything (PlanError naming the first fault). Both passes in C on the
    usual step (one layout, or an :class:`ItemViews`' own, and one plan: no Python per
    tensor or extent); where the C pass declines, :func:`plan_copy` (which names what
    is wrong)."""
    c_pass = native.planner()
    if isinstance(tensors, ItemViews):  # one buffer: its layout is known
        base, offsets, nbytes = tensors.buffer, tensors.offsets, tensors.nbytes
        span = byte_size(base, "the ItemViews' buffer")
        if type(base) is not torch.Tensor:
            base = plain_byte_view(base)
    else:
        tensors = list(tensors)
        found = c_pass.item_layout(tensors) if c_pass is not None else None
        if found is None:  # the long way, which names what is wrong
            base, offsets, nbytes, span = python_item_layout(tensors)
        else:
            lowest, offsets, nbytes, span = found
            base = byte_view_of(tensors[lowest]) if lowest >= 0 else None
    if c_pass is not None and config.dma_min_bytes is None:  # the usual step: planned in C
        plan = plan_in_c(c_pass, offsets, nbytes, tables, block_bytes, arena.numel(), span,
                         config.tile_bytes, base.data_ptr() if base is not None else 0,
                         arena.data_ptr(), config.num_programs)  # fmt: skip
        if plan is not None:
            return _step_plan(StepPlan, (base, offsets, plan))
    plan = plan_copy(
        offsets, nbytes, tables, block_bytes=block_bytes, arena_bytes=arena.numel(),
        items_bytes=span, tile_bytes=config.tile_bytes, num_programs=config.num_programs,
        items_base=base.data_ptr() if base is not None else 0, arena_base=arena.data_ptr(),
        dma_min_bytes=config.dma_min_bytes,
    )  # fmt: skip
    return StepPlan(base, offsets, plan)


def item_layout(tensors: list[torch.Tensor]) -> ItemLayout:
    """Where ``tensors`` lie: the C pass's numbers where it is loaded and accepts them,
    else :func:`.items.python_item_layout`'s (which names what is wrong)."""
    c_pass = native.planner()
    found = c_pass.item_layout(tensors) if c_pass is not None else None
    if found is None:
        return ItemLayout(*python_item_layout(tensors))
    lowest, offsets, sizes, span = found
    return ItemLayout(byte_view_of(tensors[lowest]) if lowest >= 0 else None, offsets, sizes, span)


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
    if isinstance(tables, StepTable) and tables.pairs is not None:
        tables = tables.pairs  # pairs kept as given: planned as pairs, no arrays made
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
    if arena_bytes > I64_MAX or items_bytes > I64_MAX:  # the table's offsets are int64
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
        segments = segments_arrays(arrays[0], np.diff(arrays[1]), *args[:2], *args[3:])
    elif sum(map(len, tables)) >= VECTORISE_FROM:
        segments = segments_vectorised(*args)
    else:
        segments = segments_small(*args)
    flat, first_tiles, num_tiles, vec, total = segments or segments_loop(*args)
    dma: list[tuple[int, int, int]] = []
    if dma_min_bytes is not None:
        flat, first_tiles, num_tiles, dma = leave_long_segments_to_dma(
            flat, vec, tile_bytes, dma_min_bytes
        )
    programs = min(num_programs, num_tiles)
    program_rows = split_tiles(first_tiles, num_tiles, programs)
    if isinstance(flat, array):
        flat.extend(program_rows)
    else:  # the small pass's list: one conversion
        flat = array("q", flat + program_rows)
    table = int64_tensor(flat)
    return CopyPlan(table, len(first_tiles), programs, vec, tile_bytes, num_tiles, total,
                    tuple(dma), items_bytes, arena_bytes)  # fmt: skip


def plan_in_c(c_pass, item_offsets, item_nbytes, tables, block_bytes, arena_bytes, items_bytes,
              tile_bytes, items_base, arena_base, num_programs) -> CopyPlan | None:  # fmt: skip
    """:func:`plan_copy`'s plan from the C pass (``native.planner()``), or None where it
    declines (then the Python passes plan, or name what is wrong). Positional, no
    defaults: the host path of every step calls it (a keyword call of
    :func:`plan_copy` costs about a microsecond more)."""
    step = tables if isinstance(tables, StepTable) else None
    pairs = tables if step is None else step.pairs  # a step table's pairs, kept as given
    try:
        if step is not None and pairs is None:  # its arrays, through the buffer protocol
            planned = c_pass.plan_step(item_offsets, item_nbytes, step.extents, step.bounds,
                                       block_bytes, arena_bytes, items_bytes, tile_bytes,
                                       items_base, arena_base, num_programs)  # fmt: skip
        else:
            planned = c_pass.plan(item_offsets, item_nbytes, pairs, block_bytes, arena_bytes,
                                  items_bytes, tile_bytes, items_base, arena_base,
                                  num_programs)  # fmt: skip
    except (OverflowError, TypeError):  # past int64, or not an int: the Python passes
        return None
    if planned is None:
        return None
    rows, num_segments, programs, vec, num_tiles, total = planned
    return CopyPlan(int64_tensor(rows), num_segments, programs, vec, tile_bytes, num_tiles,
                    total, (), items_bytes, arena_bytes)  # fmt: skip
