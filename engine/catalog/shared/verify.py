"""Verifying a warm-started shared catalog against the arena's bytes (a part of
:class:`~.catalog.SharedCatalog`, see :mod:`.state`).

Verification of a warm start (a persistent arena reopened by nobody else: its
bytes may have changed while no process held it): :meth:`Verify.begin_verify`
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
:mod:`...background_verify`); a lookup of an UNVERIFIED item checks it at once
(:meth:`verify_now`). A verifier that dies leaves its slice UNVERIFIED: the
cursor starts over while items are left, so the others (or the next opener)
check it. The marks are the truth; the counts left (``H_VERIFY_LEFT``,
``H_VERIFY_LEFT_BYTES``) are derived (recovery recounts them).
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass

import numpy as np

from ...base.errors import CatalogError, InvalidSizeError
from ...base.items import item_crc32
from .fault_points import fault
from .format import (
    FAILED,
    H_DIRTY,
    H_VERIFY_BYTES,
    H_VERIFY_CURSOR,
    H_VERIFY_DROPPED,
    H_VERIFY_ITEMS,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    H_VERIFY_T0,
    READY,
    S_CRC,
    S_EXT,
    S_GEN,
    S_KLEN,
    S_NBYTES,
    S_PINS,
    S_STATE,
    S_VERIFY,
    SLOT_WORDS,
    UNVERIFIED,
    VERIFIED,
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


class Verify(CatalogState):
    """A warm start's verification: marking items UNVERIFIED, checking them in slices
    or at once, and the synchronous :meth:`verify` (a mixin of ``SharedCatalog``)."""

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
        w, b = self._w, self._sl + s * SLOT_WORDS
        extents = self._extent_chain(s, b)  # bounded and checked: a corrupt chain raises
        return s, w[b + S_GEN], extents, w[b + S_NBYTES], w[b + S_CRC]

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
