"""What the parts of :class:`~.catalog.SharedCatalog` share, declared once and typed.

``SharedCatalog`` is one object assembled from parts, one file each (``region.py``,
``lock.py``, ``reads.py``, ``pins.py``, ``lru.py``, ``extents.py``, ``recovery.py``,
``check.py``, ``catalog.py``); every part derives from :class:`CatalogState`. Its
attributes are the region's views and word offsets (set by ``region.py`` once the
layout is read) and this process's identity (``lock.py``); the methods declared under
``TYPE_CHECKING`` are the ones a part calls in another, each implemented by the part
named beside it: the declarations only tell readers and the type checker what each
part offers the others and cost nothing at run time.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from ...base.errors import CatalogError
from ...base.liveness import ProcessId
from ..allocator import Extent
from ..catalog import CatalogStats
from .format import Layout, SharedEntry

if TYPE_CHECKING:
    import numpy as np

    from ._catalog_native import HitPath  # its stub (_catalog_native.pyi)


class CatalogState:
    # region.py: the mapping and its views
    path: str  # the arena file (or "fd N"), for messages
    _fd: int  # the catalog's own file description
    _region: tuple[int, int]  # (offset, size) in the file
    _mm: mmap.mmap | None  # None once closed
    _w: memoryview  # the region as int64 words
    _i: memoryview  # the per-block int32 arrays
    _k: memoryview  # the key bytes
    _mx: ctypes.c_void_p  # the robust mutex's address, inside _mm
    layout: Layout
    local: CatalogStats  # this object's own hits and misses
    # word offsets into _w (slots, pin records, hash buckets) and _i (per-block arrays)
    _sl: int
    _pn: int
    _bk: int
    _hmask: int
    _mkey: int
    _ec: int
    _en: int
    _fs: int
    _fe: int
    _fn: int
    _fp: int
    # the tables' sizes: every index read from the region is checked against them before
    # it is followed, every walk bounded by them
    _nslots: int
    _npins: int
    _nblocks: int
    _seen: dict[str, SharedEntry]  # key -> the entry this object saw READY
    _last_reap: float  # monotonic time of the last sweep for dead owners
    _ready_of: Callable[[], int] | None  # the arena's ready blocks (follow_ready)
    _data_at: tuple[int, int] | None  # (offset, bytes) of the arena's data in the file
    _fast: HitPath | None  # the C hits, pins and unpins (native.py), or None
    # lock.py: this process, as recorded in dirty marks, pins and reservations (_me), and
    # its two words, as the hot paths write them
    _me: ProcessId
    _pid: int
    _start: int

    def _mapping(self) -> mmap.mmap:
        """The region's mapping, for the parts that view it whole."""
        if self._mm is None:
            raise CatalogError(f"the catalog of {self.path} is closed")
        return self._mm

    if TYPE_CHECKING:
        # lock.py
        def _enter(self, update: bool = True, recover: bool = True) -> memoryview: ...
        def _exit(self, clean: bool = True) -> None: ...
        def _identify(self) -> None: ...
        def _lock(self) -> None: ...
        def _unlock(self) -> None: ...
        def _native_lock(self, rc: int) -> None: ...
        def _corrupt(self, what: str) -> NoReturn: ...

        # reads.py
        def _find(self, kb: bytes, h: int) -> int: ...
        def _slot_of(self, key: str) -> int: ...
        def _snapshot(self, s: int, key: str | None = None) -> SharedEntry: ...
        def _remember(self, key: str, entry: SharedEntry) -> None: ...
        def _expect(self, key: str, state: int | None, op: str) -> int: ...
        def _blocks_for(self, nbytes: int) -> int: ...
        def _extent_chain(self, s: int, b: int) -> list[tuple[int, int]]: ...
        def stats(self) -> CatalogStats: ...

        # pins.py
        def _pin_slot(self, s: int, key: str) -> int: ...
        def _unlink_pin(self, s: int, r: int) -> None: ...
        def _bad_pin_list(self, s: int, r: int, hops: int) -> None: ...

        # lru.py
        def _lru_touch(self, s: int, b: int) -> None: ...
        def _lru_append(self, s: int) -> None: ...
        def _lru_unlink(self, s: int) -> None: ...
        def _make_room(self, need: int) -> bool: ...

        # extents.py
        def _fl_insert(self, s: int, c: int) -> None: ...
        def _free_extent(self, s: int, c: int) -> None: ...
        def _alloc(self, need: int) -> list[Extent]: ...
        def _largest_free_extent(self) -> int: ...

        # check.py
        def check(self) -> None: ...

        # recovery.py
        def _reap(self) -> int: ...
        def _recover(self) -> None: ...
        def _slot_table(self) -> np.ndarray: ...

        # catalog.py
        def _drop(self, s: int, *, evicted: bool) -> None: ...
        def add_ready(self, ready_blocks: int) -> int: ...
