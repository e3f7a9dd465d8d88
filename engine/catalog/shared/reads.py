"""Reading the shared catalog: finding a key's slot, snapshots of entries, counters.

A key is found through the hash table (CRC-32 of its UTF-8 bytes, chains
through the slots), or faster through this object's own entry of it: an
entry names its slot and generation (unique per reservation), so a key seen
before costs no hashing or key compare. Each catalog object keeps one
:class:`SharedEntry` per item it has seen and refreshes it in place.
"""

from __future__ import annotations

import zlib

from ...base.errors import ItemStateError, UnknownItemError
from ...base.liveness import ProcessId
from ..allocator import Extent, item_blocks
from ..catalog import CatalogStats, ItemState
from .format import (
    FREE,
    H_BYTES_EVICTED,
    H_BYTES_STORED,
    H_EVICTIONS,
    H_FREE_BLOCKS,
    H_HITS,
    H_ITEMS,
    H_LOCK_DEATHS,
    H_MISSES,
    H_READY_BLOCKS,
    H_READY_BYTES,
    H_READY_ITEMS,
    H_RECOVERIES,
    H_RESERVE_FAILURES,
    H_STORED,
    H_VERIFY_BYTES,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    MAX_DIMS,
    READY,
    S_BLOCKS,
    S_CRC,
    S_DIMS,
    S_DTYPE,
    S_EXT,
    S_GEN,
    S_HASH,
    S_HNEXT,
    S_KLEN,
    S_NBYTES,
    S_NDIM,
    S_PID,
    S_PINS,
    S_START,
    S_STATE,
    S_VERIFY,
    SLOT_WORDS,
    STATE,
    SharedEntry,
)
from .state import CatalogState

_WRITING, _READY, _UNVERIFIED = ItemState.WRITING, ItemState.READY, ItemState.UNVERIFIED


class Reads(CatalogState):
    """Lookups without side effects, snapshots and counters (a mixin)."""

    def __len__(self) -> int:
        return self._w[H_ITEMS]

    def __contains__(self, key: str) -> bool:
        """True for READY items; does not count as a lookup or touch the LRU order."""
        return self.state(key) is ItemState.READY

    @property
    def recoveries(self) -> int:
        """How many times a locker found the catalog dirty and rebuilt it."""
        return self._w[H_RECOVERIES]

    @property
    def lock_deaths(self) -> int:
        """How many times a locker took the lock over from a holder that had died."""
        return self._w[H_LOCK_DEATHS]

    def _blocks_for(self, nbytes: int) -> int:
        lay = self.layout
        return item_blocks(nbytes, lay.block_bytes, lay.num_blocks)

    def _find(self, kb: bytes, h: int) -> int:
        w, k, mk, sl = self._w, self._k, self._mkey, self._sl
        s = w[self._bk + (h & self._hmask)]
        n, slots, hops = len(kb), self._nslots, 0
        while s >= 0:
            if s >= slots or hops >= slots:  # past the table, or a cycle
                self._corrupt(f"hash chain of bucket {h & self._hmask} reaches slot {s} "
                              f"after {hops} hops (slots: {slots})")  # fmt: skip
            b = sl + s * SLOT_WORDS
            if w[b + S_HASH] == h and w[b + S_KLEN] == n and k[s * mk : s * mk + n] == kb:
                if w[b + S_STATE] not in STATE:  # FREE, or no state: not a key's slot
                    self._corrupt(f"slot {s} is on a hash chain in state {w[b + S_STATE]}")
                return s
            s = w[b + S_HNEXT]
            hops += 1
        return -1

    def _slot_of(self, key: str) -> int:
        """The slot holding ``key`` or -1. The entry of a key seen before names its slot
        and generation (unique per reservation), so a repeated key costs no hashing or
        key compare; a key found in the table is seen from then on."""
        w = self._w
        entry = self._seen.get(key)
        if entry is not None:
            b = self._sl + entry.slot * SLOT_WORDS
            if w[b + S_GEN] == entry.generation and w[b + S_STATE] in STATE:
                return entry.slot
        kb = key.encode()
        s = self._find(kb, zlib.crc32(kb))
        if s >= 0:
            self._snapshot(s, key)
        return s

    def _snapshot(self, s: int, key: str | None = None) -> SharedEntry:
        """This object's entry of slot ``s`` (holding ``key``, if the caller knows it),
        refreshed (state, pins, CRC) on every call.

        Like the in-process catalog's entries, it is one object per item that the
        catalog keeps up to date, so a hit costs no decoding.
        """
        w, b = self._w, self._sl + s * SLOT_WORDS
        gen = w[b + S_GEN]
        state = w[b + S_STATE]
        if state not in STATE:  # FREE (on a hash chain) or no state at all
            self._corrupt(f"slot {s} is read as an entry in state {state}")
        if key is None:
            mk, klen = self._mkey, w[b + S_KLEN]
            if not 0 < klen <= mk:
                self._corrupt(f"slot {s} holds a key of {klen} bytes (at most {mk})")
            key = bytes(self._k[s * mk : s * mk + klen]).decode()
        entry = self._seen.get(key)
        if entry is not None and (entry.slot != s or entry.generation != gen):
            entry = None  # an earlier reservation of the key
        if state == READY and entry is not None and entry.state is _READY and not w[b + S_VERIFY]:
            entry.pins = w[b + S_PINS]  # nothing else of a READY item ever changes
            return entry
        # Rebuilt when new, or first seen READY (commit may set dtype and shape).
        if entry is None or (entry.state is _WRITING and state == READY):
            extents = [Extent(e, c) for e, c in self._extent_chain(s, b)]
            ndim = w[b + S_NDIM]
            if not 0 <= ndim <= MAX_DIMS:
                self._corrupt(f"slot {s} holds a shape of {ndim} dimensions")
            shape = tuple(w[b + S_DIMS : b + S_DIMS + ndim])
            dtype = bytes(self._w[b + S_DTYPE : b + S_DTYPE + 2].cast("B")).rstrip(b"\0").decode()
            producer = ProcessId(w[b + S_PID], w[b + S_START])
            entry = SharedEntry(key, extents, w[b + S_NBYTES], dtype, shape, slot=s,
                                generation=gen, producer=producer)  # fmt: skip
            self._remember(key, entry)
        crc = w[b + S_CRC]
        entry.state = self._state_at(b)
        entry.pins = w[b + S_PINS]
        entry.checksum = None if crc < 0 else crc
        return entry

    def _extent_chain(self, s: int, b: int) -> list[tuple[int, int]]:
        """Slot ``s``'s extents (its words at ``b``), each checked to lie below the ready
        watermark before its successor is read; the walk ends after as many extents as
        there are blocks (a longer chain cycles) and must cover the slot's blocks."""
        w, i, ec, en = self._w, self._i, self._ec, self._en
        wm, chain, total, e = w[H_READY_BLOCKS], [], 0, w[b + S_EXT]
        while e >= 0:
            c = i[ec + e] if e < wm else 0
            if c <= 0 or c > wm - e or len(chain) >= wm:
                self._corrupt(f"slot {s}'s extent chain reaches ({e}, {c}) after "
                              f"{len(chain)} extents (ready blocks: {wm})")  # fmt: skip
            chain.append((e, c))
            total += c
            e = i[en + e]
        if total != w[b + S_BLOCKS]:
            self._corrupt(f"slot {s}'s extents hold {total} blocks, its count {w[b + S_BLOCKS]}")
        return chain

    def _remember(self, key: str, entry: SharedEntry) -> None:
        if len(self._seen) >= self.layout.max_items and key not in self._seen:
            self._seen.clear()  # bounded: the keys of evicted items go too
        self._seen[key] = entry

    def _state_at(self, b: int) -> ItemState:
        """The state of the slot at word ``b``: a READY item not verified since a warm
        start (or failing its CRC, pinned) is UNVERIFIED."""
        w = self._w
        state = w[b + S_STATE]
        return _UNVERIFIED if state == READY and w[b + S_VERIFY] else STATE[state]

    def state(self, key: str) -> ItemState | None:
        """The state of ``key``, or None if the catalog does not hold it."""
        self._enter(update=False)
        try:
            s = self._slot_of(key)
            return None if s < 0 else self._state_at(self._sl + s * SLOT_WORDS)
        finally:
            self._exit()

    def entry(self, key: str) -> SharedEntry:
        """A snapshot of the entry of ``key`` in any state (raises UnknownItemError)."""
        self._enter(update=False)
        try:
            return self._snapshot(self._expect(key, None, "entry"), key)
        finally:
            self._exit()

    def entries(self) -> list[SharedEntry]:
        """Snapshots of every entry, in slot order."""
        self._enter(update=False)
        try:
            w, sl = self._w, self._sl
            return [
                self._snapshot(s)
                for s in range(self.layout.max_items)
                if w[sl + s * SLOT_WORDS + S_STATE] != FREE
            ]
        finally:
            self._exit()

    def _expect(self, key: str, state: int | None, op: str) -> int:
        s = self._slot_of(key)
        if s < 0:
            raise UnknownItemError(
                f"key {key!r} is not in the catalog (never reserved, aborted or evicted)"
            )
        b = self._sl + s * SLOT_WORDS
        found = self._w[b + S_STATE]
        if found not in STATE:  # a FREE (or no) state on a key's hash chain
            self._corrupt(f"slot {s} of key {key!r} is on a hash chain in state {found}")
        if state is not None and found != state:
            raise ItemStateError(
                f"{op}({key!r}) needs an item in state {STATE[state].value!r}, "
                f"found {STATE[found].value!r}"
            )
        if op == "pin" and self._w[b + S_VERIFY]:  # served only once its CRC is checked
            raise ItemStateError(
                f"pin({key!r}) needs an item in state 'ready', found 'unverified' (its "
                "CRC-32 is not checked yet since the warm start): look it up instead"
            )
        return s

    def stats(self) -> CatalogStats:
        """The host-wide counters (every process of every instance); see :attr:`local`."""
        self._enter(update=False)
        try:
            w = self._w
            largest = self._largest_free_extent()
            return CatalogStats(
                hits=w[H_HITS], misses=w[H_MISSES], evictions=w[H_EVICTIONS],
                items_stored=w[H_STORED], bytes_stored=w[H_BYTES_STORED],
                bytes_evicted=w[H_BYTES_EVICTED], reserve_failures=w[H_RESERVE_FAILURES],
                items_resident=w[H_READY_ITEMS], bytes_resident=w[H_READY_BYTES],
                free_blocks=w[H_FREE_BLOCKS], largest_free_extent=largest,
                ready_blocks=w[H_READY_BLOCKS], verify_items_left=w[H_VERIFY_LEFT],
                verify_bytes_left=w[H_VERIFY_LEFT_BYTES], verify_bytes=w[H_VERIFY_BYTES],
            )  # fmt: skip
        finally:
            self._exit()
