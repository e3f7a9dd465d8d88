"""What the shared catalog's rebuild keeps (engine/catalog/shared/recovery.py,
``_recover``): the slot table is the truth, and a slot that does not parse, or a
reservation of a dead process, is freed; pin records of live processes on READY
items are kept and summed, the rest freed; every derived structure comes out
whole (``check``).

Each case damages one slot or pin record of a healthy catalog by hand, the way
a torn update or a dead process leaves it, and names what the rebuild keeps.
The catalog of every case, 16 blocks of ``B`` bytes (max_key_bytes=4,
max_items=8, max_pins=4)::

    blocks  0-1  abcd  READY, slot 0 (a key of the maximum length)
            2-4  b     READY, slot 1, pinned once by this process (pin record 0)
            5    w     WRITING, slot 2, reserved by this process
            6    z     READY, slot 3
            7-15       free
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable

import pytest
from catalogs import B, open_shared
from test_shared_catalog_check import pin, slot  # word indexes of a slot and a pin record

from ecoffload.engine.base.errors import InvalidSizeError
from ecoffload.engine.base.liveness import process_start_time
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared import format as f
from ecoffload.engine.catalog.shared.catalog import SharedCatalog

READY, WRITING = ItemState.READY, ItemState.WRITING
HEALTHY = {"abcd": (READY, 0), "b": (READY, 1), "w": (WRITING, 0), "z": (READY, 0)}


def healthy(path) -> SharedCatalog:
    c = open_shared(path, 16, max_key_bytes=4, max_items=8, max_pins=4)
    for key, blocks in (("abcd", 2), ("b", 3), ("w", 1), ("z", 1)):
        c.reserve(key, blocks * B)
    for key in ("abcd", "b", "z"):
        c.commit(key)
    c.pin("b")
    c.check()
    return c


def word(index: Callable[[SharedCatalog], int], value, view: str = "_w"):
    """Damage: set one word (``value`` may be a function of the old one)."""

    def corrupt(c: SharedCatalog) -> None:
        v = getattr(c, view)
        at = index(c)
        v[at] = value(v[at]) if callable(value) else value

    return corrupt


def steps(*damage):
    def corrupt(c: SharedCatalog) -> None:
        for d in damage:
            d(c)

    return corrupt


def one_block_extents(c: SharedCatalog, s: int, blocks: list[int]) -> None:
    """Make slot ``s`` an item of one-block extents at ``blocks``, chained in order."""
    for block, after in zip(blocks, [*blocks[1:], -1], strict=True):
        c._i[c._ec + block], c._i[c._en + block] = 1, after
    b = slot(c, s)
    c._w[b + f.S_EXT], c._w[b + f.S_BLOCKS], c._w[b + f.S_NBYTES] = (
        blocks[0],
        len(blocks),
        len(blocks) * B,
    )


def without(*keys: str, **changed) -> dict:
    return {k: v for k, v in HEALTHY.items() if k not in keys} | changed


def dead(start: int) -> int:
    """A start time no live process of this pid has."""
    return start + 1


# case id -> (the damage, what the rebuild keeps: key -> (state, pins))
CASES = {
    "none": (lambda c: None, HEALTHY),
    "unknown-state": (word(lambda c: slot(c, 3) + f.S_STATE, 3), without("z")),
    "key-length-0": (word(lambda c: slot(c, 3) + f.S_KLEN, 0), without("z")),
    "key-length-past-the-maximum": (word(lambda c: slot(c, 3) + f.S_KLEN, 5), without("z")),
    "writing-of-a-dead-process": (word(lambda c: slot(c, 2) + f.S_START, dead), without("w")),
    "ready-of-a-dead-process": (word(lambda c: slot(c, 3) + f.S_START, dead), HEALTHY),
    # w (5, 1) ends at the watermark: kept; z (6, 1) starts at it
    "extent-at-the-watermark": (word(lambda c: f.H_READY_BLOCKS, 6), without("z")),
    # b (2, 3) runs past it, w and z lie beyond
    "extent-across-the-watermark": (word(lambda c: f.H_READY_BLOCKS, 4), without("b", "w", "z")),
    "watermark-past-the-blocks": (word(lambda c: f.H_READY_BLOCKS, 17), HEALTHY),
    "watermark-negative": (word(lambda c: f.H_READY_BLOCKS, -3), {}),
    "extent-count-0": (word(lambda c: c._ec + 6, 0, "_i"), without("z")),
    "extent-over-an-earlier-item-s": (word(lambda c: slot(c, 3) + f.S_EXT, 5), without("z")),
    "extent-chain-cycle": (word(lambda c: c._en + 6, 6, "_i"), without("z")),
    "blocks-word-off": (word(lambda c: slot(c, 1) + f.S_BLOCKS, 4), without("b")),
    "bytes-word-off": (word(lambda c: slot(c, 1) + f.S_NBYTES, 4 * B), without("b")),
    "no-blocks-at-all": (
        steps(
            word(lambda c: slot(c, 3) + f.S_EXT, -1),
            word(lambda c: slot(c, 3) + f.S_BLOCKS, 0),
            word(lambda c: slot(c, 3) + f.S_NBYTES, 0),
        ),
        without("z"),
    ),
    # an empty key hashes to 0: only its length frees it
    "key-length-0-with-the-empty-key-s-hash": (
        steps(
            word(lambda c: slot(c, 3) + f.S_KLEN, 0),
            word(lambda c: slot(c, 3) + f.S_HASH, 0),
        ),
        without("z"),
    ),
    "extent-start-far-past-the-blocks": (
        word(lambda c: slot(c, 3) + f.S_EXT, 1 << 40),
        without("z"),
    ),
    # z's chain starts with a zero-count extent at a free block: the blocks still add up
    "zero-count-extent-in-a-chain": (
        steps(
            word(lambda c: c._ec + 10, 0, "_i"),
            word(lambda c: c._en + 10, 6, "_i"),
            word(lambda c: slot(c, 3) + f.S_EXT, 10),
        ),
        without("z"),
    ),
    "extent-over-slot-0-s": (  # (1, 1) inside abcd's (0, 2)
        steps(
            word(lambda c: c._ec + 1, 1, "_i"),
            word(lambda c: c._en + 1, -1, "_i"),
            word(lambda c: slot(c, 3) + f.S_EXT, 1),
        ),
        without("z"),
    ),
    # z made of ten one-block extents, adjacent ones too: a chain, kept whole
    "a-chain-of-ten-one-block-extents": (
        lambda c: one_block_extents(c, 3, [6, *range(7, 16)]),
        without(z=(READY, 0)),
    ),
    "hash-off": (word(lambda c: slot(c, 3) + f.S_HASH, lambda h: h ^ 1), without("z")),
    "key-changed": (word(lambda c: 3 * 4, ord("y"), "_k"), without("z")),
    "pin-of-a-dead-process": (word(lambda c: pin(c, 0) + f.P_START, dead), without(b=(READY, 0))),
    "pin-without-a-count": (word(lambda c: pin(c, 0) + f.P_COUNT, 0), without(b=(READY, 0))),
    "pin-on-slot-0": (
        word(lambda c: pin(c, 0) + f.P_SLOT, 0),
        without(abcd=(READY, 1), b=(READY, 0)),
    ),
    "pin-on-a-writing-item": (word(lambda c: pin(c, 0) + f.P_SLOT, 2), without(b=(READY, 0))),
    "pin-on-a-free-slot": (word(lambda c: pin(c, 0) + f.P_SLOT, 7), without(b=(READY, 0))),
    "pin-on-slot-minus-1": (word(lambda c: pin(c, 0) + f.P_SLOT, -1), without(b=(READY, 0))),
    "pin-past-the-slots": (word(lambda c: pin(c, 0) + f.P_SLOT, 8), without(b=(READY, 0))),
    # a warm start's verification marks: a READY item's only (check() refuses any other)
    "an-unverified-item-kept": (
        word(lambda c: slot(c, 3) + f.S_VERIFY, f.UNVERIFIED),
        without(z=(ItemState.UNVERIFIED, 0)),
    ),
    "an-unverified-item-that-does-not-parse": (  # freed, its mark with it
        steps(
            word(lambda c: slot(c, 3) + f.S_VERIFY, f.UNVERIFIED),
            word(lambda c: slot(c, 3) + f.S_HASH, lambda h: h ^ 1),
        ),
        without("z"),
    ),
    "a-failed-mark-on-a-writing-item": (word(lambda c: slot(c, 2) + f.S_VERIFY, f.FAILED), HEALTHY),
    "a-mark-that-is-no-mark": (word(lambda c: slot(c, 3) + f.S_VERIFY, 7), without("z")),
    # a free record made another live process's pin of b, 3 times: both kept, summed
    "pin-of-another-live-process": (
        steps(
            word(lambda c: pin(c, 3) + f.P_SLOT, 1),
            word(lambda c: pin(c, 3) + f.P_PID, os.getppid()),
            word(lambda c: pin(c, 3) + f.P_START, process_start_time(os.getppid())),
            word(lambda c: pin(c, 3) + f.P_COUNT, 3),
        ),
        without(b=(READY, 4)),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_rebuild_frees_what_does_not_parse_and_keeps_the_rest(tmp_path, case):
    corrupt, kept = CASES[case]
    c = healthy(tmp_path / "c")
    before = c.recoveries
    corrupt(c)
    c.recover()
    assert {e.key: (e.state, e.pins) for e in c.entries()} == kept
    assert c.recoveries == before + 1
    c.check()  # every derived structure whole again
    for key, (_, pins) in kept.items():  # the pins found are the pins an unpin releases
        assert c.entry(key).pins == pins
    c.close()


def test_the_rebuild_orders_the_lru_by_use_and_keeps_the_clock_ahead(tmp_path):
    c = healthy(tmp_path / "c")
    c.lookup("abcd")  # use order: b, z, abcd
    ticks = {k: c._w[slot(c, c.entry(k).slot) + f.S_TICK] for k in ("abcd", "b", "z")}
    c._w[f.H_TICK] = 0  # a clock behind the slots' ticks
    c._w[f.H_LRU_HEAD] = c._w[f.H_LRU_TAIL] = -1
    c.recover()
    assert c._w[f.H_TICK] == max(ticks.values())
    c.unpin("b")
    c.reserve("big", 11 * B)  # 9 free: evicts the oldest unpinned, b (3)
    assert [c.state(k) for k in ("abcd", "b", "z")] == [READY, None, READY]
    c.check()
    c.close()


def test_a_clock_ahead_of_every_slot_is_kept(tmp_path):
    c = healthy(tmp_path / "c")
    c._w[f.H_TICK] = 1000
    c.recover()
    assert c._w[f.H_TICK] == 1000
    c.close()


def test_a_rebuild_of_an_empty_catalog_leaves_every_block_free(tmp_path):
    c = open_shared(tmp_path / "c", 16, max_items=4)
    c._w[f.H_TICK] = 7
    c.recover()
    assert (c._w[f.H_TICK], c.stats().free_blocks, c.stats().largest_free_extent) == (7, 16, 16)
    c.check()
    c.close()


def test_reap_releases_what_dead_processes_hold_and_counts_it(tmp_path):
    c = healthy(tmp_path / "c")
    c.reserve("w2", B)
    for key in ("w", "w2"):  # reservations of a process that is gone (its start time)
        c._w[slot(c, c.entry(key).slot) + f.S_START] += 1
    c._w[pin(c, 0) + f.P_START] += 1  # so is the process that pinned b
    c.pin("z")  # and z's, in slot order after w: every release counts, pins and reservations
    c._w[pin(c, c._w[slot(c, 3) + f.S_PIN_HEAD]) + f.P_START] += 1
    c.reserve("mine", B)  # a live reservation stays
    recoveries = c.recoveries
    assert c.reap() == 4
    assert {e.key: (e.state, e.pins) for e in c.entries()} == without(
        "w", b=(READY, 0), mine=(WRITING, 0)
    )
    assert c.reap() == 0
    assert c.recoveries == recoveries and c._w[f.H_DIRTY] == 0  # no rebuild: a sweep
    c.check()
    c.close()


def put(c: SharedCatalog, data: bytearray, key: str, blocks: int, crc: int | None = -1):
    """Reserve ``key``, fill its blocks, commit it with its bytes' CRC (``-1``), ``crc``."""
    e = c.reserve(key, blocks * B)
    payload = bytes([len(key)]) * (blocks * B)
    at = 0
    for start, count in e.extents:
        data[start * B : (start + count) * B] = payload[at : at + count * B]
        at += count * B
    c.commit(key, zlib.crc32(payload) if crc == -1 else crc)
    return e


def test_verify_drops_each_damaged_item_past_the_ones_it_keeps(tmp_path, caplog):
    c = open_shared(tmp_path / "c", 32, max_items=32)
    data = bytearray(32 * B)
    c.reserve("writing", B)  # slot 0: not READY, skipped
    put(c, data, "no-crc", 1, None)  # slots 1 and 2: cannot be checked, counted
    put(c, data, "no-crc-2", 1, None)
    pinned = [f"pinned{n}" for n in range(9)]
    for key in pinned:  # 9 pinned items whose bytes fail: kept, 8 named
        put(c, data, key, 1, 1)
        c.pin(key)
    put(c, data, "bad", 1, 1)
    put(c, data, "zero", 1, 0)  # a recorded CRC of 0 is a CRC
    good = put(c, data, "good", 2)
    recoveries, evictions = c.recoveries, c.stats().evictions
    with caplog.at_level(logging.INFO, logger="ecoffload.engine.catalog.shared.catalog"):
        assert c.verify(memoryview(data)) == 2
    assert {e.key for e in c.entries()} == {"writing", "no-crc", "no-crc-2", "good", *pinned}
    assert c.entry("good").extents == good.extents
    assert (c.recoveries, c.stats().evictions) == (
        recoveries + 1,
        evictions,
    )  # dropped, not evicted
    assert c._w[f.H_DIRTY] == 0
    path = str(tmp_path / "c")
    records = [(r.levelname, r.msg, r.args) for r in caplog.records]
    assert records[:3] == [
        ("WARNING", "catalog %s: item %r fails its CRC-32; dropped", (path, "bad")),
        ("WARNING", "catalog %s: item %r fails its CRC-32; dropped", (path, "zero")),
        ("ERROR", "catalog %s: %d pinned item(s) fail their CRC-32 and stay until unpinned: %s",
         (path, 9, pinned[:8])),
    ]  # fmt: skip
    level, msg, args = records[3]
    assert (level, msg, args[0], args[2:]) == (
        "INFO", "catalog %s verified in %.3f s: %d item(s) checked, %d dropped, %d without a CRC",
        path, (12, 2, 2))  # fmt: skip
    assert 0 <= args[1] < 60
    c.check()
    c.close()


def test_verify_follows_an_item_s_extents_and_needs_the_whole_data_area(tmp_path):
    c = open_shared(tmp_path / "c", 4)
    data = bytearray(4 * B)
    for key in ("s0", "a", "s2", "b"):
        c.reserve(key, B)
    c.abort("a")
    c.abort("b")
    two = put(c, data, "two", 2)
    assert [tuple(e) for e in two.extents] == [(1, 1), (3, 1)]
    assert c.verify(data) == 0 and c.state("two") is READY
    data[3 * B] ^= 1
    assert c.verify(data) == 1 and c.state("two") is None
    with pytest.raises(InvalidSizeError) as err:
        c.verify(bytearray(4 * B - 1))
    assert str(err.value) == (
        "verify needs the arena's data area, 16384 bytes (4 blocks of 4096); got 16383 bytes"
    )
    c.close()


@pytest.mark.parametrize(("recorded", "kept"), [(-3, 0), (0, 0), (7, 7), (16, 16), (17, 16)])
def test_the_rebuild_keeps_the_watermark_within_the_blocks(tmp_path, recorded, kept):
    c = open_shared(tmp_path / "c", 16)
    c._w[f.H_READY_BLOCKS] = recorded
    c.recover()
    assert (c.allocator.ready_blocks, c.stats().free_blocks) == (kept, kept)
    c.check()
    c.close()


def test_an_error_inside_reap_leaves_the_rebuild_to_the_next_locker(tmp_path, monkeypatch):
    c = healthy(tmp_path / "c")
    c._w[slot(c, 2) + f.S_START] += 1  # w's process is gone: the reap drops it
    recoveries = c.recoveries

    def hook(name):
        if name == "drop:unpublished":  # w's slot freed, its hash chain and blocks not yet
            raise RuntimeError(name)

    monkeypatch.setattr(fault_points, "hook", hook)
    with pytest.raises(RuntimeError, match="drop:unpublished"):
        c.reap()
    monkeypatch.setattr(fault_points, "hook", None)
    assert c._w[f.H_DIRTY] == os.getpid()  # left dirty: the reap stopped half-way
    assert {e.key: (e.state, e.pins) for e in c.entries()} == without("w")  # a read rebuilds
    assert (c.recoveries, c._w[f.H_DIRTY]) == (recoveries + 1, 0)
    c.check()
    c.close()


def test_a_reap_after_a_rebuild_leaves_a_freed_pinned_slot_s_old_pin_list_alone(tmp_path):
    c = healthy(tmp_path / "c")
    b = slot(c, 1)
    c._w[b + f.S_HASH] ^= 1  # b, pinned, no longer parses: the rebuild frees its slot
    c.recover()  # its pin count and list head stay in the free slot; its records are freed
    assert (c._w[b + f.S_PINS], c._w[b + f.S_PIN_HEAD]) == (1, 0)
    assert c.reap() == 0  # nothing dead: the free slot's words are not a pin list
    assert {e.key: (e.state, e.pins) for e in c.entries()} == without("b")
    c.check()
    assert [c.pin(key).pins for key in ("abcd", "z")] == [1, 1]
    assert c.lookup("abcd", pin=True).pins == 2
    c.check()
    c.close()


def test_a_chain_that_cycles_through_block_0_is_freed_whatever_its_sizes_say(tmp_path):
    """abcd's extent (0, 2) made to lead back to itself, its blocks and bytes words set to
    what the bounded walk adds up (17 laps of 2 blocks): the walk stops on block 0, still
    in the chain, and the slot is freed."""
    c = healthy(tmp_path / "c")
    b = slot(c, 0)
    c._i[c._en + 0] = 0
    c._w[b + f.S_BLOCKS], c._w[b + f.S_NBYTES] = 34, 34 * B
    c.recover()
    assert c._w[b + f.S_STATE] == f.FREE  # read before anything walks the chain
    assert {e.key: (e.state, e.pins) for e in c.entries()} == without("abcd")
    c.check()
    c.close()


def test_a_pin_record_naming_the_slot_past_the_table_is_freed(tmp_path):
    """The word after the slot table is the first key's first bytes: a key of one byte 2
    makes it read READY, as a slot's state word would."""
    c = open_shared(tmp_path / "c", 4, max_key_bytes=8, max_items=4, max_pins=2)
    for key in ("\x02", "x"):
        c.reserve(key, B)
        c.commit(key)
    assert c._w[slot(c, 4) + f.S_STATE] == f.READY
    p = pin(c, 1)  # a free record made a live pin of slot 4, one past the last slot
    c._w[p + f.P_SLOT], c._w[p + f.P_PID] = 4, os.getpid()
    c._w[p + f.P_START], c._w[p + f.P_COUNT] = process_start_time(os.getpid()), 1
    c.recover()
    assert [c.pin(key).pins for key in ("\x02", "x")] == [1, 1]  # both records free again
    c.check()
    c.close()


def test_the_rebuild_clears_a_stale_free_size_left_on_an_owned_block(tmp_path):
    """z's block 6 carries the free size of an extent that started there before (a torn
    update's leftover): once rebuilt, freeing w's block 5 beside it merges nothing of z."""
    c = healthy(tmp_path / "c")
    c._i[c._fs + 6] = 1
    c.recover()
    c.abort("w")
    assert c.stats().free_blocks == 10 and c.stats().largest_free_extent == 9
    c.check()  # block 6 is z's alone
    assert c.reserve("ten", 10 * B).extents == [(5, 1), (7, 9)]  # z's block not among them
    assert c.state("z") is READY
    c.check()
    c.close()
