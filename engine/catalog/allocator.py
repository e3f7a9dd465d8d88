"""Block allocator: a fixed number of fixed-size blocks, handed out as extents.

An item is a flat byte stream cut into ``ceil(nbytes / block_bytes)`` blocks.
``alloc`` is all-or-nothing and returns extents ``(start, count)`` of
consecutive blocks, preferring few, long extents:

1. the smallest single free extent that holds the whole item (best fit), else
2. the largest free extents, longest first, until the item is covered.

``free`` coalesces with both neighbours.

Readiness: only blocks below ``ready_blocks`` are ever handed out (the arena's
populate makes them ready as a growing prefix); ``add_ready`` moves the
boundary up and frees the new blocks into the pool. Every operation costs O(extents
touched x log(free extents)), never O(blocks): a 1024-row item is one extent,
not 512 list entries.

Invariant (checked by ``check``): free extents are disjoint, never adjacent,
below ``ready_blocks``, and ``free_blocks + allocated blocks == ready_blocks``.

Plain Python on purpose: no torch, fast to test and reason about.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import NamedTuple

from ..base.errors import InvalidSizeError, ItemTooLargeError


class Extent(NamedTuple):
    """``count`` consecutive blocks starting at block ``start``."""

    start: int
    count: int  # pyright: ignore[reportIncompatibleMethodOverride]  (not tuple.count, never used)


def blocks_for(nbytes: int, block_bytes: int) -> int:
    """Number of blocks an ``nbytes`` byte stream occupies."""
    return -(-nbytes // block_bytes)


def item_blocks(nbytes: int, block_bytes: int, num_blocks: int) -> int:
    """Blocks an item of ``nbytes`` bytes needs in an arena of ``num_blocks``: an
    InvalidSizeError for a size that is no positive int, ItemTooLargeError past the arena."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise InvalidSizeError(f"item size must be a positive int number of bytes, got {nbytes!r}")
    need = blocks_for(nbytes, block_bytes)
    if need > num_blocks:
        raise ItemTooLargeError(
            f"item of {nbytes} bytes needs {need} blocks of {block_bytes} bytes, "
            f"the arena has {num_blocks} in all: give the arena more bytes "
            "or do not offload items this large"
        )
    return need


class BlockAllocator:
    """Extent allocator over ``num_blocks`` blocks of ``block_bytes`` bytes."""

    def __init__(self, num_blocks: int, block_bytes: int, ready_blocks: int | None = None) -> None:
        if num_blocks <= 0:
            raise InvalidSizeError(f"num_blocks must be positive, got {num_blocks}")
        if block_bytes <= 0 or block_bytes % 4096:
            raise InvalidSizeError(
                f"block_bytes must be a positive multiple of 4096, got {block_bytes}"
            )
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.free_blocks = 0
        self.ready_blocks = 0
        self._by_start: dict[int, int] = {}  # start -> count
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._by_size: list[tuple[int, int]] = []  # sorted (count, start)
        self.add_ready(num_blocks if ready_blocks is None else ready_blocks)

    def add_ready(self, ready_blocks: int) -> int:
        """Blocks ``[0, ready_blocks)`` are ready: free the newly ready ones into the pool.

        Never moves the boundary down; returns how many blocks became ready.
        """
        new = min(max(ready_blocks, self.ready_blocks), self.num_blocks)
        added, old = new - self.ready_blocks, self.ready_blocks
        if added:
            self.ready_blocks = new
            self.free([Extent(old, added)])
        return added

    @property
    def largest_free_extent(self) -> int:
        """Length in blocks of the longest free extent (0 when full)."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_free_extents(self) -> int:
        return len(self._by_size)

    def blocks_for(self, nbytes: int) -> int:
        """Blocks needed by an item of ``nbytes`` bytes, after validating the size."""
        return item_blocks(nbytes, self.block_bytes, self.num_blocks)

    def alloc(self, nbytes: int) -> list[Extent] | None:
        """Extents covering ``nbytes`` bytes, or None (and no change) if they do not fit."""
        need = self.blocks_for(nbytes)
        if need > self.free_blocks:
            return None
        i = bisect_left(self._by_size, (need, -1))
        if i < len(self._by_size):
            count, start = self._by_size[i]
            self._take(start, count, need)
            return [Extent(start, need)]
        extents = []
        while need:
            count, start = self._by_size[-1]
            take = min(count, need)
            self._take(start, count, take)
            extents.append(Extent(start, take))
            need -= take
        extents.sort()
        return extents

    def free(self, extents: list[Extent]) -> None:
        """Return extents to the free pool, merging with free neighbours."""
        for start, count in extents:
            if count <= 0 or start < 0 or start + count > self.ready_blocks:
                raise InvalidSizeError(
                    f"extent ({start}, {count}) is outside the ready blocks "
                    f"[0, {self.ready_blocks}) of {self.num_blocks}"
                )
            end = start + count
            before = self._by_end.get(start)
            if before is not None:
                self._remove(before, start - before)
                start = before
            after = self._by_start.get(end)
            if after is not None:
                self._remove(end, after)
                end += after
            self._insert(start, end - start)
            self.free_blocks += count

    def check(self) -> None:
        """Assert the allocator's internal invariants (used by tests)."""
        assert len(self._by_start) == len(self._by_end) == len(self._by_size)
        assert self._by_size == sorted((c, s) for s, c in self._by_start.items())
        prev_end = -1
        for start in sorted(self._by_start):
            count = self._by_start[start]
            assert count > 0 and start > prev_end, "free extents overlap or touch"
            assert self._by_end[start + count] == start
            prev_end = start + count
        assert prev_end <= self.ready_blocks <= self.num_blocks, "free blocks beyond the ready ones"
        assert self.free_blocks == sum(self._by_start.values())

    def _take(self, start: int, count: int, take: int) -> None:
        self._remove(start, count)
        if take < count:
            self._insert(start + take, count - take)
        self.free_blocks -= take

    def _insert(self, start: int, count: int) -> None:
        self._by_start[start] = count
        self._by_end[start + count] = start
        insort(self._by_size, (count, start))

    def _remove(self, start: int, count: int) -> None:
        del self._by_start[start]
        del self._by_end[start + count]
        del self._by_size[bisect_left(self._by_size, (count, start))]
