"""A catalog in shared memory: one cache for every process that maps the arena file.

Same interface and protocol as :class:`~ecoffload.engine.catalog.catalog.Catalog`
(reserve / commit / abort / lookup / pin / unpin / evict, two-phase commit, LRU
eviction of READY unpinned items, nesting pins, the same errors; both satisfy
:class:`~ecoffload.engine.catalog.protocol.CatalogProtocol`), but its state
lives in a *metadata region* of the arena file, so every process of every
instance that maps the file sees one catalog. Any process may commit an item
another reserved (the worker that wrote the bytes), and every process sees
every READY item.

Costs: lookup O(1) (hash table), LRU O(1) (intrusive list of slots), allocation
O(extents) (free extents in 64 power-of-two size classes with boundary tags,
so a free coalesces with both neighbours in O(1)).

Readiness: the arena may still be pre-faulting (background populate), so
only blocks below the header's *ready watermark* are ever free or owned;
:meth:`SharedCatalog.add_ready` raises it (monotonic, idempotent) and frees
the newly ready blocks, coalescing with a free tail. Blocks at or above it
are neither free nor lost, for recovery and ``check`` alike.

The class is put together from one file per concept:

=============================  ================================================
``format.py``                  the region's word layout, ``meta_bytes``, entries
``robust_mutex.py``            the ctypes binding of the robust pthread mutex
``lock.py``                    the lock protocol: ``_enter`` / ``_exit``
``region.py``                  open, format, bind, boot check, close
``reads.py``                   finding keys, snapshots, ``stats``
this file                      reserve / commit / abort / lookup / evict
``pins.py``                    pin / unpin and their batches
``lru.py``                     the eviction policy (LRU list, making room)
``extents.py``                 the free-extent allocator
``recovery.py``                crash consistency: recover, reap
``verify.py``                  a warm start's verification against the arena's bytes
``state.py``                   what the parts share, declared once, typed
``check.py``                   every invariant, for tests
``native.c``                   hits, pins, unpins of seen READY items in C
``native.py``                  loading it (optional, layout checked) per object
=============================  ================================================

Plain Python on purpose: no torch import; numpy only in recovery, verify and ``check``.
The C paths are optional and answer only the usual case: whatever they do not
answer, the Python methods do, writing the same words.
"""

from __future__ import annotations

import zlib

from ...base.errors import (
    CatalogCapacityError,
    CatalogError,
    DuplicateItemError,
    ItemStateError,
)
from ...base.liveness import process_start_time
from ..catalog import ItemState
from . import fault_points
from .check import Check
from .extents import ExtentAllocator
from .fault_points import fault
from .format import (
    DEFAULT_MAX_KEY_BYTES,
    FREE,
    H_BYTES_EVICTED,
    H_BYTES_STORED,
    H_DIRTY,
    H_EVICTABLE,
    H_EVICTIONS,
    H_GEN,
    H_HITS,
    H_ITEMS,
    H_MISSES,
    H_READY_BLOCKS,
    H_READY_BYTES,
    H_READY_ITEMS,
    H_RESERVE_FAILURES,
    H_SLOT_FREE,
    H_STORED,
    H_TICK,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
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
    S_NEXT,
    S_PID,
    S_PIN_HEAD,
    S_PINS,
    S_PREV,
    S_START,
    S_STATE,
    S_TICK,
    S_VERIFY,
    SLOT_WORDS,
    STATE,
    UNVERIFIED,
    VERIFIED,
    WRITING,
    Layout,
    SharedEntry,
    dtype_words,
    meta_bytes,
    slot_dims,
)
from .lock import LockProtocol
from .lru import LRUPolicy
from .pins import Pins
from .reads import Reads
from .recovery import Recovery
from .region import CatalogRegion
from .verify import Verify

__all__ = [
    "DEFAULT_MAX_KEY_BYTES", "Layout", "SharedCatalog", "SharedEntry", "meta_bytes",
    "process_start_time",
]  # fmt: skip

_WRITING, _READY = ItemState.WRITING, ItemState.READY


class SharedCatalog(
    CatalogRegion, Reads, Pins, Recovery, Verify, Check, LRUPolicy, ExtentAllocator, LockProtocol
):
    """The catalog of an arena, in a metadata region of the arena file itself
    (see :class:`~ecoffload.engine.catalog.shared.region.CatalogRegion` for the
    constructor's arguments and :meth:`for_arena`)."""

    def reserve(
        self, key: str, nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] = ()
    ) -> SharedEntry | None:
        """Own blocks for a new item in state WRITING, evicting LRU items if needed.

        Returns None, changing nothing, when even evicting every READY unpinned
        item would not make room (blocks or item slots). The reservation belongs
        to this process: if it dies before commit or abort, the item is aborted.
        """
        kb = key.encode()
        if len(kb) > self._mkey:
            raise CatalogCapacityError(
                f"key {key[:40]!r}... is {len(kb)} bytes, this catalog holds keys of at most "
                f"{self._mkey}: create the arena with a larger max_key_bytes"
            )
        dims = slot_dims(shape)
        dt_name, dt0, dt1 = dtype_words(dtype)
        need = self._blocks_for(nbytes)
        h = zlib.crc32(kb)
        if self._ready_of is not None and self._w[H_READY_BLOCKS] < self.layout.num_blocks:
            self.add_ready(self._ready_of())  # the arena is still populating
        w = self._enter()
        try:
            s = self._find(kb, h)
            if s >= 0:
                raise DuplicateItemError(
                    f"key {key!r} is already in the catalog "
                    f"({STATE[w[self._sl + s * SLOT_WORDS + S_STATE]].value}); "
                    "look it up instead of saving it again, or evict it first"
                )
            if not self._make_room(need):
                w[H_RESERVE_FAILURES] += 1
                self._exit()
                return None
            extents = self._alloc(need)
            s = w[H_SLOT_FREE]
            b = self._sl + s * SLOT_WORDS
            if s >= self._nslots or w[b + S_STATE] != FREE:  # (>= 0: _make_room checked)
                self._corrupt(
                    f"the slot free list's head is slot {s} of {self._nslots}"
                    + ("" if s >= self._nslots else f", in state {w[b + S_STATE]}")
                )
            w[H_SLOT_FREE] = w[b + S_HNEXT]
            if fault_points.hook is not None:
                fault_points.hook("reserve:allocated")
            i, ec, en = self._i, self._ec, self._en
            last = len(extents) - 1
            for j, (first, count) in enumerate(extents):
                i[ec + first] = count
                i[en + first] = extents[j + 1][0] if j < last else -1
            mk = self._mkey
            self._k[s * mk : s * mk + len(kb)] = kb
            gen = w[H_GEN] + 1
            w[H_GEN] = gen
            pid, start = self._pid, self._start
            w[b + S_NBYTES] = nbytes
            w[b + S_BLOCKS] = need
            w[b + S_EXT] = extents[0][0]
            w[b + S_PINS] = 0
            w[b + S_PIN_HEAD] = -1
            w[b + S_PID] = pid
            w[b + S_START] = start
            w[b + S_CRC] = -1
            w[b + S_VERIFY] = VERIFIED
            w[b + S_HASH] = h
            w[b + S_KLEN] = len(kb)
            w[b + S_NDIM] = len(dims)
            w[b + S_GEN] = gen
            w[b + S_PREV] = -1
            w[b + S_NEXT] = -1
            for j, d in enumerate(dims):
                w[b + S_DIMS + j] = d
            w[b + S_DTYPE] = dt0
            w[b + S_DTYPE + 1] = dt1
            if fault_points.hook is not None:
                fault_points.hook("reserve:written")
            w[b + S_STATE] = WRITING  # the slot exists from here on
            if fault_points.hook is not None:
                fault_points.hook("reserve:published")
            bucket = self._bk + (h & self._hmask)
            w[b + S_HNEXT] = w[bucket]
            w[bucket] = s
            w[H_ITEMS] += 1
            # What _snapshot would decode, without decoding it.
            entry = SharedEntry(key, extents, nbytes, dt_name, dims, slot=s, generation=gen,
                                producer=self._me)  # fmt: skip
            self._remember(key, entry)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        return entry

    def commit(
        self,
        key: str,
        checksum: int | None = None,
        *,
        generation: int | None = None,
        dtype: str | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> SharedEntry:
        """WRITING -> READY: the bytes are complete; the item becomes visible.

        Any process may commit (the one that wrote the bytes). ``checksum`` (a
        CRC-32 of the bytes) is recorded with the item; ``generation`` (from the
        reserving entry) refuses to commit a newer reservation of the same key;
        ``dtype``/``shape``, when given, replace what the reservation said (the
        writer knows them; the process that reserved may not have).
        """
        dims = slot_dims(shape) if shape is not None else None
        dt = dtype_words(dtype) if dtype is not None else None
        crc = -1 if checksum is None else checksum
        w = self._enter()
        try:
            s = self._expect(key, WRITING, "commit")
            b = self._sl + s * SLOT_WORDS
            gen = w[b + S_GEN]
            if generation is not None and gen != generation:
                raise ItemStateError(
                    f"commit({key!r}): reservation {generation} is gone (the key was "
                    f"reserved again as {gen}); the bytes written may be stale"
                )
            if dims is not None:
                w[b + S_NDIM] = len(dims)
                for j, d in enumerate(dims):
                    w[b + S_DIMS + j] = d
            if dt is not None:
                w[b + S_DTYPE] = dt[1]
                w[b + S_DTYPE + 1] = dt[2]
            w[b + S_CRC] = crc
            tick = w[H_TICK] + 1
            w[H_TICK] = tick
            w[b + S_TICK] = tick
            if fault_points.hook is not None:
                fault_points.hook("commit:written")
            w[b + S_STATE] = READY
            if fault_points.hook is not None:
                fault_points.hook("commit:published")
            self._lru_append(s)
            blocks, nbytes = w[b + S_BLOCKS], w[b + S_NBYTES]
            w[H_EVICTABLE] += blocks
            w[H_READY_ITEMS] += 1
            w[H_READY_BYTES] += nbytes
            w[H_STORED] += 1
            w[H_BYTES_STORED] += nbytes
            entry = self._seen.get(key)
            if (
                entry is not None
                and entry.slot == s
                and entry.generation == gen
                and (entry.state is _WRITING)
            ):
                # This object's entry of the reservation: what commit changed, in place.
                entry.state = _READY
                entry.checksum = None if crc < 0 else crc
                if dims is not None:
                    entry.shape = dims
                if dt is not None:
                    entry.dtype = dt[0]
            else:
                entry = self._snapshot(s, key)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        return entry

    def abort(self, key: str, *, generation: int | None = None) -> None:
        """WRITING -> gone: the save failed or was cancelled; free its blocks.

        ``generation`` (from the reserving entry) refuses to abort a newer
        reservation of the same key, as in :meth:`commit`.
        """
        self._enter()
        try:
            s = self._expect(key, WRITING, "abort")
            found = self._w[self._sl + s * SLOT_WORDS + S_GEN]
            if generation is not None and found != generation:
                raise ItemStateError(
                    f"abort({key!r}): reservation {generation} is gone (the key was "
                    f"reserved again as {found}); leaving the newer one alone"
                )
            self._drop(s, evicted=False)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()

    def lookup(self, key: str, *, pin: bool = False) -> SharedEntry | None:
        """The READY entry of ``key`` (now most recently used), or None; counts hit/miss.

        ``pin=True`` also pins a hit under the same lock (one round trip instead
        of :meth:`lookup` then :meth:`pin`, between which another process could
        evict it).

        An item not verified since a warm start is checked first (its CRC-32 read
        outside the lock, :meth:`verify_now`): a hit if it matches, a miss (and
        dropped) if not.
        """
        fast = self._fast
        if fast is not None:  # C: a seen READY entry, mutex free, catalog clean (else 0)
            got = fast.hit(key, pin)
            if got.__class__ is not int:  # the entry (isinstance costs more than the check)
                self.local.hits += 1
                return got  # pyright: ignore[reportReturnType]  (not an int: the entry)
            if got:  # a dead holder's mutex (released for the Python way), or raises
                self._native_lock(got)  # pyright: ignore[reportArgumentType]  (an int here)
        unverified = None
        w = self._enter(False)  # a hit marks dirty only for what it relinks
        try:
            s = b = -1
            entry = self._seen.get(key)
            if entry is not None:  # seen READY: still the same reservation, still READY?
                s = entry.slot
                b = self._sl + s * SLOT_WORDS
                if (
                    entry.state is not _READY
                    or w[b + S_GEN] != entry.generation
                    or (w[b + S_STATE] != READY)
                ):
                    entry = None
            if entry is None:  # ask the table
                s = self._slot_of(key)
                b = self._sl + s * SLOT_WORDS
                if s >= 0 and w[b + S_STATE] == READY:
                    if w[b + S_VERIFY] == UNVERIFIED and self._data_at is not None:
                        unverified = self._pending(s)  # checked below, without the lock
                    elif not w[b + S_VERIFY]:
                        entry = self._snapshot(s, key)
            if unverified is not None:
                pass  # counted by the lookup after the check
            elif entry is None:
                w[H_MISSES] += 1
                self.local.misses += 1
            else:
                w[H_HITS] += 1
                self.local.hits += 1
                self._lru_touch(s, b)
                if pin:
                    w[H_DIRTY] = self._pid
                    entry.pins = self._pin_slot(s, key)
                else:
                    entry.pins = w[b + S_PINS]
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()
        if unverified is not None:
            self.verify_now([unverified])
            return self.lookup(key, pin=pin)  # verified, dropped, or another item by now
        return entry

    def evict(self, key: str) -> None:
        """Drop a READY, unpinned item now."""
        self._enter()
        try:
            s = self._expect(key, READY, "evict")
            pins = self._w[self._sl + s * SLOT_WORDS + S_PINS]
            if pins:
                raise ItemStateError(
                    f"evict({key!r}): the item is pinned {pins} time(s); unpin it first"
                )
            self._drop(s, evicted=True)
        except BaseException as exc:
            self._exit(isinstance(exc, CatalogError))
            raise
        self._exit()

    def add_ready(self, ready_blocks: int) -> int:
        """Blocks ``[0, ready_blocks)`` are pre-faulted: raise the ready watermark and
        free the newly ready blocks (coalescing with a free tail).

        Monotonic and idempotent (a lower or equal value changes nothing, without
        taking the lock); returns how many blocks became ready.
        """
        new = min(int(ready_blocks), self.layout.num_blocks)
        if new <= self._w[H_READY_BLOCKS]:  # the common case, lock-free: it only grows
            return 0
        self._enter()
        try:
            w = self._w
            old = w[H_READY_BLOCKS]
            added = max(0, new - old)
            if added:
                self._free_extent(old, added)  # derived first: recovery trusts the watermark
                fault("add_ready:freed")
                w[H_READY_BLOCKS] = new
        except BaseException:
            self._exit(False)
            raise
        self._exit()
        return added

    def _drop(self, s: int, *, evicted: bool) -> None:
        w, b = self._w, self._sl + s * SLOT_WORDS
        state = w[b + S_STATE]
        w[b + S_STATE] = FREE  # the truth first: the rest is derived
        if fault_points.hook is not None:
            fault_points.hook("drop:unpublished")
        h = w[b + S_HASH]
        bucket = self._bk + (h & self._hmask)
        prev, cur, hops = -1, w[bucket], 0
        while cur != s:
            if not 0 <= cur < self._nslots or hops >= self._nslots:  # s is not on it
                self._corrupt(f"slot {s} is not on its hash chain (it reaches {cur} after "
                              f"{hops} hops)")  # fmt: skip
            prev, cur = cur, w[self._sl + cur * SLOT_WORDS + S_HNEXT]
            hops += 1
        if prev < 0:
            w[bucket] = w[b + S_HNEXT]
        else:
            w[self._sl + prev * SLOT_WORDS + S_HNEXT] = w[b + S_HNEXT]
        nbytes, blocks = w[b + S_NBYTES], w[b + S_BLOCKS]
        if w[b + S_VERIFY]:
            if w[b + S_VERIFY] == UNVERIFIED:
                w[H_VERIFY_LEFT] -= 1
                w[H_VERIFY_LEFT_BYTES] -= nbytes
            w[b + S_VERIFY] = VERIFIED
        if state == READY:
            self._lru_unlink(s)
            w[H_EVICTABLE] -= blocks
            w[H_READY_ITEMS] -= 1
            w[H_READY_BYTES] -= nbytes
        i, e, wm = self._i, w[b + S_EXT], w[H_READY_BLOCKS]
        if 0 <= e < wm and i[self._en + e] < 0 and 0 < (c := i[self._ec + e]) == blocks <= wm - e:
            self._free_extent(e, c)  # one extent (most items), checked as _extent_chain does
        else:
            for e, c in self._extent_chain(s, b):  # the whole chain checked before any free
                self._free_extent(e, c)
        w[b + S_HNEXT] = w[H_SLOT_FREE]
        w[H_SLOT_FREE] = s
        w[H_ITEMS] -= 1
        if evicted:
            w[H_EVICTIONS] += 1
            w[H_BYTES_EVICTED] += nbytes
