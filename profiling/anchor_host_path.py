"""The host path of a copy as it was before issue 10 (kernels at commit 5788d33^),
frozen as the anchor of :mod:`.bench_host`: the same work, done the old way, in
the same run. Nothing in the engine uses it.

Old shape: every item's layout read from its tensor, a Python loop per extent
(no vectorised pass, no per-program rows), and load outputs made as byte views
reinterpreted per item.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..kernels.reference import byte_view

ITEM_ALIGN = 256
MAX_VEC_BYTES = 16
Extents = Sequence[tuple[int, int]]


def plan_copy(
    item_offsets: Sequence[int],
    item_nbytes: Sequence[int],
    tables: Sequence[Extents],
    *,
    block_bytes: int,
    arena_bytes: int,
    items_bytes: int,
    tile_bytes: int = 16384,
    items_base: int = 0,
    arena_base: int = 0,
) -> tuple[torch.Tensor, int, int]:
    """Build and validate the segment table for one launch (the old loop).

    Args:
        item_offsets, item_nbytes: where each item's bytes sit in the items buffer.
        tables: each item's extents, in stream order, covering exactly its
            ``ceil(nbytes / block_bytes)`` blocks.
        block_bytes: arena block size; arena_bytes: the arena's size in bytes.
        items_bytes: size of the items buffer (offsets are checked against it).
        tile_bytes: bytes one program copies per loop iteration.
        items_base, arena_base: absolute addresses of the items buffer and of the
            arena (``data_ptr()``); the access width divides every segment's
            ``items_base + item_offset`` and ``arena_base + arena_offset``.
    """
    if not (len(item_offsets) == len(tables) == len(item_nbytes)):
        raise ValueError(
            f"expected one offset and one block table per item, got {len(item_offsets)} "
            f"offsets and {len(tables)} tables for {len(item_nbytes)} items"
        )
    if block_bytes <= 0 or arena_bytes % block_bytes:
        raise ValueError(
            f"arena of {arena_bytes} bytes is not a whole number of {block_bytes}-byte blocks"
        )
    num_blocks = arena_bytes // block_bytes
    segments: list[tuple[int, int, int]] = []  # (item_offset, arena_offset, nbytes)
    owned: list[tuple[int, int, int]] = []  # (start, count, item) to find blocks given twice
    align_bits = MAX_VEC_BYTES
    total = 0
    for item, (offset, nbytes, table) in enumerate(
        zip(item_offsets, item_nbytes, tables, strict=True)
    ):
        if nbytes < 0 or offset < 0 or offset + nbytes > items_bytes:
            raise ValueError(
                f"item {item}: bytes [{offset}, {offset + nbytes}) are not inside the items "
                f"buffer of {items_bytes} bytes"
            )
        pos = 0
        for start, count in table:
            if count <= 0 or start < 0 or start + count > num_blocks:
                raise ValueError(
                    f"item {item}: extent ({start}, {count}) is not inside the arena's blocks "
                    f"[0, {num_blocks}); block tables must come from this arena's allocator"
                )
            if pos >= nbytes:
                raise ValueError(
                    f"item {item} has {nbytes} bytes but its block table lists more blocks: "
                    "a whole extent would stay unwritten; give each item exactly its blocks"
                )
            take = min(count * block_bytes, nbytes - pos)
            if count * block_bytes - take >= block_bytes:
                raise ValueError(
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
            raise ValueError(
                f"item {item} has {nbytes} bytes but its block table covers only {pos} "
                f"({pos // block_bytes} blocks of {block_bytes})"
            )
        total += nbytes
    vec = align_bits & -align_bits
    flat = array("q")
    first_tile = 0
    for src, dst, take in segments:
        flat.extend((src, dst, take, first_tile))
        tail = take % vec
        first_tile += -(-(take - tail) // tile_bytes) + (tail != 0)
    _check_disjoint(owned)
    table = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
    return table.view(-1, 4), vec, first_tile  # segments, access width, tiles


def _check_disjoint(owned: list[tuple[int, int, int]]) -> None:
    owned.sort()
    for (s0, c0, i0), (s1, c1, i1) in zip(owned, owned[1:], strict=False):
        if s1 < s0 + c0:
            raise ValueError(
                f"blocks given twice: extent ({s0}, {c0}) of item {i0} overlaps "
                f"extent ({s1}, {c1}) of item {i1}"
            )


def empty_items(
    specs: Sequence[tuple[torch.dtype, Sequence[int]]], device: torch.device | str
) -> list[torch.Tensor]:
    """Uninitialised tensors of the given (dtype, shape), as views of one buffer.

    Each item starts at a multiple of 256 bytes, so :func:`unpack` writes all
    of them in place with full-width accesses.
    """
    sizes = [torch.Size(shape).numel() * dt.itemsize for dt, shape in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ITEM_ALIGN) * ITEM_ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    return [
        buffer[o : o + n].view(dt).view(tuple(shape))
        for o, n, (dt, shape) in zip(offsets, sizes, specs, strict=True)
    ]


def _item_layout(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[int], list[int], int]:
    """(base, offsets, sizes, span): the lowest-addressed non-empty item as a flat
    uint8 tensor, each item's byte offset from it and byte size, and the bytes
    from base to the end of the highest item."""
    ptrs, sizes = [], []
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(
                f"tensor {i} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): "
                "call .contiguous() first"
            )
        ptrs.append(t.data_ptr())
        sizes.append(t.nbytes)
    nonempty = [i for i, n in enumerate(sizes) if n]
    if not nonempty:
        return None, [0] * len(tensors), sizes, 0
    lowest = min(nonempty, key=ptrs.__getitem__)
    start = ptrs[lowest]
    offsets = [p - start if n else 0 for p, n in zip(ptrs, sizes, strict=True)]
    span = max(o + n for o, n in zip(offsets, sizes, strict=True))
    return byte_view(tensors[lowest]), offsets, sizes, span
