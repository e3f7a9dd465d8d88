"""Item catalog: which key owns which blocks, in which state, pinned how often.

Protocol (two-phase commit, so a partially written item is never served)::

    reserve(key, nbytes, dtype, shape) -> Entry | None   state WRITING, blocks owned
        ... caller copies the bytes into entry.extents ...
    commit(key)                                         WRITING -> READY (visible)
    abort(key)                                          WRITING -> gone, blocks freed

    lookup(key, pin=False) -> Entry | None
                                     READY only; a hit becomes most recently used
                                     (and pinned with pin=True)
    pin(key) / unpin(key)            nest; a pinned item is never evicted or freed
    evict(key)                       READY, unpinned -> gone

``reserve`` makes room by evicting least-recently-used READY, unpinned items,
and only if that is enough: otherwise it returns None and changes nothing.
Only ready blocks count as room (see :meth:`BlockAllocator.add_ready`): while
the arena is still being populated, a save that needs more is refused the
same way, counted in ``reserve_failures``.
WRITING and pinned items are never evicted. Misuse (unknown key, wrong state,
unbalanced unpin, impossible size) raises a specific :class:`CatalogError`.

Plain Python on purpose: no torch import.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain

from ..base.errors import DuplicateItemError, ItemStateError, UnknownItemError
from ..base.items import item_crc32  # noqa: F401 - its old home; engine/base/items.py owns it
from .allocator import BlockAllocator, Extent


class ItemState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    # Shared catalog only: READY, but its CRC-32 not checked since a warm start; a miss
    # for lookup and pin until it is (catalog/shared/verify.py).
    UNVERIFIED = "unverified"


@dataclass
class Entry:
    """One item: where its bytes live and how to view them again."""

    key: str
    extents: list[Extent]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    state: ItemState = ItemState.WRITING
    pins: int = 0
    checksum: int | None = None  # CRC-32 of the bytes, in integrity mode
    blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = sum(count for _, count in self.extents)

    @cached_property
    def extent_array(self):
        """int64 [k, 2]: :attr:`extents` as an array, made once per entry (an item's blocks
        never change), so a step's table is a concatenation, not a walk of its extents."""
        import numpy as np  # here: importing the catalog stays light

        # fromiter over the flattened pairs: np.array walks each Extent as a generic
        # sequence, several times slower (BENCHMARKS.md, "The save path's last cuts")
        flat = chain.from_iterable(self.extents)
        array = np.fromiter(flat, np.int64, count=2 * len(self.extents)).reshape(-1, 2)
        array.flags.writeable = False
        return array


@dataclass
class CatalogStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    items_stored: int = 0  # committed, cumulative
    bytes_stored: int = 0  # committed, cumulative
    bytes_evicted: int = 0
    reserve_failures: int = 0  # no room even after evicting everything evictable
    items_resident: int = 0
    bytes_resident: int = 0
    free_blocks: int = 0
    largest_free_extent: int = 0
    ready_blocks: int = 0  # blocks the arena's populate has made allocatable so far
    # A shared catalog's verification after a warm start: items and bytes still to check
    # (misses until checked), of the bytes the warm start marked.
    verify_items_left: int = 0
    verify_bytes_left: int = 0
    verify_bytes: int = 0


class Catalog:
    """Index of items in one arena, with LRU eviction, pins and two-phase commit."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._entries: dict[str, Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # READY keys, oldest first
        self._evictable_blocks = 0  # blocks of READY, unpinned items
        self._stats = CatalogStats()
        self._ready_of: Callable[[], int] | None = None

    def follow_ready(self, ready_of: Callable[[], int]) -> None:
        """Before each reservation while blocks are still unready, raise the ready
        blocks to ``ready_of()`` (the arena's populate progress): callers need not."""
        self._ready_of = ready_of

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """True for READY items; does not count as a lookup or touch the LRU order."""
        entry = self._entries.get(key)
        return entry is not None and entry.state is ItemState.READY

    def state(self, key: str) -> ItemState | None:
        """The state of ``key``, or None if the catalog does not hold it."""
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def entry(self, key: str) -> Entry:
        """The entry of ``key`` in any state (raises UnknownItemError)."""
        try:
            return self._entries[key]
        except KeyError:
            raise UnknownItemError(
                f"key {key!r} is not in the catalog (never reserved, aborted or evicted)"
            ) from None

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def reserve(
        self, key: str, nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] = ()
    ) -> Entry | None:
        """Own blocks for a new item in state WRITING, evicting LRU items if needed.

        Returns None, changing nothing, when even evicting every READY unpinned
        item would not make room (the arena is full of pinned or in-flight items).
        """
        if key in self._entries:
            raise DuplicateItemError(
                f"key {key!r} is already in the catalog ({self._entries[key].state.value}); "
                "look it up instead of saving it again, or evict it first"
            )
        alloc = self.allocator
        if self._ready_of is not None and alloc.ready_blocks < alloc.num_blocks:
            alloc.add_ready(self._ready_of())
        need = alloc.blocks_for(nbytes)
        if need > alloc.free_blocks:
            if alloc.free_blocks + self._evictable_blocks < need:
                self._stats.reserve_failures += 1
                return None
            victims, room = [], alloc.free_blocks
            for k in self._lru:  # oldest first; stops as soon as there is room
                entry = self._entries[k]
                if entry.pins == 0:
                    victims.append(k)
                    room += self._blocks(entry)
                    if room >= need:
                        break
            for k in victims:
                self._drop(k, evicted=True)
        extents = alloc.alloc(nbytes)
        assert extents is not None, "allocator refused although enough blocks are free"
        entry = Entry(key, extents, nbytes, str(dtype), tuple(int(d) for d in shape))
        self._entries[key] = entry
        return entry

    def commit(self, key: str, checksum: int | None = None) -> Entry:
        """WRITING -> READY: the bytes are complete; the item becomes visible.

        ``checksum`` (a CRC-32 of the bytes, integrity mode) is recorded with it.
        """
        entry = self._expect(key, ItemState.WRITING, "commit")
        if checksum is not None:
            entry.checksum = checksum
        entry.state = ItemState.READY
        self._lru[key] = None
        self._evictable_blocks += self._blocks(entry)
        self._stats.items_stored += 1
        self._stats.bytes_stored += entry.nbytes
        return entry

    def abort(self, key: str) -> None:
        """WRITING -> gone: the save failed or was cancelled; free its blocks."""
        self._expect(key, ItemState.WRITING, "abort")
        self._drop(key, evicted=False)

    def lookup(self, key: str, *, pin: bool = False) -> Entry | None:
        """The READY entry of ``key`` (now most recently used), or None; counts hit/miss.
        ``pin=True`` also pins a hit (the shared catalog does both under one lock)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not ItemState.READY:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._lru.move_to_end(key)
        if pin:
            self.pin(key)
        return entry

    def pin(self, key: str) -> Entry:
        """Protect a READY item from eviction (e.g. while it is being loaded); nests."""
        entry = self._expect(key, ItemState.READY, "pin")
        if entry.pins == 0:
            self._evictable_blocks -= self._blocks(entry)
        entry.pins += 1
        return entry

    def unpin(self, key: str) -> None:
        entry = self._expect(key, ItemState.READY, "unpin")
        if entry.pins == 0:
            raise ItemStateError(
                f"unpin({key!r}): the item is not pinned; every unpin must match one pin"
            )
        entry.pins -= 1
        if entry.pins == 0:
            self._evictable_blocks += self._blocks(entry)

    def pin_many(self, keys: list[str]) -> list[Entry]:
        """:meth:`pin` every key: all of them, or none (and the error)."""
        entries = [self._expect(key, ItemState.READY, "pin") for key in keys]
        for entry in entries:
            self.pin(entry.key)
        return entries

    def unpin_many(self, keys: list[str]) -> None:
        """:meth:`unpin` every key: all of them, or none (and the error)."""
        need: dict[str, int] = {}
        for key in keys:
            entry = self._expect(key, ItemState.READY, "unpin")
            need[key] = need.get(key, 0) + 1
            if need[key] > entry.pins:
                raise ItemStateError(
                    f"unpin({key!r}): the item is not pinned; every unpin must match one pin"
                )
        for key in keys:
            self.unpin(key)

    def evict(self, key: str) -> None:
        """Drop a READY, unpinned item now."""
        entry = self._expect(key, ItemState.READY, "evict")
        if entry.pins:
            raise ItemStateError(
                f"evict({key!r}): the item is pinned {entry.pins} time(s); unpin it first"
            )
        self._drop(key, evicted=True)

    def stats(self) -> CatalogStats:
        """A snapshot of the counters."""
        ready = [e for e in self._entries.values() if e.state is ItemState.READY]
        return replace(
            self._stats,
            items_resident=len(ready),
            bytes_resident=sum(e.nbytes for e in ready),
            free_blocks=self.allocator.free_blocks,
            largest_free_extent=self.allocator.largest_free_extent,
            ready_blocks=self.allocator.ready_blocks,
        )

    def check(self) -> None:
        """Assert the catalog's invariants (used by tests)."""
        self.allocator.check()
        owned: set[int] = set()
        for entry in self._entries.values():
            for start, count in entry.extents:
                blocks = set(range(start, start + count))
                assert not blocks & owned, f"block owned twice ({entry.key})"
                owned |= blocks
            assert self._blocks(entry) == -(-entry.nbytes // self.allocator.block_bytes)
            assert entry.blocks == sum(count for _, count in entry.extents)
            assert (entry.key in self._lru) == (entry.state is ItemState.READY)
            assert entry.pins >= 0 and (entry.pins == 0 or entry.state is ItemState.READY)
        assert len(owned) + self.allocator.free_blocks == self.allocator.ready_blocks
        assert self._evictable_blocks == sum(
            self._blocks(self._entries[k]) for k in self._lru if self._entries[k].pins == 0
        )

    def _expect(self, key: str, state: ItemState, op: str) -> Entry:
        entry = self.entry(key)
        if entry.state is not state:
            raise ItemStateError(
                f"{op}({key!r}) needs an item in state {state.value!r}, found {entry.state.value!r}"
            )
        return entry

    def _drop(self, key: str, *, evicted: bool) -> None:
        entry = self._entries.pop(key)
        if key in self._lru:  # READY (and unpinned: pinned items are never dropped)
            del self._lru[key]
            self._evictable_blocks -= self._blocks(entry)
        self.allocator.free(entry.extents)
        if evicted:
            self._stats.evictions += 1
            self._stats.bytes_evicted += entry.nbytes

    @staticmethod
    def _blocks(entry: Entry) -> int:
        return entry.blocks
