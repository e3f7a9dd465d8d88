"""A catalog in shared memory: one cache for every process that maps the arena file.

Same interface and protocol as :class:`~ecoffload.engine.catalog.Catalog`
(reserve / commit / abort / lookup / pin / unpin / evict, two-phase commit, LRU
eviction of READY unpinned items, nesting pins, the same errors), but its state
lives in a *metadata region* of the arena file, so every process of every
instance that maps the file sees one catalog. Any process may commit an item
another reserved (the worker that wrote the bytes), and every process sees
every READY item.

Layout of the region (little endian; ``layout()`` computes the offsets)::

    header      1 KiB: magic, version, sizes, dirty marker, recovery count, LRU
                ends, free lists, counters, the ready watermark, the count of
                lock holders that died, at byte 256 the lock (a 64-byte slot) and
                the boot it was initialised in, the heads of 64 free-extent lists
    buckets     hash table: one int64 slot index per bucket (power of two >= max_items)
    slots       max_items x 32 int64 (64-byte aligned): state, generation, LRU
                links, use tick, pins, first pin record, blocks | hash chain, key
                hash/length, nbytes, first extent, CRC-32, owner (pid, start
                time) | shape, dtype
    keys        max_items x max_key_bytes: the UTF-8 key of each slot
    pins        max_pins x 5 int64: (slot, next, pid, start time, count), one per
                pinned (item, process)
    per block   6 x num_blocks int32: extent chains of items (count, next start)
                and the free-extent structure (size at its first block, start at
                its last block, links of its size-class list)

Costs: lookup O(1) (hash table), LRU O(1) (intrusive list of slots), allocation
O(extents) (free extents in 64 power-of-two size classes with boundary tags,
so a free coalesces with both neighbours in O(1)). ``meta_bytes`` is about
``300 + max_key_bytes`` bytes per item (slot, key, bucket, pin record) and 24
per block: 73 MiB for an 8 GiB arena of 64 KiB blocks with the defaults
(max_items = num_blocks, 256-byte keys), 0.9% of it; 21 MiB with max_items=32768.

Concurrency: one process-shared, robust, error-checking pthread mutex in the
header (glibc or musl, through ctypes) guards every operation. It is owned by
a thread, so threads of one process, catalog objects of one process and
processes all exclude each other with it alone. When its holder dies (process
or thread), the kernel marks the mutex's futex word OWNER_DIED, and the next
locker gets ``EOWNERDEAD``: it marks the mutex consistent at once (the data's
own consistency is the ``dirty`` word's business, below), counts the death
and goes on, recovering if ``dirty`` is set. A mutex unlocked while
inconsistent would refuse every process forever (``ENOTRECOVERABLE``), so no
path unlocks before ``pthread_mutex_consistent``; should a foreign process do
it anyway, :class:`CatalogLockError` names the file and the remedy. The
header records the boot (``/proc/sys/kernel/random/boot_id``) in which the
mutex was initialised: a file that outlived a reboot (no process of that boot
can hold it, but a futex word written before the crash may name a dead
thread without OWNER_DIED) gets a fresh mutex at its first open. Opening
(format, boot check) is serialised by an open-file-description lock on the
region's first byte, held only inside the constructor. One pid namespace is
assumed, as for the pid/start-time owners below.

Crash consistency: the *slot table* is the truth; the hash table, LRU list,
free lists, free-extent structure, per-slot pin lists and counters are derived.
Every update runs with the header's ``dirty`` word set to the updater's pid and
writes a slot's fields before its state word (a slot becomes WRITING only once
its extents and key are in place; it becomes READY only once its CRC is in
place; a victim is marked free before its blocks are handed out). A locker
that finds ``dirty`` set (its holder died inside an update) rebuilds every
derived structure from the slot table (:meth:`SharedCatalog.recover`), so a
SIGKILL at any point leaves no block owned twice, no block lost and no
half-written item visible.

Readiness: the arena may still be pre-faulting (background populate), so
only blocks below the header's *ready watermark* are ever free or owned;
:meth:`SharedCatalog.add_ready` raises it (monotonic, idempotent) and frees
the newly ready blocks, coalescing with a free tail. Blocks at or above it
are neither free nor lost, for recovery and ``check`` alike.

Ownership: a WRITING item belongs to the process that reserved it and a pin to
the process that took it, each recorded as (pid, start time from /proc); when
that process is gone (checked at recovery, at open, and when space runs out)
the reservation is aborted and the pin dropped.

Plain Python on purpose: no torch import; numpy only in recovery and ``check``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .allocator import Extent, blocks_for
from .catalog import CatalogStats, Entry, ItemState, item_crc32
from .errors import (
    ArenaLayoutMismatch,
    CatalogCapacityError,
    CatalogError,
    CatalogLockError,
    DuplicateItemError,
    InvalidSizeError,
    ItemStateError,
    ItemTooLargeError,
    UnknownItemError,
)

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"ECOCAT\x00\x01", "little")
VERSION = 3  # 2: the ready watermark (word H_READY_BLOCKS); 3: the robust mutex, slot words
# in cache-line order
HEADER_BYTES = 1024
SLOT_WORDS = 32
PIN_WORDS = 5
MAX_DIMS = 8
DTYPE_BYTES = 16
DEFAULT_MAX_KEY_BYTES = 256

# Header words.
(H_MAGIC, H_VERSION, H_META_BYTES, H_NUM_BLOCKS, H_BLOCK_BYTES, H_MAX_ITEMS, H_MAX_KEY,
 H_MAX_PINS, H_BUCKETS, H_DIRTY, H_RECOVERIES, H_TICK, H_GEN, H_LRU_HEAD, H_LRU_TAIL,
 H_SLOT_FREE, H_PIN_FREE, H_FREE_BLOCKS, H_EVICTABLE, H_ITEMS, H_READY_ITEMS, H_READY_BYTES,
 H_MASK, H_HITS, H_MISSES, H_EVICTIONS, H_STORED, H_BYTES_STORED, H_BYTES_EVICTED,
 H_RESERVE_FAILURES, H_READY_BLOCKS, H_LOCK_DEATHS) = range(32)  # fmt: skip
MUTEX_AT = 256  # byte offset of the mutex: a 64-byte slot, 64-byte aligned (words 32..39)
MUTEX_SLOT = 64
H_BOOT = 40  # two words: the boot id the mutex was initialised in
H_CLASSES = 64  # 64 heads of the free-extent size-class lists
NUM_CLASSES = 64

# Slot words (state FREE, WRITING, READY), by cache line: what a hit, a pin and an
# unpin read and write; what a key search and a reservation do; shape and dtype.
(S_STATE, S_GEN, S_PREV, S_NEXT, S_TICK, S_PINS, S_PIN_HEAD, S_BLOCKS,
 S_HNEXT, S_HASH, S_KLEN, S_NBYTES, S_EXT, S_CRC, S_PID, S_START, S_NDIM) = range(17)  # fmt: skip
S_DIMS = 17  # MAX_DIMS words
S_DTYPE = 25  # DTYPE_BYTES bytes
FREE, WRITING, READY = 0, 1, 2
_STATE = {WRITING: ItemState.WRITING, READY: ItemState.READY}
_WRITING, _READY = ItemState.WRITING, ItemState.READY
_DTYPES: dict[str, tuple[str, int, int]] = {}  # dtype name -> (name, its two slot words)

P_SLOT, P_NEXT, P_PID, P_START, P_COUNT = range(PIN_WORDS)

_forks = [0]  # bumped in every forked child: a catalog object then learns its pid again
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))

# sizeof(pthread_mutex_t), which no run-time interface reports: glibc's per
# machine (musl's is 40 on every 64-bit machine). Every one fits MUTEX_SLOT.
_MUTEX_BYTES = {"x86_64": 40, "aarch64": 48, "ppc64le": 40, "s390x": 40, "riscv64": 40}
assert max(_MUTEX_BYTES.values()) <= MUTEX_SLOT
_PTHREAD_PROCESS_SHARED, _PTHREAD_MUTEX_ROBUST, _PTHREAD_MUTEX_ERRORCHECK = 1, 1, 2
_FUTEX_TID_MASK = 0x3FFFFFFF  # the owner's thread id in a robust futex word (kernel ABI)
_GLIBC = platform.libc_ver()[0] == "glibc"
_WAIT_SLICE_S = 0.2  # a blocked locker returns to Python this often (signals, warnings)
_WAIT_WARN_S = 10.0  # then every minute


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _pthread(lib_type):
    """The pthread functions of the C library, called through ``lib_type``: PyDLL
    (keeps the GIL: for calls that never block) or CDLL (releases it)."""
    for name in (None, "libc.so.6", "libpthread.so.0"):
        try:
            lib = lib_type(name)
            lib.pthread_mutex_consistent  # noqa: B018 - present since glibc 2.12
        except (OSError, AttributeError):
            continue
        void_p = [ctypes.c_void_p]
        # The hot pair, trylock and unlock, goes without argtypes (a tenth cheaper a
        # call): every caller passes the mutex as a c_void_p.
        for fn, args in (("pthread_mutex_consistent", void_p), ("pthread_mutex_init", void_p * 2),
                         ("pthread_mutexattr_init", void_p),
                         ("pthread_mutexattr_destroy", void_p),
                         ("pthread_mutexattr_setpshared", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutexattr_setrobust", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutexattr_settype", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutex_timedlock",
                          [ctypes.c_void_p, ctypes.POINTER(_Timespec)])):  # fmt: skip
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    return None


_PT = _pthread(ctypes.PyDLL)  # trylock, unlock, consistent, init: never block
_PT_WAIT = _pthread(ctypes.CDLL)  # timedlock: blocks, so the GIL is released
if _PT is not None:
    _trylock, _unlock = _PT.pthread_mutex_trylock, _PT.pthread_mutex_unlock

#: Tests set this to a callable that receives the name of each point inside a
#: locked update (it may sleep or SIGKILL the process there).
fault_hook: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    """A fault point (hot paths test ``fault_hook`` inline instead: a call costs)."""
    if fault_hook is not None:
        fault_hook(point)


@dataclass(frozen=True)
class Layout:
    """Sizes and byte offsets (from the region's start) of a shared catalog."""

    num_blocks: int
    block_bytes: int
    max_items: int
    max_key_bytes: int
    max_pins: int
    buckets: int = field(init=False)
    buckets_at: int = field(init=False)
    slots_at: int = field(init=False)
    keys_at: int = field(init=False)
    pins_at: int = field(init=False)
    blocks_at: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "buckets", 1 << max(0, self.max_items - 1).bit_length())
        at = HEADER_BYTES
        set_(self, "buckets_at", at)
        at += 8 * self.buckets
        set_(self, "slots_at", at)
        at += 8 * SLOT_WORDS * self.max_items
        set_(self, "keys_at", at)
        at += -(-self.max_key_bytes * self.max_items // 8) * 8
        set_(self, "pins_at", at)
        at += 8 * PIN_WORDS * self.max_pins
        set_(self, "blocks_at", at)
        at += 4 * 6 * self.num_blocks
        set_(self, "nbytes", -(-at // mmap.PAGESIZE) * mmap.PAGESIZE)


def meta_bytes(
    num_blocks: int,
    block_bytes: int,
    max_items: int | None = None,
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
    max_pins: int | None = None,
) -> int:
    """Bytes of the metadata region for these sizes (page aligned).

    Defaults: ``max_items = num_blocks`` (every item owns at least one block),
    ``max_pins = max_items``.
    """
    return _layout(num_blocks, block_bytes, max_items, max_key_bytes, max_pins).nbytes


def _layout(num_blocks, block_bytes, max_items, max_key_bytes, max_pins) -> Layout:
    max_items = num_blocks if max_items is None else max_items
    max_pins = max(64, max_items) if max_pins is None else max_pins
    for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes),
                        ("max_items", max_items), ("max_key_bytes", max_key_bytes),
                        ("max_pins", max_pins)):  # fmt: skip
        if not isinstance(value, int) or value <= 0:
            raise InvalidSizeError(f"{name} must be a positive int, got {value!r}")
    if num_blocks >= 1 << 31:
        raise InvalidSizeError(f"num_blocks must be below 2**31, got {num_blocks}")
    return Layout(num_blocks, block_bytes, max_items, max_key_bytes, max_pins)


def process_start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc), or None if it is gone.

    The same reading as ``arena.process_start_time``, here so that this module
    stays torch-free.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        return None
    return int(line.rsplit(b")", 1)[1].split()[19])


def _boot_id() -> tuple[int, int]:
    """This boot's id (/proc/sys/kernel/random/boot_id) as two int64 words; (0, 0) if none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = bytes.fromhex(f.read().strip().replace(b"-", b"").decode())
    except (OSError, ValueError):
        return (0, 0)
    return struct.unpack("<qq", raw[:16].ljust(16, b"\0"))


def _alive(pid: int, start: int, cache: dict | None = None) -> bool:
    if cache is not None and (pid, start) in cache:
        return cache[pid, start]
    now = process_start_time(pid)
    alive = now is not None and now == start
    if cache is not None:
        cache[pid, start] = alive
    return alive


@dataclass
class SharedEntry(Entry):
    """An :class:`Entry` snapshot, plus the reservation's slot and generation and
    the process that reserved it (pid, start time): who produced the item."""

    slot: int = -1
    generation: int = 0
    producer: tuple[int, int] = (0, 0)  # (pid, start time) of the reserving process


class _AllocatorView:
    """The part of :class:`BlockAllocator` callers read (``catalog.allocator.*``)."""

    def __init__(self, catalog: SharedCatalog) -> None:
        self._c = catalog
        self.num_blocks = catalog.layout.num_blocks
        self.block_bytes = catalog.layout.block_bytes

    @property
    def free_blocks(self) -> int:
        return self._c._w[H_FREE_BLOCKS]

    @property
    def largest_free_extent(self) -> int:
        return self._c.stats().largest_free_extent

    @property
    def ready_blocks(self) -> int:
        """The catalog's ready watermark: blocks below it may be handed out."""
        return self._c._w[H_READY_BLOCKS]

    def add_ready(self, ready_blocks: int) -> int:
        return self._c.add_ready(ready_blocks)

    def blocks_for(self, nbytes: int) -> int:
        return self._c._blocks_for(nbytes)

    def check(self) -> None:
        self._c.check()


class SharedCatalog:
    """The catalog of an arena, in a metadata region of the arena file itself.

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
        if _PT is None:
            raise CatalogLockError(
                "the C library offers no robust process-shared pthread mutex "
                "(pthread_mutex_consistent): the shared catalog needs glibc or musl on Linux"
            )
        self.path = path or f"fd {fd}"
        self._fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        self._region = (offset, size)
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, offset=offset)
        self._w = memoryview(self._mm).cast("q")
        if size < HEADER_BYTES:
            self.close()
            raise InvalidSizeError(f"the catalog region must hold its {HEADER_BYTES}-byte "
                                   f"header, got {size} bytes")  # fmt: skip
        at = ctypes.c_char.from_buffer(self._mm, MUTEX_AT)
        self._mx = ctypes.c_void_p(ctypes.addressof(at))  # valid while the map is
        del at  # (a live export would keep the map from closing)
        self._identify()
        self._seen: dict[str, SharedEntry] = {}  # key -> this object's entry of it
        self._last_reap = 0.0
        self.local = CatalogStats()  # this object's own hits and misses
        wanted = (num_blocks, block_bytes, max_items, max_key_bytes, max_pins)
        byte0 = struct.Struct("hhqqi4x")  # struct flock: the region's first byte
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW,
                    byte0.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))  # fmt: skip
        try:
            if self._w[H_MAGIC] != MAGIC:
                if num_blocks is None or block_bytes is None:
                    raise ArenaLayoutMismatch(self.path, "catalog magic", MAGIC, self._w[H_MAGIC])
                layout = _layout(num_blocks, block_bytes, max_items,
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
            boot = _boot_id()
            if (self._w[H_BOOT], self._w[H_BOOT + 1]) != boot:
                # Every process of this boot that used the mutex opened the file first
                # (and recorded this boot): nobody holds it. Dirty, if set, stays set.
                log.info("catalog %s: its lock is from another boot; initialising it afresh",
                         self.path)  # fmt: skip
                self._init_mutex()
                self._w[H_BOOT], self._w[H_BOOT + 1] = boot
            self._lock()
            try:
                if self._w[H_DIRTY]:
                    self._recover()
                else:
                    self._w[H_DIRTY] = self._pid
                    self._reap(force=True)
                    self._w[H_DIRTY] = 0
            finally:
                self._unlock()
        except BaseException:
            self.close()
            raise
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK,
                    byte0.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))  # fmt: skip
        self.allocator = _AllocatorView(self)

    @classmethod
    def for_arena(cls, arena, **layout) -> SharedCatalog:
        """The catalog in ``arena``'s metadata region (see ``Arena.create(meta_bytes=)``)."""
        if not arena.meta_bytes:
            raise InvalidSizeError(
                f"arena {arena.path} has no metadata region: create it with "
                "meta_bytes=shared_catalog.meta_bytes(...)"
            )
        layout.setdefault("ready_blocks", arena.ready_blocks)
        return cls(arena.fileno(), arena.meta_offset, arena.meta_bytes,
                   num_blocks=arena.num_blocks, block_bytes=arena.block_bytes,
                   path=arena.path, **layout)  # fmt: skip

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
        for name in ("_fs", "_fe", "_fn", "_fp", "_ec", "_en", "_mx"):
            self.__dict__.pop(name, None)  # a later call fails on the name, never the address
        self._mm.close()
        self._mm = None
        os.close(self._fd)

    def __enter__(self) -> SharedCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self.close()

    def _identify(self) -> None:
        """Who this process is (pid, start time), for dirty marks, pins and reservations:
        at first use and again in a forked child (the mutex needs no new descriptor)."""
        self._forked = _forks[0]
        pid = os.getpid()
        self._pid, self._start = pid, process_start_time(pid) or 0

    def _lock(self) -> None:
        """Take the catalog's mutex for this thread (no recovery: see :meth:`_begin`)."""
        if _forks[0] != self._forked:
            self._identify()
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)

    def _lock_slow(self, rc: int) -> None:
        """The mutex was held (EBUSY: wait for it) or its holder died (EOWNERDEAD: make
        it consistent, count the death); anything else raises CatalogLockError."""
        mx, t0 = self._mx, time.monotonic()
        warn_at = t0 + _WAIT_WARN_S
        try:
            while rc == errno.EBUSY or rc == errno.ETIMEDOUT:
                until = time.time() + _WAIT_SLICE_S
                rc = _PT_WAIT.pthread_mutex_timedlock(
                    mx, _Timespec(int(until), int(until % 1 * 1e9)))  # fmt: skip
                if rc == errno.ETIMEDOUT and time.monotonic() >= warn_at:
                    warn_at += 60
                    log.warning(
                        "catalog %s: waiting %.0f s for its lock; a process holds it without "
                        "releasing it (stopped, or stuck inside an update?)",
                        self.path, time.monotonic() - t0,
                    )  # fmt: skip
            if rc == errno.EOWNERDEAD:
                # At once, before anything can raise: an unlock before this would make
                # the mutex unrecoverable for every process. The data's state is
                # dirty's business: the caller recovers if the holder died inside an update.
                _PT.pthread_mutex_consistent(mx)
                rc = 0
                self._w[H_LOCK_DEATHS] += 1
                log.warning(
                    "catalog %s: its lock's holder (a process or thread) died holding it (%s); "
                    "taken over", self.path,
                    "inside an update: rebuilding" if self._w[H_DIRTY] else "no update pending",
                )  # fmt: skip
        except BaseException:  # rc is always the last call's: held if 0 or EOWNERDEAD
            if rc == errno.EOWNERDEAD:
                _PT.pthread_mutex_consistent(mx)
            if rc == 0 or rc == errno.EOWNERDEAD:
                _unlock(mx)
            raise
        if rc == 0:
            return
        if rc == errno.ENOTRECOVERABLE:
            # glibc's trylock returns this with the futex word still naming this thread
            # (its CAS succeeded; the mutex is on no robust list): clear it, or every
            # other locker would wait forever instead of hearing the same.
            word = MUTEX_AT // 8  # glibc: int __lock, then int __count
            if _GLIBC and self._w[word] & _FUTEX_TID_MASK == threading.get_native_id():
                self._w[word] = 0
            raise CatalogLockError(
                f"catalog {self.path}: its lock is unrecoverable (a process released it after "
                "its holder died without marking it consistent, which ecoffload never "
                "does): stop every process using this arena, then remove the file (a "
                "persistent arena: Arena.remove_shared) and start again"
            )
        if rc == errno.EDEADLK:
            raise CatalogLockError(
                f"catalog {self.path}: this thread already holds its lock (a catalog call "
                "from inside another, e.g. from a fault hook or signal handler, or through "
                "a second catalog object of the same file)"
            )
        raise CatalogLockError(
            f"catalog {self.path}: pthread_mutex_timedlock failed with "
            f"{errno.errorcode.get(rc, rc)}: {os.strerror(rc)}"
        )

    def _unlock(self) -> None:
        if _unlock(self._mx):
            self._unlock_failed()

    def _unlock_failed(self) -> None:
        raise CatalogLockError(
            f"catalog {self.path}: this thread released a lock it does not hold (a bug)"
        )

    def _init_mutex(self) -> None:
        """(Re)initialise the mutex: process-shared, robust, error-checking (open lock held)."""
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 or 8 bytes
        pt, mx = _PT, self._mx
        for what, call in (
            ("mutexattr_init", lambda: pt.pthread_mutexattr_init(attr)),
            ("mutexattr_setpshared",
             lambda: pt.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)),
            ("mutexattr_setrobust",
             lambda: pt.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)),
            ("mutexattr_settype",
             lambda: pt.pthread_mutexattr_settype(attr, _PTHREAD_MUTEX_ERRORCHECK)),
            ("mutex_init", lambda: pt.pthread_mutex_init(mx, attr)),
        ):  # fmt: skip
            rc = call()
            if rc:
                raise CatalogLockError(
                    f"catalog {self.path}: pthread_{what} failed with {os.strerror(rc)}: "
                    "the shared catalog needs robust process-shared mutexes (Linux, glibc "
                    "or musl)"
                )
        pt.pthread_mutexattr_destroy(attr)

    def _begin(self) -> memoryview:
        """Lock for an update (recover first if the last updater died inside one);
        the header and slot words."""
        if _forks[0] != self._forked:
            self._identify()
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)
        w = self._w
        if w[H_DIRTY]:
            try:
                self._recover()
            except BaseException:
                self._unlock()
                raise
        w[H_DIRTY] = self._pid
        return w

    def _lock_clean(self) -> None:
        """Lock for reading: recover first if the last updater died inside an update."""
        self._lock()
        if self._w[H_DIRTY]:
            try:
                self._recover()
            except BaseException:
                self._unlock()
                raise

    def _end(self, clean: bool = True) -> None:
        if clean:
            self._w[H_DIRTY] = 0
        if _unlock(self._mx):
            self._unlock_failed()

    def _format(self, lay: Layout, ready_blocks: int) -> None:
        w = memoryview(self._mm).cast("q")
        try:
            w[H_MAGIC] = 0
            self._mm[: lay.nbytes] = bytes(lay.nbytes)
            for i, v in ((H_VERSION, VERSION), (H_META_BYTES, lay.nbytes),
                         (H_NUM_BLOCKS, lay.num_blocks), (H_BLOCK_BYTES, lay.block_bytes),
                         (H_MAX_ITEMS, lay.max_items), (H_MAX_KEY, lay.max_key_bytes),
                         (H_MAX_PINS, lay.max_pins), (H_BUCKETS, lay.buckets),
                         (H_READY_BLOCKS, max(0, min(ready_blocks, lay.num_blocks)))):  # fmt: skip
                w[i] = v
            w[H_DIRTY] = self._pid  # formatted by the recovery below
            w[H_BOOT], w[H_BOOT + 1] = _boot_id()
            self._init_mutex()
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
        self._i = memoryview(self._mm)[lay.blocks_at : lay.blocks_at + 24 * n].cast("i")
        self._k = memoryview(self._mm)[lay.keys_at : lay.pins_at]
        # Per-block int32 arrays are offsets into one view: count/next of item
        # extents, free size at start / free start at end / next / prev.
        self._ec, self._en, self._fs, self._fe, self._fn, self._fp = (k * n for k in range(6))
        self._bk = lay.buckets_at // 8
        self._sl = lay.slots_at // 8
        self._pn = lay.pins_at // 8
        self._mkey = lay.max_key_bytes
        self._hmask = lay.buckets - 1

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

    @staticmethod
    def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            return ()
        dims = tuple(int(d) for d in shape)
        if len(dims) > MAX_DIMS:
            raise CatalogCapacityError(
                f"shape {dims}: at most {MAX_DIMS} dimensions fit a shared catalog entry"
            )
        return dims

    @staticmethod
    def _dtype_words(dtype: object) -> tuple[str, int, int]:  # (name, word, word)
        """The dtype's name and its two words in a slot (cached: a handful of dtypes)."""
        name = dtype if type(dtype) is str else str(dtype)
        got = _DTYPES.get(name)
        if got is None:
            dt = name.encode()
            if len(dt) > DTYPE_BYTES:
                raise CatalogCapacityError(
                    f"dtype {dtype!r}: a dtype name of at most {DTYPE_BYTES} bytes fits a "
                    "shared catalog entry"
                )
            if len(_DTYPES) >= 64:
                _DTYPES.clear()
            got = _DTYPES[name] = (name, *struct.unpack("<qq", dt.ljust(DTYPE_BYTES, b"\0")))
        return got

    def _blocks_for(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidSizeError(
                f"item size must be a positive int number of bytes, got {nbytes!r}"
            )
        lay = self.layout
        need = blocks_for(nbytes, lay.block_bytes)
        if need > lay.num_blocks:
            raise ItemTooLargeError(
                f"item of {nbytes} bytes needs {need} blocks of {lay.block_bytes} bytes, "
                f"the arena has {lay.num_blocks} in all: give the arena more bytes "
                "or do not offload items this large"
            )
        return need

    def _find(self, kb: bytes, h: int) -> int:
        w, k, mk, sl = self._w, self._k, self._mkey, self._sl
        s = w[self._bk + (h & self._hmask)]
        n = len(kb)
        while s >= 0:
            b = sl + s * SLOT_WORDS
            if w[b + S_HASH] == h and w[b + S_KLEN] == n and k[s * mk : s * mk + n] == kb:
                return s
            s = w[b + S_HNEXT]
        return -1

    def _slot_of(self, key: str) -> int:
        """The slot holding ``key`` or -1. The entry of a key seen before names its slot
        and generation (unique per reservation), so a repeated key costs no hashing or
        key compare; a key found in the table is seen from then on."""
        w = self._w
        entry = self._seen.get(key)
        if entry is not None:
            b = self._sl + entry.slot * SLOT_WORDS
            if w[b + S_GEN] == entry.generation and w[b + S_STATE] != FREE:
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
        if key is None:
            mk = self._mkey
            key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]]).decode()
        entry = self._seen.get(key)
        if entry is not None and (entry.slot != s or entry.generation != gen):
            entry = None  # an earlier reservation of the key
        if state == READY and entry is not None and entry.state is _READY:
            entry.pins = w[b + S_PINS]  # nothing else of a READY item ever changes
            return entry
        # Rebuilt when new, or first seen READY (commit may set dtype and shape).
        if entry is None or (entry.state is _WRITING and state == READY):
            i, en = self._i, self._en
            extents, e = [], w[b + S_EXT]
            while e >= 0:
                extents.append(Extent(e, i[self._ec + e]))
                e = i[en + e]
            shape = tuple(w[b + S_DIMS : b + S_DIMS + w[b + S_NDIM]])
            dtype = bytes(self._w[b + S_DTYPE : b + S_DTYPE + 2].cast("B")).rstrip(b"\0").decode()
            producer = (w[b + S_PID], w[b + S_START])
            entry = SharedEntry(key, extents, w[b + S_NBYTES], dtype, shape, slot=s,
                                generation=gen, producer=producer)  # fmt: skip
            self._remember(key, entry)
        crc = w[b + S_CRC]
        entry.state = _STATE[state]
        entry.pins = w[b + S_PINS]
        entry.checksum = None if crc < 0 else crc
        return entry

    def _remember(self, key: str, entry: SharedEntry) -> None:
        if len(self._seen) >= self.layout.max_items and key not in self._seen:
            self._seen.clear()  # bounded: the keys of evicted items go too
        self._seen[key] = entry

    def state(self, key: str) -> ItemState | None:
        """The state of ``key``, or None if the catalog does not hold it."""
        self._lock_clean()
        try:
            s = self._slot_of(key)
            return None if s < 0 else _STATE[self._w[self._sl + s * SLOT_WORDS + S_STATE]]
        finally:
            self._unlock()

    def entry(self, key: str) -> SharedEntry:
        """A snapshot of the entry of ``key`` in any state (raises UnknownItemError)."""
        self._lock_clean()
        try:
            return self._snapshot(self._expect(key, None, "entry"), key)
        finally:
            self._unlock()

    def entries(self) -> list[SharedEntry]:
        """Snapshots of every entry, in slot order."""
        self._lock_clean()
        try:
            w, sl = self._w, self._sl
            return [
                self._snapshot(s)
                for s in range(self.layout.max_items)
                if w[sl + s * SLOT_WORDS + S_STATE] != FREE
            ]
        finally:
            self._unlock()

    def _expect(self, key: str, state: int | None, op: str) -> int:
        s = self._slot_of(key)
        if s < 0:
            raise UnknownItemError(
                f"key {key!r} is not in the catalog (never reserved, aborted or evicted)"
            )
        found = self._w[self._sl + s * SLOT_WORDS + S_STATE]
        if state is not None and found != state:
            raise ItemStateError(
                f"{op}({key!r}) needs an item in state {_STATE[state].value!r}, "
                f"found {_STATE[found].value!r}"
            )
        return s

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
        dims = self._dims(shape)
        dt_name, dt0, dt1 = self._dtype_words(dtype)
        need = self._blocks_for(nbytes)
        h = zlib.crc32(kb)
        w = self._begin()
        try:
            s = self._find(kb, h)
            if s >= 0:
                raise DuplicateItemError(
                    f"key {key!r} is already in the catalog "
                    f"({_STATE[w[self._sl + s * SLOT_WORDS + S_STATE]].value}); "
                    "look it up instead of saving it again, or evict it first"
                )
            if not self._make_room(need):
                w[H_RESERVE_FAILURES] += 1
                self._end()
                return None
            extents = self._alloc(need)
            s = w[H_SLOT_FREE]
            b = self._sl + s * SLOT_WORDS
            w[H_SLOT_FREE] = w[b + S_HNEXT]
            if fault_hook is not None:
                fault_hook("reserve:allocated")
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
            if fault_hook is not None:
                fault_hook("reserve:written")
            w[b + S_STATE] = WRITING  # the slot exists from here on
            if fault_hook is not None:
                fault_hook("reserve:published")
            bucket = self._bk + (h & self._hmask)
            w[b + S_HNEXT] = w[bucket]
            w[bucket] = s
            w[H_ITEMS] += 1
            # What _snapshot would decode, without decoding it.
            entry = SharedEntry(key, extents, nbytes, dt_name, dims, slot=s, generation=gen,
                                producer=(pid, start))  # fmt: skip
            self._remember(key, entry)
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()
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
        dims = self._dims(shape) if shape is not None else None
        dt = self._dtype_words(dtype) if dtype is not None else None
        crc = -1 if checksum is None else checksum
        w = self._begin()
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
            if fault_hook is not None:
                fault_hook("commit:written")
            w[b + S_STATE] = READY
            if fault_hook is not None:
                fault_hook("commit:published")
            self._lru_append(s)
            blocks, nbytes = w[b + S_BLOCKS], w[b + S_NBYTES]
            w[H_EVICTABLE] += blocks
            w[H_READY_ITEMS] += 1
            w[H_READY_BYTES] += nbytes
            w[H_STORED] += 1
            w[H_BYTES_STORED] += nbytes
            entry = self._seen.get(key)
            if entry is not None and entry.slot == s and entry.generation == gen and (
                entry.state is _WRITING
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
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()
        return entry

    def abort(self, key: str, *, generation: int | None = None) -> None:
        """WRITING -> gone: the save failed or was cancelled; free its blocks.

        ``generation`` (from the reserving entry) refuses to abort a newer
        reservation of the same key, as in :meth:`commit`.
        """
        self._begin()
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
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()

    def lookup(self, key: str, *, pin: bool = False) -> SharedEntry | None:
        """The READY entry of ``key`` (now most recently used), or None; counts hit/miss.

        ``pin=True`` also pins a hit under the same lock (one round trip instead
        of :meth:`lookup` then :meth:`pin`, between which another process could
        evict it).
        """
        if _forks[0] != self._forked:  # the hot path: _begin and _end inlined
            self._identify()
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)
        w = self._w
        try:
            if w[H_DIRTY]:
                self._recover()
            entry = self._seen.get(key)
            if entry is not None:  # seen READY: still the same reservation, still READY?
                s = entry.slot
                b = self._sl + s * SLOT_WORDS
                if entry.state is not _READY or w[b + S_GEN] != entry.generation or (
                    w[b + S_STATE] != READY
                ):
                    entry = None
            if entry is None:  # ask the table
                s = self._slot_of(key)
                b = self._sl + s * SLOT_WORDS
                if s >= 0 and w[b + S_STATE] == READY:
                    entry = self._snapshot(s, key)
            if entry is None:
                w[H_MISSES] += 1
                self.local.misses += 1
            else:
                w[H_HITS] += 1
                self.local.hits += 1
                tick = w[H_TICK] + 1
                w[H_TICK] = tick
                w[b + S_TICK] = tick
                tail = w[H_LRU_TAIL]
                if tail != s or pin:
                    w[H_DIRTY] = self._pid
                    if tail != s:  # to the LRU tail: s has a successor
                        sl, prev, nxt = self._sl, w[b + S_PREV], w[b + S_NEXT]
                        if prev >= 0:
                            w[sl + prev * SLOT_WORDS + S_NEXT] = nxt
                        else:
                            w[H_LRU_HEAD] = nxt
                        w[sl + nxt * SLOT_WORDS + S_PREV] = prev
                        w[b + S_PREV] = tail
                        w[b + S_NEXT] = -1
                        w[sl + tail * SLOT_WORDS + S_NEXT] = s
                        w[H_LRU_TAIL] = s
                    if pin:
                        self._pin_slot(s, key)
                    w[H_DIRTY] = 0
                entry.pins = w[b + S_PINS]
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        if _unlock(self._mx):
            self._unlock_failed()
        return entry

    def pin(self, key: str) -> SharedEntry:
        """Protect a READY item from eviction (e.g. while it is being loaded); nests.

        The pin belongs to this process: dropped if it dies before unpinning.
        """
        if _forks[0] != self._forked:  # a hot path: _begin, _ready and _end inlined
            self._identify()
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)
        w = self._w
        try:
            if w[H_DIRTY]:
                self._recover()
            w[H_DIRTY] = self._pid
            entry = self._seen.get(key)
            if entry is not None:
                s = entry.slot
                b = self._sl + s * SLOT_WORDS
                if entry.state is not _READY or w[b + S_GEN] != entry.generation or (
                    w[b + S_STATE] != READY
                ):
                    entry = None
            if entry is None:
                s = self._expect(key, READY, "pin")
                b = self._sl + s * SLOT_WORDS
                entry = self._snapshot(s, key)
            entry.pins = self._pin_slot(s, key)
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        w[H_DIRTY] = 0
        if _unlock(self._mx):
            self._unlock_failed()
        return entry

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of this process."""
        if _forks[0] != self._forked:  # a hot path: _begin, _ready and _end inlined
            self._identify()
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)
        w = self._w
        try:
            if w[H_DIRTY]:
                self._recover()
            w[H_DIRTY] = self._pid
            entry = self._seen.get(key)
            s = -1 if entry is None else entry.slot
            b = self._sl + s * SLOT_WORDS
            if s < 0 or w[b + S_GEN] != entry.generation or w[b + S_STATE] != READY:
                s = self._expect(key, READY, "unpin")
                b = self._sl + s * SLOT_WORDS
            pn, pid, start = self._pn, self._pid, self._start
            r = w[b + S_PIN_HEAD]
            while r >= 0:  # this process's record (_my_pin, inlined)
                p = pn + r * PIN_WORDS
                if w[p + P_PID] == pid and w[p + P_START] == start:
                    break
                r = w[p + P_NEXT]
            if r < 0:
                raise self._not_pinned(key, s, 0)
            self._unpin_slot(s, r)
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        w[H_DIRTY] = 0
        if _unlock(self._mx):
            self._unlock_failed()

    def pin_many(self, keys: list[str]) -> list[SharedEntry]:
        """:meth:`pin` every key under one lock: all of them, or none (and the error)."""
        self._begin()
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
                    self._unpin_slot(s, self._my_pin(s))
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()
        return entries

    def unpin_many(self, keys: list[str]) -> None:
        """:meth:`unpin` every key under one lock: all of them, or none (and the error)."""
        self._begin()
        try:
            slots = [self._expect(key, READY, "unpin") for key in keys]
            mine: dict[int, int] = {}
            for key, s in zip(keys, slots, strict=True):  # enough pins of ours for all?
                r = self._my_pin(s)
                count = 0 if r < 0 else self._w[self._pn + r * PIN_WORDS + P_COUNT]
                mine[s] = mine.get(s, 0) + 1
                if mine[s] > count:
                    raise self._not_pinned(key, s, count)
            for s in slots:
                self._unpin_slot(s, self._my_pin(s))
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()

    def _pin_slot(self, s: int, key: str) -> int:
        """One more pin of READY slot ``s`` by this process (lock held, dirty set); the
        item's pins now."""
        w, b, pn = self._w, self._sl + s * SLOT_WORDS, self._pn
        pid, start = self._pid, self._start
        head = r = w[b + S_PIN_HEAD]
        while r >= 0:  # this process's record, if it pins the item already
            p = pn + r * PIN_WORDS
            if w[p + P_PID] == pid and w[p + P_START] == start:
                break
            r = w[p + P_NEXT]
        if r < 0:
            r = w[H_PIN_FREE]
            if r < 0 and self._reap(force=True):
                r = w[H_PIN_FREE]
                head = w[b + S_PIN_HEAD]  # the reap unlinked dead processes' records
            if r < 0:
                raise CatalogCapacityError(
                    f"pin({key!r}): all {self.layout.max_pins} pin records are in use; "
                    "create the catalog with a larger max_pins"
                )
            p = pn + r * PIN_WORDS
            w[H_PIN_FREE] = w[p + P_NEXT]
            w[p + P_SLOT] = s
            w[p + P_PID] = pid
            w[p + P_START] = start
            w[p + P_NEXT] = head
            w[b + S_PIN_HEAD] = r
            if fault_hook is not None:
                fault_hook("pin:record")
            w[p + P_COUNT] = 1  # a free record's count is 0
        else:
            if fault_hook is not None:
                fault_hook("pin:record")
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
        if fault_hook is not None:
            fault_hook("unpin:record")
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

    def _not_pinned(self, key: str, s: int, mine: int) -> ItemStateError:
        others = self._w[self._sl + s * SLOT_WORDS + S_PINS] - mine
        return ItemStateError(
            f"unpin({key!r}): the item is not pinned"
            + (f" by this process (others hold {others} pin(s))" if others else "")
            + "; every unpin must match one pin"
        )

    def evict(self, key: str) -> None:
        """Drop a READY, unpinned item now."""
        self._begin()
        try:
            s = self._expect(key, READY, "evict")
            pins = self._w[self._sl + s * SLOT_WORDS + S_PINS]
            if pins:
                raise ItemStateError(
                    f"evict({key!r}): the item is pinned {pins} time(s); unpin it first"
                )
            self._drop(s, evicted=True)
        except BaseException as exc:
            self._end(isinstance(exc, CatalogError))
            raise
        self._end()

    def reap(self) -> int:
        """Abort reservations and drop pins of processes that are gone; how many."""
        self._begin()
        try:
            n = self._reap(force=True)
        except BaseException:
            self._end(False)
            raise
        self._end()
        return n

    def recover(self) -> None:
        """Rebuild every derived structure from the slot table (what a locker does
        on its own when it finds the catalog dirty)."""
        self._lock()
        try:
            self._recover()
        finally:
            self._unlock()

    def add_ready(self, ready_blocks: int) -> int:
        """Blocks ``[0, ready_blocks)`` are pre-faulted: raise the ready watermark and
        free the newly ready blocks (coalescing with a free tail).

        Monotonic and idempotent (a lower or equal value changes nothing, without
        taking the lock); returns how many blocks became ready.
        """
        new = min(int(ready_blocks), self.layout.num_blocks)
        if new <= self._w[H_READY_BLOCKS]:  # the common case, lock-free: it only grows
            return 0
        self._begin()
        try:
            w = self._w
            old = w[H_READY_BLOCKS]
            added = max(0, new - old)
            if added:
                self._free_extent(old, added)  # derived first: recovery trusts the watermark
                _fault("add_ready:freed")
                w[H_READY_BLOCKS] = new
        except BaseException:
            self._end(False)
            raise
        self._end()
        return added

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

    def stats(self) -> CatalogStats:
        """The host-wide counters (every process of every instance); see :attr:`local`."""
        self._lock_clean()
        try:
            w = self._w
            largest = 0
            if w[H_MASK]:
                j = w[H_MASK].bit_length() - 1
                r = w[H_CLASSES + j]
                while r >= 0:
                    largest = max(largest, self._i[self._fs + r])
                    r = self._i[self._fn + r]
            return CatalogStats(
                hits=w[H_HITS], misses=w[H_MISSES], evictions=w[H_EVICTIONS],
                items_stored=w[H_STORED], bytes_stored=w[H_BYTES_STORED],
                bytes_evicted=w[H_BYTES_EVICTED], reserve_failures=w[H_RESERVE_FAILURES],
                items_resident=w[H_READY_ITEMS], bytes_resident=w[H_READY_BYTES],
                free_blocks=w[H_FREE_BLOCKS], largest_free_extent=largest,
                ready_blocks=w[H_READY_BLOCKS],
            )  # fmt: skip
        finally:
            self._unlock()

    def _make_room(self, need: int) -> bool:
        """Evict LRU items until ``need`` blocks and one slot are free; False if impossible."""
        w = self._w
        if need <= w[H_FREE_BLOCKS] and w[H_SLOT_FREE] >= 0:
            return True
        if w[H_FREE_BLOCKS] + w[H_EVICTABLE] < need or (w[H_SLOT_FREE] < 0 and not w[H_EVICTABLE]):
            now = time.monotonic()
            if now - self._last_reap < 0.05 or not self._reap(force=True):
                self._last_reap = now
                return False
            self._last_reap = now
            if need <= w[H_FREE_BLOCKS] and w[H_SLOT_FREE] >= 0:
                return True
            if w[H_FREE_BLOCKS] + w[H_EVICTABLE] < need or (
                w[H_SLOT_FREE] < 0 and not w[H_EVICTABLE]
            ):
                return False
        sl = self._sl
        victims, room, slot_free = [], w[H_FREE_BLOCKS], w[H_SLOT_FREE] >= 0
        s = w[H_LRU_HEAD]
        while s >= 0 and (room < need or not slot_free):  # oldest first
            b = sl + s * SLOT_WORDS
            if w[b + S_PINS] == 0:
                victims.append(s)
                room += w[b + S_BLOCKS]
                slot_free = True
            s = w[b + S_NEXT]
        if room < need or not slot_free:
            return False
        for s in victims:
            self._drop(s, evicted=True)
        return True

    def _drop(self, s: int, *, evicted: bool) -> None:
        w, b = self._w, self._sl + s * SLOT_WORDS
        state = w[b + S_STATE]
        w[b + S_STATE] = FREE  # the truth first: the rest is derived
        if fault_hook is not None:
            fault_hook("drop:unpublished")
        h = w[b + S_HASH]
        bucket = self._bk + (h & self._hmask)
        prev, cur = -1, w[bucket]
        while cur != s:
            prev, cur = cur, w[self._sl + cur * SLOT_WORDS + S_HNEXT]
        if prev < 0:
            w[bucket] = w[b + S_HNEXT]
        else:
            w[self._sl + prev * SLOT_WORDS + S_HNEXT] = w[b + S_HNEXT]
        nbytes, blocks = w[b + S_NBYTES], w[b + S_BLOCKS]
        if state == READY:
            self._lru_unlink(s)
            w[H_EVICTABLE] -= blocks
            w[H_READY_ITEMS] -= 1
            w[H_READY_BYTES] -= nbytes
        i, e = self._i, w[b + S_EXT]
        while e >= 0:
            nxt = i[self._en + e]
            self._free_extent(e, i[self._ec + e])
            e = nxt
        w[b + S_HNEXT] = w[H_SLOT_FREE]
        w[H_SLOT_FREE] = s
        w[H_ITEMS] -= 1
        if evicted:
            w[H_EVICTIONS] += 1
            w[H_BYTES_EVICTED] += nbytes

    def _my_pin(self, s: int) -> int:
        w, pn, pid, start = self._w, self._pn, self._pid, self._start
        r = w[self._sl + s * SLOT_WORDS + S_PIN_HEAD]
        while r >= 0:
            p = pn + r * PIN_WORDS
            if w[p + P_PID] == pid and w[p + P_START] == start:
                return r
            r = w[p + P_NEXT]
        return -1

    def _unlink_pin(self, s: int, r: int) -> None:
        w, pn = self._w, self._pn
        head = self._sl + s * SLOT_WORDS + S_PIN_HEAD
        prev, cur = -1, w[head]
        while cur != r:
            prev, cur = cur, w[pn + cur * PIN_WORDS + P_NEXT]
        nxt = w[pn + r * PIN_WORDS + P_NEXT]
        if prev < 0:
            w[head] = nxt
        else:
            w[pn + prev * PIN_WORDS + P_NEXT] = nxt
        w[pn + r * PIN_WORDS + P_NEXT] = w[H_PIN_FREE]
        w[H_PIN_FREE] = r

    def _reap(self, *, force: bool) -> int:
        """Abort WRITING items and drop pins of dead processes (lock held, dirty set)."""
        w, sl, pn = self._w, self._sl, self._pn
        alive: dict = {}
        n = 0
        for s in range(self.layout.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == WRITING and not _alive(w[b + S_PID], w[b + S_START], alive):
                self._drop(s, evicted=False)
                n += 1
            elif state == READY and w[b + S_PINS]:
                r = w[b + S_PIN_HEAD]
                while r >= 0:
                    p = pn + r * PIN_WORDS
                    nxt = w[p + P_NEXT]
                    if not _alive(w[p + P_PID], w[p + P_START], alive):
                        count = w[p + P_COUNT]
                        w[p + P_COUNT] = 0
                        w[b + S_PINS] -= count
                        self._unlink_pin(s, r)
                        if w[b + S_PINS] == 0:
                            w[H_EVICTABLE] += w[b + S_BLOCKS]
                        n += 1
                    r = nxt
        return n

    def _lru_append(self, s: int) -> None:
        w, sl = self._w, self._sl
        b = sl + s * SLOT_WORDS
        tail = w[H_LRU_TAIL]
        w[b + S_PREV] = tail
        w[b + S_NEXT] = -1
        if tail >= 0:
            w[sl + tail * SLOT_WORDS + S_NEXT] = s
        else:
            w[H_LRU_HEAD] = s
        w[H_LRU_TAIL] = s

    def _lru_unlink(self, s: int) -> None:
        w, sl = self._w, self._sl
        b = sl + s * SLOT_WORDS
        prev, nxt = w[b + S_PREV], w[b + S_NEXT]
        if prev >= 0:
            w[sl + prev * SLOT_WORDS + S_NEXT] = nxt
        else:
            w[H_LRU_HEAD] = nxt
        if nxt >= 0:
            w[sl + nxt * SLOT_WORDS + S_PREV] = prev
        else:
            w[H_LRU_TAIL] = prev

    def _fl_insert(self, s: int, c: int) -> None:
        w, i = self._w, self._i
        i[self._fs + s] = c
        i[self._fe + s + c - 1] = s
        k = c.bit_length() - 1
        head = w[H_CLASSES + k]
        i[self._fn + s] = head
        i[self._fp + s] = -1
        if head >= 0:
            i[self._fp + head] = s
        w[H_CLASSES + k] = s
        w[H_MASK] |= 1 << k

    def _fl_remove(self, s: int) -> int:
        w, i = self._w, self._i
        c = i[self._fs + s]
        k = c.bit_length() - 1
        prev, nxt = i[self._fp + s], i[self._fn + s]
        if prev >= 0:
            i[self._fn + prev] = nxt
        else:
            w[H_CLASSES + k] = nxt
            if nxt < 0:
                w[H_MASK] &= ~(1 << k)
        if nxt >= 0:
            i[self._fp + nxt] = prev
        i[self._fs + s] = 0
        i[self._fe + s + c - 1] = -1
        return c

    def _free_extent(self, s: int, c: int) -> None:
        i, fs = self._i, self._fs
        self._w[H_FREE_BLOCKS] += c
        if s > 0:
            left = i[self._fe + s - 1]
            if left >= 0 and i[fs + left] > 0 and left + i[fs + left] == s:
                c += self._fl_remove(left)
                s = left
        end = s + c
        if end < self.layout.num_blocks and i[fs + end] > 0:
            c += self._fl_remove(end)
        self._fl_insert(s, c)

    def _alloc(self, need: int) -> list[Extent]:
        """Extents covering ``need`` blocks (the caller checked they are free)."""
        w, i, fs, fn = self._w, self._i, self._fs, self._fn
        k = need.bit_length() - 1
        mask = w[H_MASK]
        best, seen = -1, 0
        if mask >> k & 1:  # good fit among the first few of need's own class
            s = w[H_CLASSES + k]
            while s >= 0 and seen < 8:
                c = i[fs + s]
                if c >= need and (best < 0 or c < i[fs + best]):
                    best = s
                    if c == need:
                        break
                s = i[fn + s]
                seen += 1
        if best < 0:
            higher = mask >> (k + 1)
            if higher:  # any extent of a higher class is long enough
                best = w[H_CLASSES + k + 1 + (higher & -higher).bit_length() - 1]
        w[H_FREE_BLOCKS] -= need
        if best >= 0:
            c = self._fl_remove(best)
            if c > need:
                self._fl_insert(best + need, c - need)
            return [Extent(best, need)]
        extents = []
        while need:  # longest classes first
            s = w[H_CLASSES + w[H_MASK].bit_length() - 1]
            c = self._fl_remove(s)
            take = min(c, need)
            if c > take:
                self._fl_insert(s + take, c - take)
            extents.append(Extent(s, take))
            need -= take
        extents.sort()
        return extents

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
        alive: dict = {}
        ready: list[tuple[int, int]] = []
        i = self._i
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            if state == FREE:
                continue
            ok = state in (WRITING, READY) and 0 < w[b + S_KLEN] <= mk
            ok = ok and (state == READY or _alive(w[b + S_PID], w[b + S_START], alive))
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
        _fault("recover:slots")
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
                and _alive(w[p + P_PID], w[p + P_START], alive)
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
        per_block = np.frombuffer(self._mm, dtype=np.int32, count=6 * n,
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
        _fault("recover:done")
        w[H_DIRTY] = 0

    def check(self) -> None:
        """Assert every invariant of the shared structures (used by tests)."""
        self._lock()
        try:
            self._check()
        finally:
            self._unlock()

    def _check(self) -> None:
        w, lay, sl, pn, i = self._w, self.layout, self._sl, self._pn, self._i
        n, mk = lay.num_blocks, self._mkey
        assert w[H_DIRTY] == 0, "catalog left dirty"
        wm = w[H_READY_BLOCKS]
        assert 0 <= wm <= n, f"ready watermark {wm} outside [0, {n}]"
        owner = np.full(n, -1, dtype=np.int64)
        items = ready_items = ready_bytes = evictable = 0
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            state = w[b + S_STATE]
            assert state in (FREE, WRITING, READY), f"slot {s}: state {state}"
            if state == FREE:
                continue
            items += 1
            key = bytes(self._k[s * mk : s * mk + w[b + S_KLEN]])
            assert zlib.crc32(key) == w[b + S_HASH] and self._find(key, w[b + S_HASH]) == s
            total, e = 0, w[b + S_EXT]
            while e >= 0:
                c = i[self._ec + e]
                assert c > 0 and e + c <= wm, f"slot {s}: bad extent ({e}, {c}), ready {wm}"
                assert (owner[e : e + c] < 0).all(), f"block owned twice ({key!r})"
                owner[e : e + c] = s
                total += c
                e = i[self._en + e]
            assert total == w[b + S_BLOCKS] == blocks_for(w[b + S_NBYTES], lay.block_bytes)
            pins, r = 0, w[b + S_PIN_HEAD]
            while r >= 0:
                p = pn + r * PIN_WORDS
                assert w[p + P_SLOT] == s and w[p + P_COUNT] > 0
                pins += w[p + P_COUNT]
                r = w[p + P_NEXT]
            assert pins == w[b + S_PINS] and (pins == 0 or state == READY)
            if state == READY:
                ready_items += 1
                ready_bytes += w[b + S_NBYTES]
                evictable += 0 if pins else total
        assert (items, ready_items, ready_bytes, evictable) == (
            w[H_ITEMS], w[H_READY_ITEMS], w[H_READY_BYTES], w[H_EVICTABLE])  # fmt: skip
        # LRU: every READY slot once, links both ways.
        seen, prev, s = 0, -1, w[H_LRU_HEAD]
        while s >= 0:
            b = sl + s * SLOT_WORDS
            assert w[b + S_STATE] == READY and w[b + S_PREV] == prev
            seen += 1
            assert seen <= ready_items, "LRU list has a cycle"
            prev, s = s, w[b + S_NEXT]
        assert prev == w[H_LRU_TAIL] and seen == ready_items
        # Free extents: disjoint from owned blocks and each other, never adjacent.
        free = np.zeros(n, dtype=bool)
        starts = []
        for k in range(NUM_CLASSES):
            s, prev = w[H_CLASSES + k], -1
            assert bool(w[H_MASK] >> k & 1) == (s >= 0), f"class {k}: mask bit wrong"
            while s >= 0:
                c = i[self._fs + s]
                assert c > 0 and c.bit_length() - 1 == k and i[self._fe + s + c - 1] == s
                assert i[self._fp + s] == prev
                assert s + c <= wm, f"free extent ({s}, {c}) beyond the ready watermark {wm}"
                assert not free[s : s + c].any() and (owner[s : s + c] < 0).all()
                free[s : s + c] = True
                starts.append((s, c))
                prev, s = s, i[self._fn + s]
        starts.sort()
        for (s0, c0), (s1, _) in zip(starts, starts[1:], strict=False):
            assert s0 + c0 < s1, f"free extents ({s0}, {c0}) and ({s1}, ...) touch"
        assert int(free.sum()) == w[H_FREE_BLOCKS], "free block count is off"
        assert ((owner[:wm] >= 0) | free[:wm]).all(), "a block is lost (neither owned nor free)"
        assert not ((owner[wm:] >= 0) | free[wm:]).any(), "a block beyond the watermark is used"
        # Free lists of slots and pin records.
        cnt, s = 0, w[H_SLOT_FREE]
        while s >= 0:
            assert w[sl + s * SLOT_WORDS + S_STATE] == FREE
            cnt += 1
            s = w[sl + s * SLOT_WORDS + S_HNEXT]
        assert cnt == lay.max_items - items
        free_pins, r = 0, w[H_PIN_FREE]
        while r >= 0:  # a pin takes a free record's count as 0
            assert w[pn + r * PIN_WORDS + P_COUNT] == 0, f"free pin record {r} has a count"
            free_pins += 1
            assert free_pins <= lay.max_pins, "pin free list has a cycle"
            r = w[pn + r * PIN_WORDS + P_NEXT]
