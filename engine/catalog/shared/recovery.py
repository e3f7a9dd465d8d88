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

Verification of a warm start (a persistent arena reopened by nobody else: its
bytes may have changed while no process held it): :meth:`Recovery.begin_verify`
runs the structure recovery above and marks every READY item saved with a
CRC-32 UNVERIFIED (slot word ``S_VERIFY``; no item byte read), before any
other process can open the arena. From then on, in every process, an
UNVERIFIED item is a miss for lookup and pin; it stays in the LRU and may be
evicted like any other. Its check reads the bytes *without* the lock and
applies the result under it only if the slot still holds the same
reservation (generation) still UNVERIFIED: VERIFIED (served from then on),
or dropped (a pinned one: FAILED, never served, evicted once unpinned).
Slices of items are taken from a shared cursor (``H_VERIFY_CURSOR``) by
every process that opened the arena while items are left (a thread each,
:mod:`.background_verify`); a lookup of an UNVERIFIED item checks it at once
(:meth:`verify_now`). A verifier that dies leaves its slice UNVERIFIED: the
cursor starts over while items are left, so the others (or the next opener)
check it. The marks are the truth; the counts left (``H_VERIFY_LEFT``,
``H_VERIFY_LEFT_BYTES``) are derived (recovery recounts them).

Ownership: a WRITING item belongs to the process that reserved it and a pin to
the process that took it, each recorded as (pid, start time); when that
process is gone (checked at recovery, at open, and when space runs out) the
reservation is aborted and the pin dropped (:meth:`Recovery._reap`).
"""

from __future__ import annotations

import logging
import mmap
import time
import zlib
from dataclasses import dataclass

import numpy as np

from ...base.errors import CatalogError, InvalidSizeError
from ...base.items import item_crc32
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
    H_VERIFY_BYTES,
    H_VERIFY_CURSOR,
    H_VERIFY_DROPPED,
    H_VERIFY_ITEMS,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    H_VERIFY_T0,
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
    S_GEN,
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

VERIFY_SLICE_BYTES = 16 << 20  # items' bytes one verify_step checks (a few ms of CRC-32)
_SCAN_SLOTS = 1 << 16  # slots one verify_step looks at, at most (under the lock, numpy)


@dataclass(frozen=True)
class Verification:
    """Where a warm start's verification stands, host-wide (header words, read
    without the lock: a consistent enough view for progress)."""

    items: int  # items the warm start marked UNVERIFIED
    nbytes: int  # and their bytes
    items_left: int  # still UNVERIFIED (misses until checked)
    bytes_left: int
    dropped: int  # found with a wrong CRC-32 and dropped
    started_ns: int  # time.time_ns() of the warm start (0: never)

    @property
    def fraction(self) -> float:
        """Share of the marked bytes checked (or evicted) so far; 1.0 if none were."""
        return 1.0 if self.nbytes <= 0 else min(1.0, max(0.0, 1 - self.bytes_left / self.nbytes))


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

    def verify(self, data) -> int:
        """Validate the catalog against the arena's bytes before use (warm restart of
        a persistent arena); returns how many items were dropped.

        Rebuilds every derived structure from the slot table first (as
        :meth:`recover`: slots that do not parse are freed, reservations and pins
        of dead processes released), then recomputes the CRC-32 of every READY
        item that has one recorded (``commit(checksum=)``) and drops those that
        differ. A mismatching item pinned by a live process is left (and logged):
        it is being read. Items without a CRC cannot be checked (counted in the
        log line). Holds the lock throughout: about one read of every checked byte
        (a warm start uses :meth:`begin_verify` and :meth:`verify_step` instead).
        Every item is verified afterwards (no UNVERIFIED mark is left).

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
                w[b + S_VERIFY] = VERIFIED
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
            w[H_VERIFY_LEFT] = w[H_VERIFY_LEFT_BYTES] = 0
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

    def begin_verify(self) -> tuple[int, int, int]:
        """A warm start's structure recovery, before anything is served: rebuild every
        derived structure from the slot table (as :meth:`recover`), then mark every
        READY item saved with a CRC-32 UNVERIFIED (a miss until :meth:`verify_step`
        or a lookup checks it). Reads no item byte: O(items) words, vectorised.

        Call it only while no other process has the arena open (``Arena.open_shared``'s
        ``on_warm_start``): no catalog object may have seen these items READY.
        Returns (items marked, their bytes, READY items without a CRC, served as they are).
        """
        self._lock()
        try:
            self._recover()
            w = self._w
            w[H_DIRTY] = self._pid
            slots = self._slot_table()
            ready = slots[:, S_STATE] == READY
            marked = ready & (slots[:, S_CRC] >= 0)
            slots[:, S_VERIFY] = np.where(marked, UNVERIFIED, VERIFIED)
            items, nbytes = int(marked.sum()), int(slots[marked, S_NBYTES].sum())
            unchecked = int(ready.sum()) - items
            del slots, ready, marked
            w[H_VERIFY_LEFT] = w[H_VERIFY_ITEMS] = items
            w[H_VERIFY_LEFT_BYTES] = w[H_VERIFY_BYTES] = nbytes
            w[H_VERIFY_DROPPED] = w[H_VERIFY_CURSOR] = 0
            w[H_VERIFY_T0] = time.time_ns()
            w[H_DIRTY] = 0
        finally:
            self._unlock()
        return items, nbytes, unchecked

    def verification(self) -> Verification:
        """Where the last warm start's verification stands (no lock taken)."""
        w = self._w
        return Verification(w[H_VERIFY_ITEMS], w[H_VERIFY_BYTES], w[H_VERIFY_LEFT],
                            w[H_VERIFY_LEFT_BYTES], w[H_VERIFY_DROPPED],
                            w[H_VERIFY_T0])  # fmt: skip

    def verify_step(self, max_bytes: int = VERIFY_SLICE_BYTES) -> tuple[int, int]:
        """Check the next slice of UNVERIFIED items, up to ``max_bytes`` of them from
        the shared cursor: the lock is taken twice, briefly (to take the slice, to
        apply the results); the bytes are read between. Returns (items checked by this
        call, items left host-wide). Needs a catalog opened with ``for_arena``."""
        if not self._w[H_VERIFY_LEFT]:  # the usual case, lock-free: it only goes down
            return 0, 0
        self._data_view()  # raises without the arena's data area
        self._enter(update=False)  # the cursor is a hint: no dirty mark needed
        try:
            pending = self._take_slice(max_bytes)
        finally:
            self._exit()
        fault("verify:taken")  # a verifier dying here leaves its slice to the others
        done = self.verify_now(pending)
        return done, self._w[H_VERIFY_LEFT]

    def verify_now(self, pending: list[tuple]) -> int:
        """Check items that :meth:`_pending` described (under the lock): CRC-32 of
        their bytes without the lock, then, under it, each slot that still holds the
        same reservation UNVERIFIED becomes VERIFIED, or is dropped (a pinned one:
        FAILED). Returns how many this call settled."""
        if not pending:
            return 0
        data, bb = self._data_view(), self.layout.block_bytes
        sums = [item_crc32(data, extents, bb, nbytes) for _, _, extents, nbytes, _ in pending]
        settled, bad = 0, []
        w = self._enter()
        try:
            sl, mk = self._sl, self._mkey
            for (s, gen, _, nbytes, want), got in zip(pending, sums, strict=True):
                b = sl + s * SLOT_WORDS
                same = w[b + S_GEN] == gen and w[b + S_STATE] == READY
                if not same or w[b + S_VERIFY] != UNVERIFIED:
                    continue  # evicted, or settled by another verifier meanwhile
                settled += 1
                w[H_VERIFY_LEFT] -= 1
                w[H_VERIFY_LEFT_BYTES] -= nbytes
                if got == want:
                    w[b + S_VERIFY] = VERIFIED
                    continue
                w[b + S_VERIFY] = FAILED  # never served, whatever follows
                key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]]).decode(errors="replace")
                pinned = bool(w[b + S_PINS])
                if not pinned:
                    self._drop(s, evicted=False)
                    w[H_VERIFY_DROPPED] += 1
                bad.append((key, pinned))
            left, t0, dropped = w[H_VERIFY_LEFT], w[H_VERIFY_T0], w[H_VERIFY_DROPPED]
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        for key, pinned in bad:
            if pinned:
                log.error("catalog %s: item %r fails its CRC-32 and is pinned: never served, "
                          "evicted once unpinned", self.path, key)  # fmt: skip
            else:
                log.warning("catalog %s: item %r fails its CRC-32; dropped", self.path, key)
        if settled and not left:
            log.info("catalog %s: every item verified, %.3f s after the warm start; %d "
                     "dropped", self.path, (time.time_ns() - t0) / 1e9, dropped)  # fmt: skip
        return settled

    def _take_slice(self, max_bytes: int) -> list[tuple]:
        """The next UNVERIFIED items from the shared cursor, up to ``max_bytes`` (lock
        held); past the last slot the cursor starts over (slices of dead verifiers)."""
        w, n = self._w, self.layout.max_items
        cursor = w[H_VERIFY_CURSOR]
        if not 0 <= cursor < n:
            cursor = 0
        end = min(n, cursor + _SCAN_SLOTS)
        window = self._slot_table()[cursor:end]
        found = np.flatnonzero(
            (window[:, S_VERIFY] == UNVERIFIED) & (window[:, S_STATE] == READY)
        ).tolist()
        del window
        pending, total = [], 0
        for j in found:
            item = self._pending(cursor + j)
            pending.append(item)
            total += item[3]
            if total >= max_bytes:
                end = cursor + j + 1
                break
        w[H_VERIFY_CURSOR] = end
        return pending

    def _pending(self, s: int) -> tuple:
        """(slot, generation, extents, nbytes, CRC) of READY slot ``s`` (lock held)."""
        w, i, b = self._w, self._i, self._sl + s * SLOT_WORDS
        extents, e, hops = [], w[b + S_EXT], w[b + S_BLOCKS]
        while e >= 0 and len(extents) < hops:
            extents.append((e, i[self._ec + e]))
            e = i[self._en + e]
        return s, w[b + S_GEN], extents, w[b + S_NBYTES], w[b + S_CRC]

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

    def _data_view(self) -> mmap.mmap:
        """The arena's data area, mapped read-only on first use."""
        if self._data_mm is None:
            if self._data_at is None:
                raise InvalidSizeError(
                    f"catalog {self.path}: verifying items needs the arena's data area; "
                    "open the catalog with SharedCatalog.for_arena(arena)"
                )
            at, size = self._data_at
            self._data_mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ,
                                      offset=at)  # fmt: skip
        return self._data_mm

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
        for s in self._slots_where(lambda t: t[:, S_STATE] != FREE):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
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
