"""Crash recovery of the shared catalog: rebuilding from the slot table, reaping the
dead (a warm start's verification against the arena's bytes: :mod:`.verify`).

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
import zlib

import numpy as np

from ...base.liveness import alive
from ..allocator import blocks_for
from .fault_points import fault
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
    H_RECOVERIES,
    H_SLOT_FREE,
    H_TICK,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    NUM_CLASSES,
    P_COUNT,
    P_NEXT,
    P_PID,
    P_SLOT,
    P_START,
    PIN_WORDS,
    READY,
    S_BLOCKS,
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
    S_VERIFY,
    SLOT_WORDS,
    UNVERIFIED,
    VERIFIED,
    WRITING,
)
from .state import CatalogState

# the catalog's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.catalog.shared.catalog")
_MARKS = (VERIFIED, UNVERIFIED, FAILED)  # a READY slot's S_VERIFY; any other does not parse


def _chain(rows: np.ndarray, members: np.ndarray, link: int, zero: int | None = None) -> None:
    """Link ``rows[members]`` into a list in ascending order through word ``link`` (the
    last one -1), zeroing word ``zero`` of each."""
    if zero is not None:
        rows[members, zero] = 0
    nxt = np.full(len(members), -1, dtype=np.int64)
    nxt[:-1] = members[1:]
    rows[members, link] = nxt


def _head(members: np.ndarray) -> int:
    return int(members[0]) if len(members) else -1


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

    # numpy passes over the region (no view outlives its call: a live one would keep
    # close() from unmapping, also from a traceback that holds the caller's frame).

    def _slots_where(self, predicate) -> list[int]:
        """The slots whose row of the slot table satisfies ``predicate`` (vectorised)."""
        table = self._slot_table()
        found = np.flatnonzero(predicate(table)).tolist()
        del table
        return found

    def _pin_records_counted(self) -> list[int]:
        """Pin records with a count (candidates to keep), ascending."""
        lay = self.layout
        records = np.frombuffer(self._mapping(), dtype=np.int64, count=lay.max_pins * PIN_WORDS,
                                offset=lay.pins_at).reshape(lay.max_pins, PIN_WORDS)  # fmt: skip
        found = np.flatnonzero(records[:, P_COUNT] > 0).tolist()
        del records
        return found

    def _free_pin_records(self, free: np.ndarray) -> None:
        """Zero pin records ``free`` (ascending) and make them the free list, in that order
        (what pushing them in descending order made)."""
        lay, w = self.layout, self._w
        records = np.frombuffer(self._mapping(), dtype=np.int64, count=lay.max_pins * PIN_WORDS,
                                offset=lay.pins_at).reshape(lay.max_pins, PIN_WORDS)  # fmt: skip
        w[H_PIN_FREE] = -1
        _chain(records, free, P_NEXT, zero=P_COUNT)
        del records
        w[H_PIN_FREE] = _head(free)

    def _reset_slot_lists(self) -> list[int]:
        """Empty the hash buckets, clear marks of slots that are not READY, chain the FREE
        slots into the free list (ascending); the slots in use, ascending."""
        lay, w = self.layout, self._w
        buckets = np.frombuffer(self._mapping(), dtype=np.int64, count=lay.buckets,
                                offset=lay.buckets_at)  # fmt: skip
        buckets[:] = -1
        table = self._slot_table()
        state = table[:, S_STATE]
        stale = np.flatnonzero((table[:, S_VERIFY] != VERIFIED) & (state != READY))
        table[stale, S_VERIFY] = VERIFIED  # a mark is a READY item's only
        free = np.flatnonzero(state == FREE)
        w[H_SLOT_FREE] = -1
        _chain(table, free, S_HNEXT)
        in_use = np.flatnonzero(state != FREE).tolist()
        del table, state
        w[H_SLOT_FREE] = _head(free)
        return in_use

    def _slot_table(self) -> np.ndarray:
        """The slot table as a (max_items, SLOT_WORDS) int64 array over the region."""
        lay = self.layout
        return np.frombuffer(self._mapping(), dtype=np.int64, count=lay.max_items * SLOT_WORDS,
                             offset=lay.slots_at).reshape(lay.max_items, SLOT_WORDS)  # fmt: skip

    def _reap(self) -> int:
        """Abort WRITING items and drop pins of dead processes (lock held, dirty set)."""
        w, sl, pn = self._w, self._sl, self._pn
        seen: dict = {}
        n = 0
        todo = self._slots_where(  # the slots that may need it, in one numpy pass
            lambda t: (t[:, S_STATE] == WRITING) | ((t[:, S_STATE] == READY) & (t[:, S_PINS] != 0))
        )
        for s in todo:
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == WRITING and not alive(w[b + S_PID], w[b + S_START], seen):
                self._drop(s, evicted=False)
                n += 1
            elif state == READY and w[b + S_PINS]:
                # the whole list checked before a record is unlinked: an unlinked record
                # goes onto the free list, so a cycle through it would lead the walk there
                records, r = [], w[b + S_PIN_HEAD]
                while r >= 0:
                    if r >= self._npins or len(records) >= self._npins:
                        self._bad_pin_list(s, r, len(records))
                    records.append(r)
                    r = w[pn + r * PIN_WORDS + P_NEXT]
                for r in records:
                    p = pn + r * PIN_WORDS
                    if not alive(w[p + P_PID], w[p + P_START], seen):
                        count = w[p + P_COUNT]
                        w[p + P_COUNT] = 0
                        w[b + S_PINS] -= count
                        self._unlink_pin(s, r)
                        if w[b + S_PINS] == 0:
                            w[H_EVICTABLE] += w[b + S_BLOCKS]
                        n += 1
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
        for s in self._slots_where(lambda t: t[:, S_STATE] != FREE):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            ok = state in (WRITING, READY) and 0 < w[b + S_KLEN] <= mk
            ok = ok and (state == READY or alive(w[b + S_PID], w[b + S_START], seen))
            ok = ok and (state != READY or w[b + S_VERIFY] in _MARKS)  # WRITING: reset below
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
        kept = np.zeros(lay.max_pins, dtype=bool)
        for r in self._pin_records_counted()[::-1]:
            p = pn + r * PIN_WORDS
            s = w[p + P_SLOT]
            if (
                0 <= s < lay.max_items
                and w[sl + s * SLOT_WORDS + S_STATE] == READY
                and alive(w[p + P_PID], w[p + P_START], seen)
            ):
                pins.setdefault(s, []).append(r)
                kept[r] = True
        self._free_pin_records(np.flatnonzero(~kept))
        # Slots: free list, hash chains, pins, counters.
        in_use = self._reset_slot_lists()[::-1]
        items = ready_items = ready_bytes = evictable = left = left_bytes = 0
        for s in in_use:  # descending: each bucket's chain ends up in ascending slot order
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
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
                if w[b + S_VERIFY] == UNVERIFIED:
                    left += 1
                    left_bytes += w[b + S_NBYTES]
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
        w[H_VERIFY_LEFT], w[H_VERIFY_LEFT_BYTES] = left, left_bytes
        if ready:
            w[H_TICK] = max(w[H_TICK], max(t for t, _ in ready))
        w[H_RECOVERIES] += 1
        fault("recover:done")
        w[H_DIRTY] = 0
