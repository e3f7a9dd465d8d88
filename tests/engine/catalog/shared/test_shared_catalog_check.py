"""What the shared catalog's ``check`` refuses (engine/catalog/shared/check.py).

Each case breaks one invariant of a healthy catalog by hand, the way a lost
update or a bug would leave it, and expects ``check`` to stop at the assertion
that exists for it: the whole message where it has one, and always the
statement that raised (a weakened assertion lets the damage through to a later
one, or to none). ``check`` is Python whichever hit path is loaded.

The catalog of every case, 16 blocks of ``B`` bytes (max_items=6, max_pins=4)::

    blocks  0-1  a   READY, slot 0, pinned twice (pin record 0, count 2)
            2-4  b   READY, slot 1, pinned once (pin record 1)
            5        free (class 0, after 7 in its list)
            6    w   WRITING, slot 3
            7        free (class 0, the list's head)
            8    z   READY, slot 5, unpinned
            9-15     free (class 2)
    LRU a, b, z; free slots 4, 2; free pin records 2, 3
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable

import pytest
from catalogs import B, open_shared, unhash

from ecoffload.engine.catalog.shared import format as f
from ecoffload.engine.catalog.shared.catalog import SharedCatalog


def healthy(path) -> SharedCatalog:
    """The catalog of the module docstring, checked."""
    c = open_shared(path, 16, max_items=6, max_pins=4)
    for key, blocks in (("a", 2), ("b", 3), ("x", 1), ("w", 1), ("y", 1), ("z", 1)):
        c.reserve(key, blocks * B)
    for key in "abz":
        c.commit(key)
    c.abort("x")
    c.abort("y")
    c.pin("a")
    c.pin("a")
    c.pin("b")
    c.check()
    return c


def slot(c: SharedCatalog, s: int) -> int:
    """The index of slot ``s``'s first word in ``c._w``."""
    return c._sl + s * f.SLOT_WORDS


def pin(c: SharedCatalog, r: int) -> int:
    """The index of pin record ``r``'s first word in ``c._w``."""
    return c._pn + r * f.PIN_WORDS


def refused(c: SharedCatalog) -> tuple[str, str]:
    """``check``'s message and the first line of the statement that raised it (spacing
    and comment dropped)."""
    with pytest.raises(AssertionError) as e:
        c.check()
    tb = e.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    # linecache, not pytest's statement: that parses the file, seconds in mutmut's copy
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    return str(e.value), " ".join(line.split("  #")[0].split())


def test_the_catalog_of_every_case_is_laid_out_as_described(tmp_path):
    c = healthy(tmp_path / "c")
    w, i = c._w, c._i
    extents = {k: [tuple(e) for e in c.lookup(k).extents] for k in "abz"}
    assert extents == {"a": [(0, 2)], "b": [(2, 3)], "z": [(8, 1)]}
    assert [c.lookup(k).slot for k in "abz"] == [0, 1, 5]
    assert (w[slot(c, 3) + f.S_STATE], w[slot(c, 3) + f.S_EXT]) == (f.WRITING, 6)
    assert [w[f.H_CLASSES + k] for k in range(4)] == [7, -1, 9, -1]
    assert (i[c._fn + 7], i[c._fs + 5], i[c._fs + 9]) == (5, 1, 7)
    assert (w[f.H_LRU_HEAD], w[f.H_LRU_TAIL], w[f.H_SLOT_FREE], w[f.H_PIN_FREE]) == (0, 5, 4, 2)
    assert [w[pin(c, r) + f.P_COUNT] for r in range(4)] == [2, 1, 0, 0]
    c.close()


def own(c: SharedCatalog, s: int, start: int) -> None:
    """Make slot ``s``'s one extent the block at ``start``."""
    c._w[slot(c, s) + f.S_EXT] = start
    c._i[c._ec + start], c._i[c._en + start] = 1, -1


def split_free_tail(c: SharedCatalog) -> None:
    """Cut the free extent (9, 7) into (9, 3) (class 1) and (12, 4) (class 2), both
    listed: every block still counted free, but two free extents touch."""
    c._w[f.H_CLASSES + 2] = -1
    list_free_extent(c, 12, 4, 2)
    list_free_extent(c, 9, 3, 1)


def list_free_extent(c: SharedCatalog, start: int, count: int, k: int) -> None:
    """Put a free extent at the head of class ``k``'s list (its mask bit set)."""
    w, i = c._w, c._i
    i[c._fs + start], i[c._fe + start + count - 1] = count, start
    i[c._fp + start], i[c._fn + start] = -1, w[f.H_CLASSES + k]
    w[f.H_CLASSES + k] = start
    w[f.H_MASK] |= 1 << k


def _set(index: Callable[[SharedCatalog], int], value: int, view: str = "_w"):
    def corrupt(c: SharedCatalog) -> None:
        getattr(c, view)[index(c)] = value

    return corrupt


def _all(*steps):
    def corrupt(c: SharedCatalog) -> None:
        for step in steps:
            step(c)

    return corrupt


EXTENT = 'assert c > 0 and e + c <= wm, f"slot {s}: bad extent ({e}, {c}), ready {wm}"'
FREE_EXTENT = "assert c > 0 and c.bit_length() - 1 == k and i[self._fe + s + c - 1] == s"
BEYOND = 'assert s + c <= wm, f"free extent ({s}, {c}) beyond the ready watermark {wm}"'
OVERLAP = "assert not free[s : s + c].any() and (owner[s : s + c] < 0).all()"
TOTAL = "assert total == w[b + S_BLOCKS] == blocks_for(w[b + S_NBYTES], lay.block_bytes)"
PINS = "assert pins == w[b + S_PINS] and (pins == 0 or state == READY)"
PIN_RECORD = "assert w[p + P_SLOT] == s and w[p + P_COUNT] > 0"
LRU_LINK = "assert w[b + S_STATE] == READY and w[b + S_PREV] == prev"
LRU_ENDS = "assert prev == w[H_LRU_TAIL] and seen == ready_items"
KEY = "assert zlib.crc32(key) == w[b + S_HASH] and self._find(key, w[b + S_HASH]) == s"
FREE_SLOTS = "assert cnt == lay.max_items - items"
PIN_LIST = 'assert r < lay.max_pins and hops < lay.max_pins, f"slot {s}: pin list at {r}"'
MARK = 'assert ok, f"slot {s}: verification mark {mark} in state {state}"'

# case id -> (the damage, check's message, the statement that catches it)
CASES = {
    "dirty": (
        _set(lambda c: f.H_DIRTY, os.getpid()),
        "catalog left dirty",
        'assert w[H_DIRTY] == 0, "catalog left dirty"',
    ),
    "watermark-past-the-end": (
        _set(lambda c: f.H_READY_BLOCKS, 17),
        "ready watermark 17 outside [0, 16]",
        'assert 0 <= wm <= n, f"ready watermark {wm} outside [0, {n}]"',
    ),
    "watermark-negative": (
        _set(lambda c: f.H_READY_BLOCKS, -1),
        "ready watermark -1 outside [0, 16]",
        'assert 0 <= wm <= n, f"ready watermark {wm} outside [0, {n}]"',
    ),
    "unknown-state": (
        _set(lambda c: slot(c, 2) + f.S_STATE, 3),
        "slot 2: state 3",
        'assert state in (FREE, WRITING, READY), f"slot {s}: state {state}"',
    ),
    # the key no longer hashes to its stored hash, though the table still finds it
    "key-changed": (_set(lambda c: 0, ord("A"), "_k"), "", KEY),
    # the key hashes right, but its chain no longer leads to it
    "key-unreachable": (lambda c: unhash(c, 1), "", KEY),
    "empty-extent": (
        _set(lambda c: c._ec + 2, 0, "_i"),
        "slot 1: bad extent (2, 0), ready 16",
        EXTENT,
    ),
    "extent-past-the-watermark": (
        _set(lambda c: f.H_READY_BLOCKS, 8),
        "slot 5: bad extent (8, 1), ready 8",
        EXTENT,
    ),
    # the last owned block is the watermark's last: the free tail is what lies beyond
    "item-ending-at-the-watermark": (
        _set(lambda c: f.H_READY_BLOCKS, 9),
        "free extent (9, 7) beyond the ready watermark 9",
        BEYOND,
    ),
    "block-owned-twice": (
        lambda c: own(c, 5, 6),  # z's block is w's
        "block owned twice (b'z')",
        'assert (owner[e : e + c] < 0).all(), f"block owned twice ({key!r})"',
    ),
    "blocks-word-off": (_set(lambda c: slot(c, 1) + f.S_BLOCKS, 4), "", TOTAL),
    "bytes-word-off": (_set(lambda c: slot(c, 1) + f.S_NBYTES, 4 * B), "", TOTAL),
    "pin-record-of-another-slot": (_set(lambda c: pin(c, 0) + f.P_SLOT, 1), "", PIN_RECORD),
    "pin-record-without-count": (_set(lambda c: pin(c, 1) + f.P_COUNT, 0), "", PIN_RECORD),
    "pins-word-off": (_set(lambda c: slot(c, 0) + f.S_PINS, 3), "", PINS),
    "writing-item-pinned": (
        _all(
            _set(lambda c: f.H_PIN_FREE, 3),  # record 2 off the free list, onto slot 3
            _set(lambda c: pin(c, 2) + f.P_SLOT, 3),
            _set(lambda c: pin(c, 2) + f.P_COUNT, 1),
            _set(lambda c: pin(c, 2) + f.P_NEXT, -1),
            _set(lambda c: slot(c, 3) + f.S_PIN_HEAD, 2),
            _set(lambda c: slot(c, 3) + f.S_PINS, 1),
        ),
        "",
        PINS,
    ),
    "item-count-off": (
        _set(lambda c: f.H_ITEMS, 5),
        "",
        "assert (items, ready_items, ready_bytes, evictable) == (",
    ),
    "writing-item-in-the-lru": (
        _all(
            _set(lambda c: slot(c, 5) + f.S_NEXT, 3),
            _set(lambda c: slot(c, 3) + f.S_PREV, 5),
            _set(lambda c: slot(c, 3) + f.S_NEXT, -1),
            _set(lambda c: f.H_LRU_TAIL, 3),
        ),
        "",
        LRU_LINK,
    ),
    "lru-back-link-wrong": (_set(lambda c: slot(c, 5) + f.S_PREV, 0), "", LRU_LINK),
    "lru-tail-wrong": (_set(lambda c: f.H_LRU_TAIL, 1), "", LRU_ENDS),
    "lru-missing-an-item": (
        _all(_set(lambda c: slot(c, 1) + f.S_NEXT, -1), _set(lambda c: f.H_LRU_TAIL, 1)),
        "",
        LRU_ENDS,
    ),
    "mask-bit-of-an-empty-class": (
        _set(lambda c: f.H_MASK, 0b111),
        "class 1: mask bit wrong",
        'assert bool(w[H_MASK] >> k & 1) == (s >= 0), f"class {k}: mask bit wrong"',
    ),
    "mask-bit-of-a-listed-class-missing": (
        _set(lambda c: f.H_MASK, 0b001),
        "class 2: mask bit wrong",
        'assert bool(w[H_MASK] >> k & 1) == (s >= 0), f"class {k}: mask bit wrong"',
    ),
    "free-extent-end-unmarked": (_set(lambda c: c._fe + 15, -1, "_i"), "", FREE_EXTENT),
    "free-extent-in-the-wrong-class": (
        _all(  # (9, 3) in class 2's list: its size is class 1's
            _set(lambda c: c._fs + 9, 3, "_i"),
            _set(lambda c: c._fe + 11, 9, "_i"),
        ),
        "",
        FREE_EXTENT,
    ),
    "free-extent-back-link-wrong": (
        _set(lambda c: c._fp + 5, -1, "_i"),
        "",
        "assert i[self._fp + s] == prev",
    ),
    "free-extent-over-an-owned-block": (lambda c: own(c, 3, 5), "", OVERLAP),
    "free-extents-overlapping": (
        lambda c: list_free_extent(c, 12, 2, 1),  # inside (9, 7)
        "",
        OVERLAP,
    ),
    "free-extents-touching": (
        split_free_tail,
        "free extents (9, 3) and (12, ...) touch",
        'assert s0 + c0 < s1, f"free extents ({s0}, {c0}) and ({s1}, ...) touch"',
    ),
    "free-block-count-off": (
        _set(lambda c: f.H_FREE_BLOCKS, 10),
        "free block count is off",
        'assert int(free.sum()) == w[H_FREE_BLOCKS], "free block count is off"',
    ),
    "block-lost": (
        _all(
            _set(lambda c: c._fn + 7, -1, "_i"),  # (5, 1) off its list, not counted
            _set(lambda c: f.H_FREE_BLOCKS, 8),
        ),
        "a block is lost (neither owned nor free)",
        'assert ((owner[:wm] >= 0) | free[:wm]).all(), "a block is lost (neither owned nor free)"',
    ),
    "used-slot-on-the-free-list": (
        _set(lambda c: slot(c, 2) + f.S_HNEXT, 0),
        "",
        "assert w[sl + s * SLOT_WORDS + S_STATE] == FREE",
    ),
    "free-slot-off-the-free-list": (_set(lambda c: f.H_SLOT_FREE, 2), "", FREE_SLOTS),
    "free-pin-record-with-a-count": (
        _set(lambda c: pin(c, 3) + f.P_COUNT, 1),
        "free pin record 3 has a count",
        'assert w[pn + r * PIN_WORDS + P_COUNT] == 0, f"free pin record {r} has a count"',
    ),
    # record 0, a's, back on the free list, at its head: a walk that stops at 0 misses it
    "free-pin-record-0-with-a-count": (
        _all(
            lambda c: (c.unpin("a"), c.unpin("a")),
            _set(lambda c: pin(c, 0) + f.P_COUNT, 1),
        ),
        "free pin record 0 has a count",
        'assert w[pn + r * PIN_WORDS + P_COUNT] == 0, f"free pin record {r} has a count"',
    ),
    "pin-free-list-cycle": (
        _set(lambda c: pin(c, 3) + f.P_NEXT, 2),
        "pin free list has a cycle",
        'assert free_pins <= lay.max_pins, "pin free list has a cycle"',
    ),
    # walks that leave their table, or go round
    "lru-head-past-the-table": (
        _set(lambda c: f.H_LRU_HEAD, 6),
        "LRU list reaches slot 6",
        'assert s < lay.max_items, f"LRU list reaches slot {s}"',
    ),
    "free-extent-class-head-at-the-block-count": (
        _set(lambda c: f.H_CLASSES, 16),
        "class 0: free extent at block 16",
        'assert s < n, f"class {k}: free extent at block {s}"',
    ),
    "slot-free-list-past-the-table": (
        _set(lambda c: f.H_SLOT_FREE, 6),
        "slot free list reaches slot 6",
        'assert s < lay.max_items, f"slot free list reaches slot {s}"',
    ),
    "slot-free-list-cycle": (
        _set(lambda c: slot(c, 2) + f.S_HNEXT, 4),  # 4 -> 2 -> 4
        "slot free list has a cycle",
        'assert cnt <= lay.max_items, "slot free list has a cycle"',
    ),
    "pin-free-list-past-the-records": (
        _set(lambda c: f.H_PIN_FREE, 4),
        "pin free list reaches record 4",
        'assert r < lay.max_pins, f"pin free list reaches record {r}"',
    ),
    "pin-list-past-the-records": (
        _set(lambda c: slot(c, 0) + f.S_PIN_HEAD, 4),
        "slot 0: pin list at 4",
        PIN_LIST,
    ),
    "pin-list-cycle": (_set(lambda c: pin(c, 0) + f.P_NEXT, 0), "slot 0: pin list at 0", PIN_LIST),
    # warm starts' verification marks (issue 31) and their counts
    "verification-mark-unknown": (
        _set(lambda c: slot(c, 1) + f.S_VERIFY, 5),
        f"slot 1: verification mark 5 in state {f.READY}",
        MARK,
    ),
    "writing-item-unverified": (
        _set(lambda c: slot(c, 3) + f.S_VERIFY, f.UNVERIFIED),
        f"slot 3: verification mark {f.UNVERIFIED} in state {f.WRITING}",
        MARK,
    ),
    "unverified-count-off": (
        _set(lambda c: slot(c, 1) + f.S_VERIFY, f.UNVERIFIED),
        "unverified item count is off",
        "assert (left, left_bytes) == (w[H_VERIFY_LEFT], w[H_VERIFY_LEFT_BYTES]), (",
    ),
}


def test_unverified_items_counted_in_the_header_pass(tmp_path):
    c = healthy(tmp_path / "c")
    for s in (0, 1):  # a (2 blocks) and b (3), READY
        c._w[slot(c, s) + f.S_VERIFY] = f.UNVERIFIED
    c._w[f.H_VERIFY_LEFT], c._w[f.H_VERIFY_LEFT_BYTES] = 2, 5 * B
    c.check()
    c._w[f.H_VERIFY_LEFT_BYTES] = 3 * B  # b's bytes alone
    assert refused(c)[0] == "unverified item count is off"
    c.close()


@pytest.mark.parametrize("case", CASES)
def test_check_stops_at_the_assertion_made_for_each_kind_of_damage(tmp_path, case):
    corrupt, message, statement = CASES[case]
    c = healthy(tmp_path / "c")
    corrupt(c)
    assert refused(c) == (message, statement)
    c.close()
