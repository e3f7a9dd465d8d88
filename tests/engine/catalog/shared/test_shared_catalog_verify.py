"""A warm start's verification, one call at a time (engine/catalog/shared/verify.py).

Every case runs in this process on a small shared arena: items are saved with
their CRC-32 through the catalog, some of their bytes changed by hand, and the
verification's own calls (``begin_verify``, ``verify_step``, ``verify_now``,
``verify``) are checked for what they return, the header's counts, each slot's
mark and the lines they log. ``tests/engine/test_warm_restart.py`` runs the
same through the arena's warm start, other processes and the verifier thread.
"""

import logging
import re
import time

import pytest

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import InvalidSizeError
from ecoffload.engine.base.items import item_crc32
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared import verify as verify_module
from ecoffload.engine.catalog.shared.catalog import SharedCatalog, meta_bytes
from ecoffload.engine.catalog.shared.format import (
    FAILED,
    H_DIRTY,
    H_VERIFY_BYTES,
    H_VERIFY_CURSOR,
    H_VERIFY_DROPPED,
    H_VERIFY_ITEMS,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    H_VERIFY_T0,
    S_VERIFY,
    SLOT_WORDS,
    UNVERIFIED,
    VERIFIED,
)
from ecoffload.engine.catalog.shared.verify import Verification

BLOCK, BLOCKS = 4096, 32
LOGGER = "ecoffload.engine.catalog.shared.catalog"


@pytest.fixture
def arena(arena_dir):
    size = meta_bytes(BLOCKS, BLOCK)
    with Arena.open_shared("v", block_bytes=BLOCK, num_blocks=BLOCKS, directory=arena_dir,
                           register_cuda="never", meta_bytes=size) as a:  # fmt: skip
        yield a


def save(catalog, arena, items, *, crc=True):
    """Save ``{key: nbytes}`` (bytes filled with the key's index + 1); their slots."""
    host, slots = arena.host.numpy(), {}
    for i, (key, nbytes) in enumerate(items.items()):
        e = catalog.reserve(key, nbytes)
        for start, count in e.extents:
            host[start * BLOCK : (start + count) * BLOCK] = i + 1
        catalog.commit(key, item_crc32(host, e.extents, BLOCK, nbytes) if crc else None)
        slots[key] = e.slot
    return slots


def change(catalog, arena, key):
    """The first byte of ``key`` changed (its CRC-32 no longer matches)."""
    start, _ = catalog.entry(key).extents[0]
    arena.host.numpy()[start * BLOCK] ^= 0xFF


def mark(catalog, s):
    return catalog._w[catalog._sl + s * SLOT_WORDS + S_VERIFY]


def header(catalog):
    w = catalog._w
    return tuple(int(w[h]) for h in (H_VERIFY_ITEMS, H_VERIFY_BYTES, H_VERIFY_LEFT,
                                     H_VERIFY_LEFT_BYTES, H_VERIFY_DROPPED))  # fmt: skip


def lines(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_begin_verify_marks_every_ready_item_with_a_crc_and_resets_the_counts(arena):
    with SharedCatalog.for_arena(arena) as writer:
        slots = save(writer, arena, {"a": 5000, "b": 4096})
        writer.reserve("c", 100)
        writer.commit("c", 0)  # a CRC-32 of 0 is a checksum (this one wrong)
        slots["c"] = writer.entry("c").slot
        save(writer, arena, {"plain": 3 * BLOCK}, crc=False)
        writer.reserve("writing", 10)  # a reservation: no mark, not counted
        w = writer._w
        w[H_VERIFY_CURSOR], w[H_VERIFY_DROPPED] = 7, 3  # a previous warm start's
        before = time.time_ns()
        with SharedCatalog.for_arena(arena) as catalog:
            recoveries = catalog.recoveries
            assert catalog.begin_verify() == (3, 5000 + 4096 + 100, 1)
            assert header(catalog) == (3, 9196, 3, 9196, 0)
            assert w[H_DIRTY] == 0  # its rebuild and marks finished
            assert w[H_VERIFY_CURSOR] == 0
            assert before <= w[H_VERIFY_T0] <= time.time_ns()
            assert [mark(catalog, slots[k]) for k in "abc"] == [UNVERIFIED] * 3
            assert [catalog.state(k) for k in ("a", "plain", "writing")] == [
                ItemState.UNVERIFIED, ItemState.READY, ItemState.WRITING]  # fmt: skip
            v = catalog.verification()
            assert v == Verification(3, 9196, 3, 9196, 0, w[H_VERIFY_T0])
            assert v.fraction == 0.0
            catalog.check()
            assert catalog.recoveries == recoveries + 1  # its own rebuild, no other
            writer.abort("writing")
            assert catalog.verify_step() == (3, 0) and catalog.state("c") is None


def test_the_fraction_is_of_the_marked_bytes_and_stays_between_0_and_1():
    assert Verification(4, 1000, 1, 250, 0, 1).fraction == 0.75
    assert Verification(4, 1000, 0, 0, 0, 1).fraction == 1.0
    assert Verification(0, 0, 0, 0, 0, 0).fraction == 1.0  # nothing marked
    assert Verification(0, -1, 0, 5, 0, 0).fraction == 1.0
    assert Verification(4, 1000, 4, 1500, 0, 1).fraction == 0.0  # more left than marked
    assert Verification(4, 1000, 0, -500, 0, 1).fraction == 1.0


def test_verify_step_checks_slices_from_the_cursor_and_settles_each_item_once(arena, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    sizes = {"a": 5000, "b": 4096, "c": 100, "d": 2 * BLOCK, "e": 1}
    with SharedCatalog.for_arena(arena) as writer:
        slots = save(writer, arena, sizes)
        assert [slots[k] for k in sizes] == [0, 1, 2, 3, 4]
        change(writer, arena, "b")
        change(writer, arena, "d")
        writer.pin("d")  # pinned by a live process: FAILED, never dropped while pinned
    with SharedCatalog.for_arena(arena) as catalog:
        t0 = time.monotonic()
        catalog.begin_verify()
        w = catalog._w
        # 5000 bytes fall short of 5001: the slice is "a" and "b" (changed: dropped)
        assert catalog.verify_step(5001) == (2, 3)
        assert w[H_VERIFY_CURSOR] == 2 and mark(catalog, 0) == VERIFIED
        assert catalog.state("b") is None
        assert header(catalog) == (5, 5000 + 4096 + 100 + 2 * BLOCK + 1, 3, 100 + 8193, 1)
        # 100 bytes reach 100: "c" alone
        assert catalog.verify_step(100) == (1, 2)
        assert w[H_VERIFY_CURSOR] == 3 and mark(catalog, 2) == VERIFIED
        assert header(catalog)[2:] == (2, 2 * BLOCK + 1, 1)
        assert lines(caplog, logging.WARNING) == [f"catalog {catalog.path}: item 'b' fails "
                                                  "its CRC-32; dropped"]  # fmt: skip
        assert not lines(caplog, logging.INFO)
        # the rest fit: "d" (changed, pinned) and "e"; the cursor at the window's end
        assert catalog.verify_step() == (2, 0)
        assert w[H_VERIFY_CURSOR] == BLOCKS
        assert mark(catalog, 3) == FAILED and mark(catalog, 4) == VERIFIED
        assert catalog.state("d") is ItemState.UNVERIFIED and catalog.lookup("d") is None
        assert header(catalog)[2:] == (0, 0, 1)  # the pinned one is not dropped
        assert lines(caplog, logging.ERROR) == [
            f"catalog {catalog.path}: item 'd' fails its CRC-32 and is pinned: never served, "
            "evicted once unpinned"
        ]
        (done,) = lines(caplog, logging.INFO)
        path = re.escape(catalog.path)
        m = re.fullmatch(rf"catalog {path}: every item verified, (\d+\.\d{{3}}) s after the "
                         r"warm start; 1 dropped", done)  # fmt: skip
        assert m and 0 <= float(m.group(1)) <= time.monotonic() - t0 + 0.001, done
        assert catalog.stats().evictions == 0  # a changed item is dropped, not evicted
        assert catalog.verify_step() == (0, 0)  # nothing left: no lock taken, nothing logged
        assert len([r for r in caplog.records if r.name == LOGGER]) == 3
        assert catalog.lookup("a").checksum is not None and catalog.lookup("e") is not None
        catalog.check()
        assert catalog.entry("d").pins == 1  # the writer's pin (this process's)
        catalog.unpin("d")
        catalog.evict("d")
        catalog.check()


def test_a_slice_stops_at_the_scan_window_and_the_cursor_starts_over(arena, monkeypatch):
    monkeypatch.setattr(verify_module, "_SCAN_SLOTS", 3)
    with SharedCatalog.for_arena(arena) as writer:
        slots = save(writer, arena, {k: 100 for k in "abcdefg"})
        assert list(slots.values()) == list(range(7))
    with SharedCatalog.for_arena(arena) as catalog:
        catalog.begin_verify()
        w = catalog._w
        catalog.evict("b")  # slot 1: no longer an item to check
        assert catalog.verify_step(10**9) == (2, 4)  # slots 0-2 looked at, "b" gone
        assert w[H_VERIFY_CURSOR] == 3
        w[H_VERIFY_CURSOR] = 5
        assert catalog.verify_step(10**9) == (2, 2)  # slots 5 and 6
        assert w[H_VERIFY_CURSOR] == 8
        for bad in (BLOCKS, BLOCKS + 1, -1):  # past the slots (or damaged): from slot 0
            w[H_VERIFY_CURSOR] = bad
            # slots 0-2 hold nothing to check (settled, or free): none counts toward
            # the slice, however small
            assert catalog.verify_step(1) == (0, 2)
            assert w[H_VERIFY_CURSOR] == 3
        assert catalog.verify_step(10**9) == (2, 0)  # slots 3 and 4
        assert [mark(catalog, s) for s in (0, 2, 3, 4, 5, 6)] == [VERIFIED] * 6
        catalog.check()


def test_verify_now_applies_a_result_only_to_the_same_reservation_still_unverified(arena):
    with SharedCatalog.for_arena(arena) as writer:
        save(writer, arena, {"a": 100, "b": 200, "c": 300, "d": 400})
        change(writer, arena, "d")
    with SharedCatalog.for_arena(arena) as catalog:
        catalog.begin_verify()
        assert catalog.verify_now([]) == 0
        catalog._enter(update=False)
        try:
            pending = catalog._take_slice(10**9)
        finally:
            catalog._exit()
        assert [(p[0], p[3]) for p in pending] == [(0, 100), (1, 200), (2, 300), (3, 400)]
        catalog.evict("a")  # evicted between the slice and its results
        catalog.evict("b")
        e = catalog.reserve("b", 200)  # the slot again, another reservation
        assert e.slot == 0 or e.slot == 1
        catalog.commit("b")
        assert catalog.verify_now(pending[2:3]) == 1  # "c", settled by "another verifier"
        assert header(catalog)[2:] == (1, 400, 0)
        assert catalog.verify_now(pending) == 1  # "d" only: a and b gone, c settled
        assert header(catalog)[2:] == (0, 0, 1)
        assert catalog.state("d") is None and catalog.lookup("b") is not None
        assert catalog.verify_now(pending) == 0
        assert header(catalog)[2:] == (0, 0, 1)
        catalog.check()


def test_verify_checks_every_item_under_the_lock_and_keeps_pinned_failures(arena, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with SharedCatalog.for_arena(arena) as writer:
        slots = save(writer, arena, {"a": 5000, "b": 4096, "c": 3 * BLOCK, "d": 1})
        save(writer, arena, {"plain": 10}, crc=False)
        for key in ("b", "c", "d"):
            change(writer, arena, key)
        writer.pin("c")
        writer.pin("d")
        with SharedCatalog.for_arena(arena) as catalog:
            catalog.begin_verify()  # a warm start's marks: verify settles them all
            data = arena.host.numpy()
            with pytest.raises(InvalidSizeError) as err:
                catalog.verify(data[: BLOCKS * BLOCK - 1])
            assert str(err.value) == (
                f"verify needs the arena's data area, {BLOCKS * BLOCK} bytes ({BLOCKS} blocks "
                f"of {BLOCK}); got {BLOCKS * BLOCK - 1} bytes"
            )
            t0 = time.monotonic()
            assert catalog.verify(data) == 1  # "b"; "c" and "d" pinned
            took = time.monotonic() - t0
            assert catalog.state("b") is None
            assert [mark(catalog, slots[k]) for k in "acd"] == [VERIFIED] * 3
            assert header(catalog)[2:4] == (0, 0)
            assert catalog.lookup("a") is not None and catalog.lookup("plain") is not None
            path = catalog.path
            assert lines(caplog, logging.WARNING) == [
                f"catalog {path}: item 'b' fails its CRC-32; dropped"]  # fmt: skip
            assert lines(caplog, logging.ERROR) == [
                f"catalog {path}: 2 pinned item(s) fail their CRC-32 and stay until "
                "unpinned: ['c', 'd']"
            ]
            (info,) = lines(caplog, logging.INFO)
            m = re.fullmatch(rf"catalog {re.escape(path)} verified in (\d+\.\d{{3}}) s: 4 "
                             r"item\(s\) checked, 1 dropped, 1 without a CRC", info)  # fmt: skip
            assert m, info
            assert 0 <= float(m.group(1)) <= took + 0.001
            caplog.clear()
            assert catalog.verify(memoryview(data)) == 0  # the pinned ones again, logged again
            assert len(lines(caplog, logging.ERROR)) == 1
            catalog.check()
        writer.unpin("c")
        writer.unpin("d")


def test_verify_of_a_catalog_with_nothing_to_check_logs_no_error(arena, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with SharedCatalog.for_arena(arena) as catalog:
        save(catalog, arena, {"a": 10}, crc=False)
        assert catalog.verify(bytearray(BLOCKS * BLOCK + 5)) == 0
        assert not lines(caplog, logging.ERROR) and not lines(caplog, logging.WARNING)
        (info,) = lines(caplog, logging.INFO)
        assert info.endswith(": 0 item(s) checked, 0 dropped, 1 without a CRC")


def test_verifying_needs_the_arena_s_data_area_mapped_read_only(arena):
    with SharedCatalog.for_arena(arena) as writer:
        save(writer, arena, {"a": 100})
    with SharedCatalog(arena.fileno(), arena.meta_offset, arena.meta_bytes) as blind:
        blind.begin_verify()
        with pytest.raises(InvalidSizeError) as err:
            blind.verify_step()
        assert str(err.value) == (
            f"catalog {blind.path}: verifying items needs the arena's data area; "
            "open the catalog with SharedCatalog.for_arena(arena)"
        )
        assert blind.verification().items_left == 1  # nothing taken
        assert blind._w[H_VERIFY_CURSOR] == 0
    with SharedCatalog.for_arena(arena) as catalog:
        view = catalog._data_view()
        assert catalog._data_view() is view  # mapped once
        assert len(view) == BLOCKS * BLOCK
        assert view[:] == arena.host.numpy().tobytes()  # the data area, from its first byte
        with pytest.raises(TypeError):
            view[0] = 1
        assert catalog.verify_step() == (1, 0)


def test_a_result_is_never_applied_to_a_later_reservation_of_the_slot(arena):
    """A slice taken before its item was evicted and the slot saved again, then marked by
    another warm start: the old item's CRC-32 is not the new one's."""
    with SharedCatalog.for_arena(arena) as writer:
        save(writer, arena, {"a": 100})
    with SharedCatalog.for_arena(arena) as catalog:
        catalog.begin_verify()
        catalog._enter(update=False)
        try:
            old = catalog._take_slice(10**9)
        finally:
            catalog._exit()
        catalog.evict("a")
        assert save(catalog, arena, {"b": 100}) == {"b": old[0][0]}  # the slot again
        catalog.begin_verify()
        assert catalog.verify_now(old) == 0
        assert catalog.state("b") is ItemState.UNVERIFIED and header(catalog)[2:] == (1, 100, 0)
        assert catalog.verify_step() == (1, 0) and catalog.lookup("b") is not None
        catalog.check()


def test_a_verifier_that_fails_after_taking_its_slice_leaves_it_to_the_next(arena, monkeypatch):
    with SharedCatalog.for_arena(arena) as writer:
        save(writer, arena, {"a": 100, "b": 100})
    with SharedCatalog.for_arena(arena) as catalog:
        catalog.begin_verify()
        points = []

        def fail(point):
            points.append(point)
            if point == "verify:taken":
                raise RuntimeError("the verifier died")

        monkeypatch.setattr(fault_points, "hook", fail)
        with pytest.raises(RuntimeError, match="the verifier died"):
            catalog.verify_step(100)
        assert points == ["verify:taken"]  # after the slice was taken, before any check
        assert catalog._w[H_VERIFY_CURSOR] == 1 and catalog.verification().items_left == 2
        monkeypatch.setattr(fault_points, "hook", None)
        assert catalog.verify_step() == (1, 1)  # "b", from the cursor
        assert catalog.verify_step() == (1, 0)  # "a": the cursor started over
        catalog.check()


def test_a_pinning_lookup_of_an_unverified_item_checks_it_then_pins_it(arena):
    with SharedCatalog.for_arena(arena) as writer:
        save(writer, arena, {"a": 100, "b": 100})
        change(writer, arena, "b")
    with SharedCatalog.for_arena(arena) as catalog:
        catalog.begin_verify()
        entry = catalog.lookup("a", pin=True)  # checked at once, then served pinned
        assert entry is not None and entry.pins == 1 and catalog.entry("a").pins == 1
        assert catalog.lookup("b", pin=True) is None  # checked: changed, dropped
        assert catalog.state("b") is None and header(catalog)[2:] == (0, 0, 1)
        catalog.unpin("a")
        catalog.check()
