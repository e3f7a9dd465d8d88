"""Opening the shared catalog's region: map it, format it once, bind its views.

The first opener of an all-zero region formats it (under an open-file-
description lock on the region's first byte, held only inside the
constructor); every opener then checks the layout against what it expects,
and gives the mutex a fresh start if the file outlived a reboot (the header
records the boot, ``/proc/sys/kernel/random/boot_id``, in which the mutex was
initialised: no process of this boot can hold it, but a futex word written
before the crash may name a dead thread without OWNER_DIED). Last, it sweeps
reservations and pins of dead processes (or recovers, if the catalog is dirty).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...arena.janitor import ofd_lock
from ...base.errors import ArenaLayoutMismatch, CatalogLockError, InvalidSizeError
from ...base.liveness import boot_id
from ..catalog import CatalogStats
from . import native as shared_catalog_native
from . import robust_mutex
from .extents import AllocatorView
from .format import (
    DEFAULT_MAX_KEY_BYTES,
    H_BLOCK_BYTES,
    H_BOOT,
    H_BUCKETS,
    H_DIRTY,
    H_MAGIC,
    H_MAX_ITEMS,
    H_MAX_KEY,
    H_MAX_PINS,
    H_META_BYTES,
    H_NUM_BLOCKS,
    H_READY_BLOCKS,
    H_VERSION,
    HEADER_BYTES,
    MAGIC,
    MUTEX_AT,
    VERSION,
    Layout,
    SharedEntry,
    layout_for,
)
from .robust_mutex import init_mutex
from .state import CatalogState

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...arena.arena import Arena

# the catalog's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.catalog.shared.catalog")


class CatalogRegion(CatalogState):
    """The constructor, ``for_arena`` and ``close`` of the shared catalog (a mixin).

    Args:
        fd: a descriptor of the file (an arena's :meth:`Arena.fileno`); the
            catalog opens a description of its own through /proc.
        offset, size: the region (page-aligned offset).
        num_blocks, block_bytes, max_items, max_key_bytes, max_pins: the layout;
            an unformatted (all-zero) region is formatted with it, a formatted
            one must match it (:class:`ArenaLayoutMismatch` otherwise). None
            accepts what the region records.
        ready_blocks: the ready watermark an unformatted region starts with
            (default every block); ignored by a formatted one (see
            :meth:`add_ready`).
    """

    def __init__(
        self,
        fd: int,
        offset: int,
        size: int,
        *,
        num_blocks: int | None = None,
        block_bytes: int | None = None,
        max_items: int | None = None,
        max_key_bytes: int | None = None,
        max_pins: int | None = None,
        ready_blocks: int | None = None,
        path: str = "",
    ) -> None:
        if offset % mmap.PAGESIZE:
            raise InvalidSizeError(f"the region offset must be page aligned, got {offset}")
        if robust_mutex.PT is None:
            raise CatalogLockError(
                "the C library offers no robust process-shared pthread mutex "
                "(pthread_mutex_consistent): the shared catalog needs glibc or musl on Linux"
            )
        if size < HEADER_BYTES:  # checked before anything is opened: nothing to close
            raise InvalidSizeError(f"the catalog region must hold its {HEADER_BYTES}-byte "
                                   f"header, got {size} bytes")  # fmt: skip
        if size % 8:
            raise InvalidSizeError(f"the catalog region is made of 8-byte words, got {size} "
                                   "bytes: give the size meta_bytes() computed")  # fmt: skip
        self.path = path or f"fd {fd}"
        self._fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        self._region = (offset, size)
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, offset=offset)
        self._w = memoryview(self._mm).cast("q")
        at = ctypes.c_char.from_buffer(self._mm, MUTEX_AT)
        self._mx = ctypes.c_void_p(ctypes.addressof(at))  # valid while the map is
        del at  # (a live export would keep the map from closing)
        self._identify()
        self._seen: dict[str, SharedEntry] = {}  # key -> this object's entry of it
        self._last_reap = 0.0
        self._ready_of: Callable[[], int] | None = None  # see follow_ready
        self.local = CatalogStats()  # this object's own hits and misses
        # The arena's data area (offset in the file, bytes), where verification reads
        # items (for_arena sets it), and its read-only map, made on first use.
        self._data_at = None
        self._data_mm: mmap.mmap | None = None
        wanted = (num_blocks, block_bytes, max_items, max_key_bytes, max_pins)
        ofd_lock(self._fd, fcntl.F_WRLCK, offset, wait=True)  # the region's first byte
        try:
            if self._w[H_MAGIC] != MAGIC:
                if num_blocks is None or block_bytes is None:
                    raise ArenaLayoutMismatch(self.path, "catalog magic", MAGIC, self._w[H_MAGIC])
                layout = layout_for(num_blocks, block_bytes, max_items,
                                    max_key_bytes or DEFAULT_MAX_KEY_BYTES, max_pins)  # fmt: skip
                if layout.nbytes > size:
                    raise InvalidSizeError(
                        f"the catalog needs a region of {layout.nbytes} bytes, got {size}: "
                        "size the region with shared_catalog.meta_bytes(...)"
                    )
                self._format(layout, layout.num_blocks if ready_blocks is None else ready_blocks)
            self._bind()
            found = (self.layout.num_blocks, self.layout.block_bytes, self.layout.max_items,
                     self.layout.max_key_bytes, self.layout.max_pins)  # fmt: skip
            names = ("num_blocks", "block_bytes", "max_items", "max_key_bytes", "max_pins")
            for name, want, got in zip(names, wanted, found, strict=True):
                if want is not None and want != got:
                    raise ArenaLayoutMismatch(self.path, f"catalog {name}", want, got)
            boot = boot_id()
            if (self._w[H_BOOT], self._w[H_BOOT + 1]) != boot:
                # Every process of this boot that used the mutex opened the file first
                # (and recorded this boot): nobody holds it. Dirty, if set, stays set.
                log.info("catalog %s: its lock is from another boot; initialising it afresh",
                         self.path)  # fmt: skip
                init_mutex(self._mx, self.path)
                self._w[H_BOOT], self._w[H_BOOT + 1] = boot
            self._enter()  # recovers if dirty; else a sweep for the dead
            try:
                self._reap()
            except BaseException:
                self._exit(False)
                raise
            self._exit()
        except BaseException:
            self.close()
            raise
        ofd_lock(self._fd, fcntl.F_UNLCK, offset, wait=False)
        self.allocator = AllocatorView(self)

    @classmethod
    def for_arena(cls, arena: Arena, **layout: int | None) -> Self:
        """The catalog in ``arena``'s metadata region (see ``Arena.create(meta_bytes=)``)."""
        if not arena.meta_bytes:
            raise InvalidSizeError(
                f"arena {arena.path} has no metadata region: create it with "
                "meta_bytes=shared_catalog.meta_bytes(...)"
            )
        layout.setdefault("ready_blocks", arena.ready_blocks)
        catalog = cls(arena.fileno(), arena.meta_offset, arena.meta_bytes,
                      num_blocks=arena.num_blocks, block_bytes=arena.block_bytes,
                      path=arena.path, **layout)  # fmt: skip
        catalog._data_at = (arena.meta_offset + arena.meta_bytes, arena.nbytes)
        ref = weakref.ref(arena)  # the catalog must not keep the arena alive
        catalog.follow_ready(lambda: 0 if (a := ref()) is None else a.ready_blocks)
        return catalog

    def follow_ready(self, ready_of: Callable[[], int]) -> None:
        """Before each reservation while blocks are still unready, raise the ready
        watermark to ``ready_of()`` (the arena's populate progress; :meth:`for_arena`
        sets it): callers need not call :meth:`add_ready`."""
        self._ready_of = ready_of

    def close(self) -> None:
        """Unmap the region and close the catalog's file description (idempotent).

        Not while another thread of this process is inside a call of this object:
        the mutex it holds or waits for lives in the mapping."""
        if self._mm is None:
            return
        for view in ("_w", "_i", "_k"):
            v = self.__dict__.pop(view, None)
            if v is not None:
                v.release()
        for name in ("_fs", "_fe", "_fn", "_fp", "_ec", "_en", "_mx", "_fast"):
            self.__dict__.pop(name, None)  # a later call fails on the name, never the address
        self._mm.close()
        self._mm = None
        data, self._data_mm = getattr(self, "_data_mm", None), None
        if data is not None:
            data.close()
        os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self.close()

    def _format(self, lay: Layout, ready_blocks: int) -> None:
        mm = self._mapping()
        w = memoryview(mm).cast("q")
        try:
            w[H_MAGIC] = 0
            mm[: lay.nbytes] = bytes(lay.nbytes)
            for i, v in ((H_VERSION, VERSION), (H_META_BYTES, lay.nbytes),
                         (H_NUM_BLOCKS, lay.num_blocks), (H_BLOCK_BYTES, lay.block_bytes),
                         (H_MAX_ITEMS, lay.max_items), (H_MAX_KEY, lay.max_key_bytes),
                         (H_MAX_PINS, lay.max_pins), (H_BUCKETS, lay.buckets),
                         (H_READY_BLOCKS, max(0, min(ready_blocks, lay.num_blocks)))):  # fmt: skip
                w[i] = v
            w[H_DIRTY] = self._pid  # formatted by the recovery below
            w[H_BOOT], w[H_BOOT + 1] = boot_id()
            init_mutex(self._mx, self.path)
            w[H_MAGIC] = MAGIC
        finally:
            w.release()

    def _bind(self) -> None:
        w = self._w
        if w[H_VERSION] != VERSION:
            raise ArenaLayoutMismatch(self.path, "catalog version", VERSION, w[H_VERSION])
        self.layout = lay = Layout(w[H_NUM_BLOCKS], w[H_BLOCK_BYTES], w[H_MAX_ITEMS],
                                   w[H_MAX_KEY], w[H_MAX_PINS])  # fmt: skip
        if lay.nbytes != w[H_META_BYTES] or lay.nbytes > self._region[1]:
            raise ArenaLayoutMismatch(self.path, "catalog meta_bytes", lay.nbytes,
                                      w[H_META_BYTES])  # fmt: skip
        n = lay.num_blocks
        mm = self._mapping()
        self._i = memoryview(mm)[lay.blocks_at : lay.blocks_at + 24 * n].cast("i")
        self._k = memoryview(mm)[lay.keys_at : lay.pins_at]
        # Per-block int32 arrays are offsets into one view: count/next of item
        # extents, free size at start / free start at end / next / prev.
        self._ec, self._en, self._fs, self._fe, self._fn, self._fp = (k * n for k in range(6))
        self._bk = lay.buckets_at // 8
        self._sl = lay.slots_at // 8
        self._pn = lay.pins_at // 8
        self._mkey = lay.max_key_bytes
        self._hmask = lay.buckets - 1
        # Table sizes: every index read from the region is checked against them before
        # it is followed, and every walk is bounded by them (LockProtocol._corrupt).
        self._nslots, self._npins, self._nblocks = lay.max_items, lay.max_pins, n
        self._fast = shared_catalog_native.hit_path(self)  # C hits, pins, unpins (or None)
