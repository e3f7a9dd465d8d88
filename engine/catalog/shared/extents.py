"""The shared catalog's free-extent allocator, in the region's per-block arrays.

Free extents sit in 64 power-of-two size classes (doubly linked lists, heads
and a non-empty mask in the header) with boundary tags: an extent's size at
its first block (``_fs``), its start at its last block (``_fe``), so a free
coalesces with both neighbours in O(1). Allocation takes a good fit among the
first few of the request's own class, else any extent of a higher class,
else the longest extents first (an item may own several). Only blocks below
the ready watermark are ever free.
"""

from __future__ import annotations

from ..allocator import Extent
from .format import H_CLASSES, H_FREE_BLOCKS, H_MASK, H_READY_BLOCKS
from .state import CatalogState


class ExtentAllocator(CatalogState):
    """Free extents of the shared catalog (a mixin; lock held, catalog dirty)."""

    def _fl_insert(self, s: int, c: int) -> None:
        w, i = self._w, self._i
        i[self._fs + s] = c
        i[self._fe + s + c - 1] = s
        k = c.bit_length() - 1
        head = w[H_CLASSES + k]
        if not -1 <= head < self._nblocks:
            self._corrupt(f"free extents of class {k} start at block {head} "
                          f"(blocks: {self._nblocks})")  # fmt: skip
        i[self._fn + s] = head
        i[self._fp + s] = -1
        if head >= 0:
            i[self._fp + head] = s
        w[H_CLASSES + k] = s
        w[H_MASK] |= 1 << k

    def _fl_remove(self, s: int) -> int:
        w, i, n = self._w, self._i, self._nblocks
        c = i[self._fs + s] if 0 <= s < n else 0
        prev, nxt = (i[self._fp + s], i[self._fn + s]) if c else (-1, -1)
        if c <= 0 or c > n - s or not (-1 <= prev < n and -1 <= nxt < n):
            self._corrupt(f"free extent at block {s} of {n}: {c} blocks, links {prev}, {nxt}")
        k = c.bit_length() - 1
        if prev >= 0:
            i[self._fn + prev] = nxt
        else:
            w[H_CLASSES + k] = nxt
            if nxt < 0:
                w[H_MASK] &= ~(1 << k)
        if nxt >= 0:
            i[self._fp + nxt] = prev
        i[self._fs + s] = 0
        i[self._fe + s + c - 1] = -1
        return c

    def _free_extent(self, s: int, c: int) -> None:
        i, fs = self._i, self._fs
        self._w[H_FREE_BLOCKS] += c
        if s > 0:
            left = i[self._fe + s - 1]  # (below s: a start past it is no left neighbour)
            if 0 <= left < s and i[fs + left] > 0 and left + i[fs + left] == s:
                c += self._fl_remove(left)
                s = left
        end = s + c
        if end < self.layout.num_blocks and i[fs + end] > 0:
            c += self._fl_remove(end)
        self._fl_insert(s, c)

    def _alloc(self, need: int) -> list[Extent]:
        """Extents covering ``need`` blocks (the caller checked they are free)."""
        w, i, fs, fn = self._w, self._i, self._fs, self._fn
        k = need.bit_length() - 1
        mask = w[H_MASK]
        best, seen = -1, 0
        if mask >> k & 1:  # good fit among the first few of need's own class
            s = w[H_CLASSES + k]
            while s >= 0 and seen < 8:
                if s >= self._nblocks:
                    self._corrupt(f"free extents of class {k} reach block {s}")
                c = i[fs + s]
                if c >= need and (best < 0 or c < i[fs + best]):
                    best = s
                    if c == need:
                        break
                s = i[fn + s]
                seen += 1
        if best < 0:
            higher = mask >> (k + 1)
            if higher:  # any extent of a higher class is long enough
                best = w[H_CLASSES + k + 1 + (higher & -higher).bit_length() - 1]
        w[H_FREE_BLOCKS] -= need
        if best >= 0:
            c = self._fl_remove(best)
            if c < need:  # a class's extent shorter than its class, or than its size said
                self._corrupt(f"free extent at block {best}: {c} blocks, taken for {need}")
            if c > need:
                self._fl_insert(best + need, c - need)
            return [Extent(best, need)]
        extents = []
        while need:  # longest classes first (each takes at least one block)
            if w[H_MASK] <= 0:  # none left, though the free block count said enough
                self._corrupt(f"no free extent left for {need} blocks, though "
                              f"{w[H_FREE_BLOCKS] + need} were counted free")  # fmt: skip
            s = w[H_CLASSES + w[H_MASK].bit_length() - 1]
            c = self._fl_remove(s)
            take = min(c, need)
            if c > take:
                self._fl_insert(s + take, c - take)
            extents.append(Extent(s, take))
            need -= take
        extents.sort()
        return extents

    def _largest_free_extent(self) -> int:
        """Blocks of the longest free extent (lock held): the top class's longest."""
        w, i = self._w, self._i
        largest = 0
        if w[H_MASK] > 0:
            r, hops = w[H_CLASSES + w[H_MASK].bit_length() - 1], 0
            while r >= 0:
                if r >= self._nblocks or hops >= self._nblocks:  # past the blocks, or a cycle
                    self._corrupt(f"the longest free extents reach block {r} after {hops}")
                largest = max(largest, i[self._fs + r])
                r = i[self._fn + r]
                hops += 1
        return largest


class AllocatorView:
    """The part of :class:`BlockAllocator` callers read (``catalog.allocator.*``)."""

    def __init__(self, catalog: CatalogState) -> None:
        self._c = catalog
        self.num_blocks = catalog.layout.num_blocks
        self.block_bytes = catalog.layout.block_bytes

    @property
    def free_blocks(self) -> int:
        return self._c._w[H_FREE_BLOCKS]

    @property
    def largest_free_extent(self) -> int:
        return self._c.stats().largest_free_extent

    @property
    def ready_blocks(self) -> int:
        """The catalog's ready watermark: blocks below it may be handed out."""
        return self._c._w[H_READY_BLOCKS]

    def add_ready(self, ready_blocks: int) -> int:
        return self._c.add_ready(ready_blocks)

    def blocks_for(self, nbytes: int) -> int:
        return self._c._blocks_for(nbytes)

    def check(self) -> None:
        self._c.check()
