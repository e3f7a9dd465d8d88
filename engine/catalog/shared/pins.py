"""Pins of the shared catalog: who protects a READY item from eviction, and how often.

A pin belongs to the process that took it: one pin record per pinned
(item, process) holds the owner (pid, start time) and a count (pins nest);
an item's records form a list from its slot (``S_PIN_HEAD``), free records
another from the header. The slot's ``S_PINS`` is the sum of its records'
counts; an item is evictable while it is 0. Records of a process that is gone
are dropped (``_reap``, recovery).
"""

from __future__ import annotations

from ...base.errors import CatalogCapacityError, CatalogError, ItemStateError
from ..catalog import ItemState
from . import fault_points
from .format import (
    H_EVICTABLE,
    H_PIN_FREE,
    P_COUNT,
    P_NEXT,
    P_PID,
    P_SLOT,
    P_START,
    PIN_WORDS,
    READY,
    S_BLOCKS,
    S_GEN,
    S_PIN_HEAD,
    S_PINS,
    S_STATE,
    SLOT_WORDS,
    SharedEntry,
)
from .state import CatalogState


class Pins(CatalogState):
    """pin / unpin and their batches (a mixin of the shared catalog)."""

    def pin(self, key: str) -> SharedEntry:
        """Protect a READY item from eviction (e.g. while it is being loaded); nests.

        The pin belongs to this process: dropped if it dies before unpinning.
        """
        fast = self._fast
        if fast is not None:  # C: a seen READY entry, mutex free, catalog clean (else 0)
            got = fast.pin(key)
            if got.__class__ is not int:  # the entry (isinstance costs more than the check)
                return got  # pyright: ignore[reportReturnType]  (not an int: the entry)
            if got:  # a dead holder's mutex (released for the Python way), or raises
                self._native_lock(got)  # pyright: ignore[reportArgumentType]  (an int here)
        w = self._enter()
        try:
            s = -1
            entry = self._seen.get(key)
            if entry is not None:  # seen READY: still the same reservation, still READY?
                s = entry.slot
                b = self._sl + s * SLOT_WORDS
                if (
                    entry.state is not ItemState.READY
                    or w[b + S_GEN] != entry.generation
                    or (w[b + S_STATE] != READY)
                ):
                    entry = None
            if entry is None:
                s = self._expect(key, READY, "pin")
                entry = self._snapshot(s, key)
            entry.pins = self._pin_slot(s, key)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        return entry

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of this process."""
        fast = self._fast
        if fast is not None:  # C, as for unpin_many
            got = fast.unpin((key,))
            if got is True:
                return
            if got:
                self._native_lock(got)
        w = self._enter()
        try:
            entry = self._seen.get(key)
            s = -1 if entry is None else entry.slot
            b = self._sl + s * SLOT_WORDS
            if entry is None or w[b + S_GEN] != entry.generation or w[b + S_STATE] != READY:
                s = self._expect(key, READY, "unpin")
            pn, pid, start, records = self._pn, self._pid, self._start, self._npins
            r, hops = w[self._sl + s * SLOT_WORDS + S_PIN_HEAD], 0
            while r >= 0:  # this process's record (_my_pin, inlined: the hot path)
                if r >= records or hops >= records:
                    self._bad_pin_list(s, r, hops)
                p = pn + r * PIN_WORDS
                if w[p + P_PID] == pid and w[p + P_START] == start:
                    break
                r = w[p + P_NEXT]
                hops += 1
            if r < 0:
                raise self._not_pinned(key, s, 0)
            self._unpin_slot(s, r)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()

    def pin_many(self, keys: list[str]) -> list[SharedEntry]:
        """:meth:`pin` every key under one lock: all of them, or none (and the error)."""
        self._enter()
        done: list[int] = []
        try:
            slots = [self._expect(key, READY, "pin") for key in keys]
            for key, s in zip(keys, slots, strict=True):
                self._pin_slot(s, key)
                done.append(s)
            entries = [self._snapshot(s, key) for key, s in zip(keys, slots, strict=True)]
        except BaseException as exc:
            if isinstance(exc, CatalogError):
                for s in reversed(done):
                    r = self._my_pin(s)  # (after a rebuild too: it keeps live pins)
                    if r >= 0:
                        self._unpin_slot(s, r)
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        return entries

    def unpin_many(self, keys: list[str]) -> None:
        """:meth:`unpin` every key under one lock: all of them, or none (and the error).

        Each distinct item costs one walk of its pin records, however often it is
        listed; a key this object has seen READY is found from its entry (slot and
        generation) without hashing.
        """
        fast = self._fast
        if fast is not None:  # C: every key seen READY, mutex free, catalog clean (else 0)
            got = fast.unpin(keys)
            if got is True:
                return
            if got:  # a dead holder's mutex (released for the Python way), or raises
                self._native_lock(got)
        w = self._enter()
        try:
            sl, seen = self._sl, self._seen
            drops: dict[int, list] = {}  # slot -> [key, pins to drop]
            for key in keys:
                entry = seen.get(key)
                if entry is None:
                    s = self._expect(key, READY, "unpin")
                else:
                    s = entry.slot
                    b = sl + s * SLOT_WORDS
                    if w[b + S_GEN] != entry.generation or w[b + S_STATE] != READY:
                        s = self._expect(key, READY, "unpin")
                todo = drops.get(s)
                if todo is None:
                    drops[s] = [key, 1]
                else:
                    todo[1] += 1
            records = []
            pn = self._pn
            for s, (key, n) in drops.items():  # enough pins of ours for all? (nothing written)
                r = self._my_pin(s)
                count = 0 if r < 0 else w[pn + r * PIN_WORDS + P_COUNT]
                if n > count:
                    raise self._not_pinned(key, s, count)
                records.append((s, r, n))
            for s, r, n in records:
                for _ in range(n):
                    self._unpin_slot(s, r)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()

    def _pin_slot(self, s: int, key: str) -> int:
        """One more pin of READY slot ``s`` by this process (lock held, dirty set); the
        item's pins now."""
        w, b, pn = self._w, self._sl + s * SLOT_WORDS, self._pn
        pid, start, records = self._pid, self._start, self._npins
        head = r = w[b + S_PIN_HEAD]
        p, hops = -1, 0
        while r >= 0:  # this process's record, if it pins the item already
            if r >= records or hops >= records:
                self._bad_pin_list(s, r, hops)
            p = pn + r * PIN_WORDS
            if w[p + P_PID] == pid and w[p + P_START] == start:
                break
            r = w[p + P_NEXT]
            hops += 1
        if r < 0:
            r = w[H_PIN_FREE]
            if r < 0 and self._reap():
                r = w[H_PIN_FREE]
                head = w[b + S_PIN_HEAD]  # the reap unlinked dead processes' records
            if r < 0:
                raise CatalogCapacityError(
                    f"pin({key!r}): all {self.layout.max_pins} pin records are in use; "
                    "create the catalog with a larger max_pins"
                )
            p = pn + r * PIN_WORDS
            if r >= records or w[p + P_COUNT]:  # past the records, or one in use
                self._corrupt(
                    f"the pin free list's head is record {r} of {records}"
                    + ("" if r >= records else f", with a count of {w[p + P_COUNT]}")
                )
            w[H_PIN_FREE] = w[p + P_NEXT]
            w[p + P_SLOT] = s
            w[p + P_PID] = pid
            w[p + P_START] = start
            w[p + P_NEXT] = head
            w[b + S_PIN_HEAD] = r
            if fault_points.hook is not None:
                fault_points.hook("pin:record")
            w[p + P_COUNT] = 1  # a free record's count is 0
        else:
            if fault_points.hook is not None:
                fault_points.hook("pin:record")
            w[p + P_COUNT] += 1
        pins = w[b + S_PINS] + 1
        w[b + S_PINS] = pins
        if pins == 1:
            w[H_EVICTABLE] -= w[b + S_BLOCKS]
        return pins

    def _unpin_slot(self, s: int, r: int) -> None:
        """Drop one pin of pin record ``r`` (this process's) of slot ``s``."""
        w, b = self._w, self._sl + s * SLOT_WORDS
        p = self._pn + r * PIN_WORDS
        count = w[p + P_COUNT] - 1
        w[p + P_COUNT] = count
        if fault_points.hook is not None:
            fault_points.hook("unpin:record")
        pins = w[b + S_PINS] - 1
        w[b + S_PINS] = pins
        if count == 0:
            if w[b + S_PIN_HEAD] == r:  # the usual case: _unlink_pin without the walk
                w[b + S_PIN_HEAD] = w[p + P_NEXT]
                w[p + P_NEXT] = w[H_PIN_FREE]
                w[H_PIN_FREE] = r
            else:
                self._unlink_pin(s, r)
        if pins == 0:
            w[H_EVICTABLE] += w[b + S_BLOCKS]

    def _my_pin(self, s: int) -> int:
        """This process's pin record of slot ``s``, or -1."""
        w, pn, pid, start = self._w, self._pn, self._pid, self._start
        r, hops, records = w[self._sl + s * SLOT_WORDS + S_PIN_HEAD], 0, self._npins
        while r >= 0:
            if r >= records or hops >= records:
                self._bad_pin_list(s, r, hops)
            p = pn + r * PIN_WORDS
            if w[p + P_PID] == pid and w[p + P_START] == start:
                return r
            r = w[p + P_NEXT]
            hops += 1
        return -1

    def _bad_pin_list(self, s: int, r: int, hops: int) -> None:
        self._corrupt(f"slot {s}'s pin list reaches record {r} after {hops} records "
                      f"(records: {self._npins})")  # fmt: skip

    def _unlink_pin(self, s: int, r: int) -> None:
        w, pn = self._w, self._pn
        head = self._sl + s * SLOT_WORDS + S_PIN_HEAD
        prev, cur, hops = -1, w[head], 0
        while cur != r:
            if not 0 <= cur < self._npins or hops >= self._npins:  # r is not on it
                self._bad_pin_list(s, cur, hops)
            prev, cur = cur, w[pn + cur * PIN_WORDS + P_NEXT]
            hops += 1
        nxt = w[pn + r * PIN_WORDS + P_NEXT]
        if prev < 0:
            w[head] = nxt
        else:
            w[pn + prev * PIN_WORDS + P_NEXT] = nxt
        w[pn + r * PIN_WORDS + P_NEXT] = w[H_PIN_FREE]
        w[H_PIN_FREE] = r

    def _not_pinned(self, key: str, s: int, mine: int) -> ItemStateError:
        others = self._w[self._sl + s * SLOT_WORDS + S_PINS] - mine
        return ItemStateError(
            f"unpin({key!r}): the item is not pinned"
            + (f" by this process (others hold {others} pin(s))" if others else "")
            + "; every unpin must match one pin"
        )
