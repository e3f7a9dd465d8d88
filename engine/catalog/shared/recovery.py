"""Crash recovery of the shared catalog: rebuilding from the slot table, reaping the
dead, verifying a warm-started catalog against the arena's bytes.

Crash consistency: the *slot table* is the truth; the hash table, LRU list,
free lists, free-extent structure, per-slot pin lists and counters are derived.
Every update runs with the header's ``dirty`` word set to the updater's pid and
writes a slot's fields before its state word (a slot becomes WRITING only once
its extents and key are in place; it becomes READY only once its CRC is in
place; a victim is marked free before its blocks are handed out). A locker
that finds ``dirty`` set (its holder died inside an update) rebuilds every
derived structure from the slot table (:meth:`Recovery._recover`), so a
SIGKILL at any point leaves no block owned twice, no block lost and no
half-written item visible.

Ownership: a WRITING item belongs to the process that reserved it and a pin to
the process that took it, each recorded as (pid, start time); when that
process is gone (checked at recovery, at open, and when space runs out) the
reservation is aborted and the pin dropped (:meth:`Recovery._reap`).
"""

from __future__ import annotations

import logging
import time
import zlib

import numpy as np

from ...base.errors import InvalidSizeError
from ...base.items import item_crc32
from ...base.liveness import alive
from ..allocator import blocks_for
from .fault_points import fault
from .format import (
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
    H_RECOVERIES,
    H_SLOT_FREE,
    H_TICK,
    NUM_CLASSES,
    P_COUNT,
    P_NEXT,
    P_PID,
    P_SLOT,
    P_START,
    PIN_WORDS,
    READY,
    S_BLOCKS,
    S_CRC,
    S_EXT,
    S_HASH,
    S_HNEXT,
    S_KLEN,
    S_NBYTES,
    S_PID,
    S_PIN_HEAD,
    S_PINS,
    S_START,
    S_STATE,
    S_TICK,
    SLOT_WORDS,
    WRITING,
)
from .state import CatalogState

# the catalog's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.catalog.shared.catalog")


class Recovery(CatalogState):
    """reap / recover / verify (a mixin of the shared catalog)."""

    def reap(self) -> int:
        """Abort reservations and drop pins of processes that are gone; how many."""
        self._enter()
        try:
            n = self._reap()
        except BaseException:
            self._exit(False)
            raise
        self._exit()
        return n

    def recover(self) -> None:
        """Rebuild every derived structure from the slot table (what a locker does
        on its own when it finds the catalog dirty)."""
        self._lock()
        try:
            self._recover()
        finally:
            self._unlock()

    def verify(self, data) -> int:
        """Validate the catalog against the arena's bytes before use (warm restart of
        a persistent arena); returns how many items were dropped.

        Rebuilds every derived structure from the slot table first (as
        :meth:`recover`: slots that do not parse are freed, reservations and pins
        of dead processes released), then recomputes the CRC-32 of every READY
        item that has one recorded (``commit(checksum=)``) and drops those that
        differ. A mismatching item pinned by a live process is left (and logged):
        it is being read. Items without a CRC cannot be checked (counted in the
        log line). Holds the lock throughout: about one read of every checked byte.

        Args:
            data: the arena's data area as a buffer (``arena.host.numpy()``, or a
                memoryview), at least ``num_blocks * block_bytes`` bytes.
        """
        view = memoryview(data).cast("B")
        lay = self.layout
        bb = lay.block_bytes
        if view.nbytes < lay.num_blocks * bb:
            raise InvalidSizeError(
                f"verify needs the arena's data area, {lay.num_blocks * bb} bytes "
                f"({lay.num_blocks} blocks of {bb}); got {view.nbytes} bytes"
            )
        t0 = time.monotonic()
        checked = unchecked = dropped = 0
        kept: list[str] = []
        self._lock()
        try:
            self._recover()
            w, i, sl, mk = self._w, self._i, self._sl, self._mkey
            w[H_DIRTY] = self._pid
            for s in range(lay.max_items):
                b = sl + s * SLOT_WORDS
                if w[b + S_STATE] != READY:
                    continue
                want = w[b + S_CRC]
                if want < 0:
                    unchecked += 1
                    continue
                checked += 1
                extents, e = [], w[b + S_EXT]
                while e >= 0:
                    extents.append((e, i[self._ec + e]))
                    e = i[self._en + e]
                if item_crc32(view, extents, bb, w[b + S_NBYTES]) == want:
                    continue
                key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]]).decode(errors="replace")
                if w[b + S_PINS]:
                    kept.append(key)
                    continue
                self._drop(s, evicted=False)
                dropped += 1
                log.warning("catalog %s: item %r fails its CRC-32; dropped", self.path, key)
            w[H_DIRTY] = 0
        finally:
            self._unlock()
        if kept:
            log.error(
                "catalog %s: %d pinned item(s) fail their CRC-32 and stay until unpinned: %s",
                self.path, len(kept), kept[:8],
            )  # fmt: skip
        log.info(
            "catalog %s verified in %.3f s: %d item(s) checked, %d dropped, %d without a CRC",
            self.path, time.monotonic() - t0, checked, dropped, unchecked,
        )  # fmt: skip
        return dropped

    def _reap(self) -> int:
        """Abort WRITING items and drop pins of dead processes (lock held, dirty set)."""
        w, sl, pn = self._w, self._sl, self._pn
        seen: dict = {}
        n = 0
        for s in range(self.layout.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == WRITING and not alive(w[b + S_PID], w[b + S_START], seen):
                self._drop(s, evicted=False)
                n += 1
            elif state == READY and w[b + S_PINS]:
                r, hops = w[b + S_PIN_HEAD], 0
                while r >= 0:
                    if r >= self._npins or hops >= self._npins:
                        self._bad_pin_list(s, r, hops)
                    hops += 1
                    p = pn + r * PIN_WORDS
                    nxt = w[p + P_NEXT]
                    if not alive(w[p + P_PID], w[p + P_START], seen):
                        count = w[p + P_COUNT]
                        w[p + P_COUNT] = 0
                        w[b + S_PINS] -= count
                        self._unlink_pin(s, r)
                        if w[b + S_PINS] == 0:
                            w[H_EVICTABLE] += w[b + S_BLOCKS]
                        n += 1
                    r = nxt
        return n


    def _recover(self) -> None:
        """Rebuild everything derived from the slot table (lock held).

        Idempotent and crash-safe itself: it only frees slots (one state word
        each), zeroes pin records, and rewrites derived structures; dirty stays
        set until it has finished.
        """
        w, lay, sl, pn = self._w, self.layout, self._sl, self._pn
        w[H_DIRTY] = self._pid
        n, mk = lay.num_blocks, self._mkey
        wm = w[H_READY_BLOCKS] = max(0, min(w[H_READY_BLOCKS], n))
        self._seen.clear()
        owner = np.full(n, -1, dtype=np.int64)
        seen: dict = {}
        ready: list[tuple[int, int]] = []
        i = self._i
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == FREE:
                continue
            ok = state in (WRITING, READY) and 0 < w[b + S_KLEN] <= mk
            ok = ok and (state == READY or alive(w[b + S_PID], w[b + S_START], seen))
            total, e, chain, hops = 0, w[b + S_EXT], [], 0
            while ok and e >= 0 and hops <= n:
                c = i[self._ec + e] if e < wm else 0
                if c <= 0 or e + c > wm or (owner[e : e + c] >= 0).any():  # only ready blocks
                    ok = False
                    break
                chain.append((e, c))
                total += c
                e = i[self._en + e]
                hops += 1
            ok = ok and e < 0 and total == w[b + S_BLOCKS] > 0
            ok = ok and total == blocks_for(w[b + S_NBYTES], lay.block_bytes)
            key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]]) if ok else b""
            ok = ok and zlib.crc32(key) == w[b + S_HASH]
            if not ok:
                w[b + S_STATE] = FREE
                continue
            for e, c in chain:
                owner[e : e + c] = s
            if state == READY:
                ready.append((w[b + S_TICK], s))
        fault("recover:slots")
        # Pins: records of live processes on READY slots are kept; the rest freed.
        pins: dict[int, list[int]] = {}
        w[H_PIN_FREE] = -1
        for r in range(lay.max_pins - 1, -1, -1):
            p = pn + r * PIN_WORDS
            s = w[p + P_SLOT]
            keep = (
                w[p + P_COUNT] > 0
                and 0 <= s < lay.max_items
                and w[sl + s * SLOT_WORDS + S_STATE] == READY
                and alive(w[p + P_PID], w[p + P_START], seen)
            )
            if keep:
                pins.setdefault(s, []).append(r)
            else:
                w[p + P_COUNT] = 0
                w[p + P_NEXT] = w[H_PIN_FREE]
                w[H_PIN_FREE] = r
        # Slots: free list, hash chains, pins, counters.
        for bkt in range(lay.buckets):
            w[self._bk + bkt] = -1
        w[H_SLOT_FREE] = -1
        items = ready_items = ready_bytes = evictable = 0
        for s in range(lay.max_items - 1, -1, -1):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == FREE:
                w[b + S_HNEXT] = w[H_SLOT_FREE]
                w[H_SLOT_FREE] = s
                continue
            items += 1
            bucket = self._bk + (w[b + S_HASH] & self._hmask)
            w[b + S_HNEXT] = w[bucket]
            w[bucket] = s
            head, count = -1, 0
            for r in pins.get(s, ()):
                p = pn + r * PIN_WORDS
                w[p + P_NEXT] = head
                head = r
                count += w[p + P_COUNT]
            w[b + S_PIN_HEAD] = head
            w[b + S_PINS] = count
            if state == READY:
                ready_items += 1
                ready_bytes += w[b + S_NBYTES]
                if not count:
                    evictable += w[b + S_BLOCKS]
        # LRU in use order.
        w[H_LRU_HEAD] = w[H_LRU_TAIL] = -1
        for _, s in sorted(ready):
            self._lru_append(s)
        # Free extents: the complement of the owned blocks.
        per_block = np.frombuffer(self._mapping(), dtype=np.int32, count=6 * n,
                                  offset=lay.blocks_at).reshape(6, n)  # fmt: skip
        per_block[2] = 0  # free size at start
        per_block[3] = -1  # free start at end
        per_block[4:] = -1
        del per_block
        for k in range(NUM_CLASSES):
            w[H_CLASSES + k] = -1
        w[H_MASK] = 0
        free = np.concatenate(([False], owner[:wm] < 0, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(free))
        for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
            self._fl_insert(start, end - start)
        w[H_FREE_BLOCKS] = int((owner[:wm] < 0).sum())
        w[H_EVICTABLE] = evictable
        w[H_ITEMS] = items
        w[H_READY_ITEMS] = ready_items
        w[H_READY_BYTES] = ready_bytes
        if ready:
            w[H_TICK] = max(w[H_TICK], max(t for t, _ in ready))
        w[H_RECOVERIES] += 1
        fault("recover:done")
        w[H_DIRTY] = 0
