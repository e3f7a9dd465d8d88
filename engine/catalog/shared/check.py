"""Invariant checks of the shared catalog (tests, the soak, ``bench_alloc``).

:meth:`Check.check` asserts every invariant of the region under the lock:
the slot table parses; every owned block lies below the ready watermark and
belongs to one item; pin records sum to the slots' pins; the LRU list holds
every READY slot once, linked both ways; the free extents are disjoint from
owned blocks and from each other, never adjacent, in their right size class;
no block is lost; the free lists of slots and pin records are whole.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..allocator import blocks_for
from .format import (
    FAILED,
    FREE,
    H_CLASSES,
    H_DIRTY,
    H_EVICTABLE,
    H_FREE_BLOCKS,
    H_ITEMS,
    H_LRU_HEAD,
    H_LRU_TAIL,
    H_MASK,
    H_PIN_FREE,
    H_READY_BLOCKS,
    H_READY_BYTES,
    H_READY_ITEMS,
    H_SLOT_FREE,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    NUM_CLASSES,
    P_COUNT,
    P_NEXT,
    P_SLOT,
    PIN_WORDS,
    READY,
    S_BLOCKS,
    S_EXT,
    S_HASH,
    S_HNEXT,
    S_KLEN,
    S_NBYTES,
    S_NEXT,
    S_PIN_HEAD,
    S_PINS,
    S_PREV,
    S_STATE,
    S_VERIFY,
    SLOT_WORDS,
    UNVERIFIED,
    VERIFIED,
    WRITING,
)
from .state import CatalogState


class Check(CatalogState):
    """check (a mixin of the shared catalog)."""

    def check(self) -> None:
        """Assert every invariant of the shared structures (used by tests)."""
        self._lock()
        try:
            self._check()
        finally:
            self._unlock()

    def _check(self) -> None:
        w, lay, sl, pn, i = self._w, self.layout, self._sl, self._pn, self._i
        n, mk = lay.num_blocks, self._mkey
        assert w[H_DIRTY] == 0, "catalog left dirty"
        wm = w[H_READY_BLOCKS]
        assert 0 <= wm <= n, f"ready watermark {wm} outside [0, {n}]"
        owner = np.full(n, -1, dtype=np.int64)
        items = ready_items = ready_bytes = evictable = left = left_bytes = 0
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            assert state in (FREE, WRITING, READY), f"slot {s}: state {state}"
            if state == FREE:
                continue
            items += 1
            key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]])
            assert zlib.crc32(key) == w[b + S_HASH] and self._find(key, w[b + S_HASH]) == s
            total, e = 0, w[b + S_EXT]
            while e >= 0:
                c = i[self._ec + e]
                assert c > 0 and e + c <= wm, f"slot {s}: bad extent ({e}, {c}), ready {wm}"
                assert (owner[e : e + c] < 0).all(), f"block owned twice ({key!r})"
                owner[e : e + c] = s
                total += c
                e = i[self._en + e]
            assert total == w[b + S_BLOCKS] == blocks_for(w[b + S_NBYTES], lay.block_bytes)
            pins, r, hops = 0, w[b + S_PIN_HEAD], 0
            while r >= 0:
                assert r < lay.max_pins and hops < lay.max_pins, f"slot {s}: pin list at {r}"
                hops += 1
                p = pn + r * PIN_WORDS
                assert w[p + P_SLOT] == s and w[p + P_COUNT] > 0
                pins += w[p + P_COUNT]
                r = w[p + P_NEXT]
            assert pins == w[b + S_PINS] and (pins == 0 or state == READY)
            mark = w[b + S_VERIFY]
            ok = mark in (VERIFIED, UNVERIFIED, FAILED) and (mark == VERIFIED or state == READY)
            assert ok, f"slot {s}: verification mark {mark} in state {state}"
            if mark == UNVERIFIED:
                left += 1
                left_bytes += w[b + S_NBYTES]
            if state == READY:
                ready_items += 1
                ready_bytes += w[b + S_NBYTES]
                evictable += 0 if pins else total
        assert (items, ready_items, ready_bytes, evictable) == (
            w[H_ITEMS], w[H_READY_ITEMS], w[H_READY_BYTES], w[H_EVICTABLE])  # fmt: skip
        assert (left, left_bytes) == (w[H_VERIFY_LEFT], w[H_VERIFY_LEFT_BYTES]), (
            "unverified item count is off")  # fmt: skip
        # LRU: every READY slot once, links both ways.
        seen, prev, s = 0, -1, w[H_LRU_HEAD]
        while s >= 0:
            assert s < lay.max_items, f"LRU list reaches slot {s}"
            b = sl + s * SLOT_WORDS
            assert w[b + S_STATE] == READY and w[b + S_PREV] == prev
            seen += 1
            assert seen <= ready_items, "LRU list has a cycle"
            prev, s = s, w[b + S_NEXT]
        assert prev == w[H_LRU_TAIL] and seen == ready_items
        # Free extents: disjoint from owned blocks and each other, never adjacent.
        free = np.zeros(n, dtype=bool)
        starts = []
        for k in range(NUM_CLASSES):
            s, prev = w[H_CLASSES + k], -1
            assert bool(w[H_MASK] >> k & 1) == (s >= 0), f"class {k}: mask bit wrong"
            while s >= 0:
                assert s < n, f"class {k}: free extent at block {s}"
                c = i[self._fs + s]
                assert c > 0 and c.bit_length() - 1 == k and i[self._fe + s + c - 1] == s
                assert i[self._fp + s] == prev
                assert s + c <= wm, f"free extent ({s}, {c}) beyond the ready watermark {wm}"
                assert not free[s : s + c].any() and (owner[s : s + c] < 0).all()
                free[s : s + c] = True
                starts.append((s, c))
                prev, s = s, i[self._fn + s]
        starts.sort()
        for (s0, c0), (s1, _) in zip(starts, starts[1:], strict=False):
            assert s0 + c0 < s1, f"free extents ({s0}, {c0}) and ({s1}, ...) touch"
        assert int(free.sum()) == w[H_FREE_BLOCKS], "free block count is off"
        assert ((owner[:wm] >= 0) | free[:wm]).all(), "a block is lost (neither owned nor free)"
        assert not ((owner[wm:] >= 0) | free[wm:]).any(), "a block beyond the watermark is used"
        # Free lists of slots and pin records.
        cnt, s = 0, w[H_SLOT_FREE]
        while s >= 0:
            assert s < lay.max_items, f"slot free list reaches slot {s}"
            assert w[sl + s * SLOT_WORDS + S_STATE] == FREE
            cnt += 1
            assert cnt <= lay.max_items, "slot free list has a cycle"
            s = w[sl + s * SLOT_WORDS + S_HNEXT]
        assert cnt == lay.max_items - items
        free_pins, r = 0, w[H_PIN_FREE]
        while r >= 0:  # a pin takes a free record's count as 0
            assert r < lay.max_pins, f"pin free list reaches record {r}"
            assert w[pn + r * PIN_WORDS + P_COUNT] == 0, f"free pin record {r} has a count"
            free_pins += 1
            assert free_pins <= lay.max_pins, "pin free list has a cycle"
            r = w[pn + r * PIN_WORDS + P_NEXT]
