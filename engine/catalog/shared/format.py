"""The shared catalog's region: its word layout, sizes and what a slot holds.

Layout of the region (little endian; :class:`Layout` computes the offsets)::

    header      1 KiB: magic, version, sizes, dirty marker, recovery count, LRU
                ends, free lists, counters, the ready watermark, the count of
                lock holders that died, at byte 256 the lock (a 64-byte slot) and
                the boot it was initialised in, the heads of 64 free-extent lists
    buckets     hash table: one int64 slot index per bucket (power of two >= max_items)
    slots       max_items x 32 int64 (64-byte aligned): state, generation, LRU
                links, use tick, pins, first pin record, blocks | hash chain, key
                hash/length, nbytes, first extent, CRC-32, owner (pid, start
                time) | shape, dtype, verification mark
    keys        max_items x max_key_bytes: the UTF-8 key of each slot
    pins        max_pins x 5 int64: (slot, next, pid, start time, count), one per
                pinned (item, process)
    per block   6 x num_blocks int32: extent chains of items (count, next start)
                and the free-extent structure (size at its first block, start at
                its last block, links of its size-class list)

:func:`meta_bytes` is about ``300 + max_key_bytes`` bytes per item (slot, key,
bucket, pin record) and 24 per block: 73 MiB for an 8 GiB arena of 64 KiB
blocks with the defaults (max_items = num_blocks, 256-byte keys), 0.9% of it;
21 MiB with max_items=32768.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field

from ...base.errors import CatalogCapacityError, InvalidSizeError
from ...base.liveness import ProcessId
from ..catalog import Entry, ItemState

MAGIC = int.from_bytes(b"ECOCAT\x00\x01", "little")
VERSION = 4  # 2: the ready watermark (word H_READY_BLOCKS); 3: the robust mutex, slot words
# in cache-line order; 4: items awaiting verification after a warm start (S_VERIFY, H_VERIFY_*)
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
# The background verification of a warm start (verify.py): READY items
# still unverified and their bytes (derived: recovery recounts them), what the warm start
# marked (items, bytes), items dropped for a wrong CRC, the next slot to check, and
# when it began (time.time_ns()).
(H_VERIFY_LEFT, H_VERIFY_LEFT_BYTES, H_VERIFY_ITEMS, H_VERIFY_BYTES, H_VERIFY_DROPPED,
 H_VERIFY_CURSOR, H_VERIFY_T0) = range(42, 49)  # fmt: skip
H_CLASSES = 64  # 64 heads of the free-extent size-class lists
NUM_CLASSES = 64

# Slot words (state FREE, WRITING, READY), by cache line: what a hit, a pin and an
# unpin read and write; what a key search and a reservation do; shape and dtype.
(S_STATE, S_GEN, S_PREV, S_NEXT, S_TICK, S_PINS, S_PIN_HEAD, S_BLOCKS,
 S_HNEXT, S_HASH, S_KLEN, S_NBYTES, S_EXT, S_CRC, S_PID, S_START, S_NDIM) = range(17)  # fmt: skip
S_DIMS = 17  # MAX_DIMS words
S_DTYPE = 25  # DTYPE_BYTES bytes
S_VERIFY = 27  # of a READY item: VERIFIED, UNVERIFIED (a miss until checked) or FAILED
FREE, WRITING, READY = 0, 1, 2
STATE = {WRITING: ItemState.WRITING, READY: ItemState.READY}
# S_VERIFY: FAILED is a pinned item whose CRC-32 differs: never served, evicted once unpinned.
VERIFIED, UNVERIFIED, FAILED = 0, 1, 2

# Pin record words.
P_SLOT, P_NEXT, P_PID, P_START, P_COUNT = range(PIN_WORDS)

_DTYPES: dict[str, tuple[str, int, int]] = {}  # dtype name -> (name, its two slot words)


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
    return layout_for(num_blocks, block_bytes, max_items, max_key_bytes, max_pins).nbytes


def layout_for(num_blocks, block_bytes, max_items, max_key_bytes, max_pins) -> Layout:
    """The :class:`Layout` of these sizes, defaults filled in and every size checked."""
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


@dataclass
class SharedEntry(Entry):
    """An :class:`Entry` snapshot, plus the reservation's slot and generation and
    the process that reserved it: who produced the item."""

    slot: int = -1
    generation: int = 0
    producer: ProcessId = ProcessId(0, 0)  # the reserving process


def slot_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` as the ints a slot stores (CatalogCapacityError past MAX_DIMS)."""
    if not shape:
        return ()
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_DIMS:
        raise CatalogCapacityError(
            f"shape {dims}: at most {MAX_DIMS} dimensions fit a shared catalog entry"
        )
    return dims


def dtype_words(dtype: object) -> tuple[str, int, int]:  # (name, word, word)
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
