"""What only the shared catalog does: one catalog for several objects and
processes over one file, its lock, its recovery after a holder died inside an
update, and the release of dead processes' reservations and pins.

The protocol itself (two-phase commit, LRU, pins, errors) is tested on both
implementations in test_catalog.py and test_catalog_stateful.py.
"""

import mmap
import multiprocessing as mp
import os
import signal
import threading
import time
import zlib

import pytest
from catalogs import B, open_shared

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import (
    ArenaLayoutMismatch,
    CatalogCapacityError,
    DuplicateItemError,
    InvalidSizeError,
    ItemStateError,
    UnknownItemError,
)
from ecoffload.engine.base.liveness import process_start_time
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import catalog as shared_catalog
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared import format as shared_catalog_format
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.catalog import SharedCatalog


def reopen(path, **layout) -> SharedCatalog:
    fd = os.open(path, os.O_RDWR)
    try:
        return SharedCatalog(fd, 0, os.fstat(fd).st_size, **layout)
    finally:
        os.close(fd)


def two_ready_items_and_a_counting_reader(path, monkeypatch):
    """A catalog with "a" and "b" ready (slots 0 and 1) and a second object on it whose
    hash-table lookups (``_find``) are recorded: (catalog, reader, keys looked up)."""
    c = open_shared(path, 8)
    for key in "ab":
        c.reserve(key, B)
        c.commit(key)
    other = reopen(path)
    finds = []
    inner = other._find
    monkeypatch.setattr(other, "_find", lambda kb, h: finds.append(kb) or inner(kb, h))
    return c, other, finds


@pytest.mark.parametrize("rebuilt", [False, True], ids=["linked", "rebuilt"])
def test_a_hit_moves_an_item_behind_newer_ones_even_after_a_rebuild(tmp_path, rebuilt):
    c = open_shared(tmp_path / "c", 4)
    for k in "abc":  # slots 0, 1, 2 in use order
        c.reserve(k, B)
        c.commit(k)
    assert c.lookup("b") is not None  # b (after slot 0) to the tail: a, c, b
    c.check()
    if rebuilt:  # an updater died inside an update: the order is rebuilt from the use ticks
        c._w[shared_catalog_format.H_DIRTY] = 1
        assert c.state("a") is ItemState.READY and c.recoveries == 2  # the format's, this
    c.reserve("w", 3 * B)  # evicts the two oldest: a, then c
    assert {k: c.state(k) for k in "abc"} == {"a": None, "b": ItemState.READY, "c": None}
    c.check()
    c.close()


def test_the_allocator_view_reports_the_longest_free_extent_and_block_counts(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    view = c.allocator
    assert (view.largest_free_extent, view.blocks_for(B), view.blocks_for(B + 1)) == (8, 1, 2)
    assert c.reserve("a", 4 * B).extents[0].start == 0
    c.reserve("b", 4 * B)
    assert (view.free_blocks, view.largest_free_extent) == (0, 0)  # none free: 0, not 1
    c.abort("a")
    assert (view.free_blocks, view.largest_free_extent) == (4, 4)  # the extent at block 0
    c.check()
    c.close()


def test_taking_a_class_head_keeps_the_extent_at_block_0_behind_it(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    assert [c.reserve(k, 2 * B).extents[0].start for k in "abcd"] == [0, 2, 4, 6]
    c.abort("a")
    c.abort("c")  # class 1 (2-3 blocks): (4, 2) at its head, (0, 2) behind it
    c.check()
    assert c.reserve("e", 2 * B).extents[0].start == 4  # the head: (0, 2) heads the class
    c.check()  # the class's mask bit and (0, 2)'s back link
    assert c.reserve("f", 2 * B).extents[0].start == 0
    assert c.allocator.free_blocks == 0
    c.check()
    c.close()


def test_pin_records_of_two_processes_on_one_item_come_off_in_any_order(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    for k in "ab":
        c.reserve(k, B)
        c.commit(k)
    c.pin("b")  # record 0
    c.pin("a")  # record 1
    c.unpin("b")  # record 0 free again: the child's, before ours in the item's list
    pinned, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            c.pin("a")
            os.write(pinned[1], b"x")
            os.read(done[0], 1)
        finally:
            os._exit(0)
    try:
        assert os.read(pinned[0], 1) == b"x"
        assert c.lookup("a").pins == 2
        c.unpin("a")  # found behind the child's record, unlinked from behind it
        c.check()
        assert c.lookup("a").pins == 1
        with pytest.raises(ItemStateError) as err:
            c.unpin("a")  # none of ours left: the child's is not ours to take
        assert str(err.value) == (
            "unpin('a'): the item is not pinned by this process (others hold 1 pin(s)); "
            "every unpin must match one pin"
        )
        c.pin("a")
        with pytest.raises(ItemStateError, match=r"by this process \(others hold 1 pin\(s\)\)"):
            c.unpin_many(["a", "a"])  # one of ours, two asked: none taken
        assert c.lookup("a").pins == 2
        c.unpin("a")
        c.check()
    finally:
        os.write(done[1], b"x")
        os.waitpid(pid, 0)
    c.close()


def test_two_objects_share_items_counters_and_lru(tmp_path):
    a = open_shared(tmp_path / "c", 8)
    b = reopen(tmp_path / "c")
    a.reserve("x", 3 * B, "float16", (3, 1024))
    assert b.state("x") is ItemState.WRITING and b.lookup("x") is None
    b.commit("x", checksum=1234)  # another object commits what `a` reserved
    got = a.lookup("x")
    assert (got.checksum, got.dtype, got.shape, got.blocks) == (1234, "float16", (3, 1024), 3)
    for k in "yz":
        b.reserve(k, 2 * B)
        b.commit(k)
    assert a.lookup("x") is not None  # x is now the most recently used, in b too
    b.reserve("w", 4 * B)  # evicts y (oldest), then z
    assert {k: a.state(k) for k in "xyz"} == {"x": ItemState.READY, "y": None, "z": None}
    s = a.stats()
    assert (s.hits, s.evictions, s.items_resident) == (2, 2, 1)
    assert (a.local.hits, b.local.hits) == (2, 0)
    a.check()
    a.close()
    b.close()


def test_two_objects_in_one_process_exclude_each_other(tmp_path):
    a = open_shared(tmp_path / "c", 8)
    b = reopen(tmp_path / "c")
    a.reserve("x", B)
    a._lock()  # held by `a`, as inside an update
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.commit("x"), done.set()))
    t.start()
    assert not done.wait(0.3), "b entered while a held the lock"
    a._unlock()
    assert done.wait(10)
    t.join()
    assert a.state("x") is ItemState.READY
    a.close()
    b.close()


def test_layout_is_recorded_and_checked(tmp_path):
    open_shared(tmp_path / "c", 8, max_items=5, max_key_bytes=16).close()
    c = reopen(tmp_path / "c")
    assert (c.layout.num_blocks, c.layout.max_items, c.layout.max_key_bytes) == (8, 5, 16)
    with pytest.raises(CatalogCapacityError, match="at most 16"):
        c.reserve("k" * 17, B)
    c.close()
    with pytest.raises(ArenaLayoutMismatch, match="catalog num_blocks"):
        reopen(tmp_path / "c", num_blocks=9)
    fd = _zero_file(tmp_path)
    with pytest.raises(ArenaLayoutMismatch, match="catalog magic"):
        SharedCatalog(fd, 0, 4096)  # never formatted, and no layout to format it with
    os.close(fd)


def _zero_file(tmp_path) -> int:
    fd = os.open(tmp_path / "zero", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    return fd


def test_item_slots_run_out_like_blocks(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=2)
    for k in "ab":
        c.reserve(k, B)
    assert c.reserve("c", B) is None  # two WRITING items fill every slot
    c.commit("a")
    assert c.reserve("c", B) is not None and c.state("a") is None  # a evicted for its slot
    c.check()
    c.close()


def test_in_arena_metadata_region(arena_dir):
    meta = shared_catalog.meta_bytes(16, B, max_items=8)
    with Arena.create("cat", block_bytes=B, num_blocks=16, directory=arena_dir,
                      meta_bytes=meta, register_cuda="never") as arena:  # fmt: skip
        assert arena.meta_bytes == meta and arena.host.numel() == 16 * B
        with Arena.attach("cat", directory=arena_dir, register_cuda="never") as other:
            assert other.meta_bytes == meta
            c1 = SharedCatalog.for_arena(arena, max_items=8)
            c2 = SharedCatalog.for_arena(other)
            e = c1.reserve("img", 5 * B)
            arena.host[e.extents[0].start * B : (e.extents[0].start + 5) * B] = 7
            c2.commit("img", generation=e.generation)
            got = c2.lookup("img")
            start = got.extents[0].start
            assert (other.host[start * B : (start + 5) * B] == 7).all()
            c1.close()
            c2.close()


class _Died(BaseException):
    """Stands for a SIGKILL at a fault point (the process stops mid-update)."""


FAULT_POINTS = [
    "reserve:allocated", "reserve:written", "reserve:published", "commit:written",
    "commit:published", "drop:unpublished", "pin:record", "unpin:record", "recover:slots",
    "recover:done",
]  # fmt: skip


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_stopped_inside_an_update_then_recovered(tmp_path, monkeypatch, point):
    c = open_shared(tmp_path / "c", 8)
    for k in "ab":
        c.reserve(k, 2 * B)
        c.commit(k)
    c.pin("b")

    def hook(name):
        if name == point:
            raise _Died(name)

    monkeypatch.setattr(fault_points, "hook", hook)
    with pytest.raises(_Died):
        c.reserve("c", 5 * B)  # evicts a
        c.commit("c")
        c.pin("c")
        c.unpin("c")
        c.evict("c")
        c.recover()
    monkeypatch.setattr(fault_points, "hook", None)
    with pytest.raises(AssertionError, match="dirty"):
        c.check()
    other = reopen(tmp_path / "c")  # the next locker rebuilds
    assert other.recoveries >= 2 and c.state("b") is ItemState.READY and c.entry("b").pins == 1
    other.check()
    assert c.lookup("a") is None or c.state("c") is None  # never both: 4 + 5 > 8 blocks
    assert c.reserve("d", B) is not None
    other.check()
    c.close()
    other.close()


def _hold_then_die(path, ready):
    c = reopen(path)
    c.reserve("w", 4 * B)  # WRITING, never committed
    c.pin("r")
    c.pin("r")
    ready.set()
    time.sleep(60)


def test_dead_process_reservations_and_pins_are_released(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    c.reserve("r", 4 * B)
    c.commit("r")
    c.pin("r")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_then_die, args=(str(tmp_path / "c"), ready))
    p.start()
    assert ready.wait(60)
    assert c.entry("r").pins == 3 and c.state("w") is ItemState.WRITING
    assert c.reserve("x", B) is None  # everything pinned or being written
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    time.sleep(0.06)  # past the reaping rate limit
    assert c.reserve("x", 4 * B) is not None  # space needed: the dead one's blocks come back
    assert c.state("w") is None and c.entry("r").pins == 1  # our own pin stays
    c.unpin("r")
    with pytest.raises(ItemStateError, match="not pinned"):
        c.unpin("r")
    c.check()
    c.close()


def test_a_forked_child_uses_an_inherited_catalog_as_itself(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    c.reserve("x", B)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            c.commit("x")
            os.write(w, b"1" if c._pid == os.getpid() else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and c.state("x") is ItemState.READY
    c.check()
    c.close()


def test_region_must_be_page_aligned_and_large_enough(tmp_path):
    fd = _zero_file(tmp_path)
    with pytest.raises(Exception, match="page aligned"):
        SharedCatalog(fd, 100, 4096, num_blocks=8, block_bytes=B)
    with pytest.raises(Exception, match="needs a region"):
        SharedCatalog(fd, 0, mmap.PAGESIZE, num_blocks=100_000, block_bytes=B)
    os.close(fd)


def _write_and_commit(path, key, generation, extents, payload, out):
    """The worker: writes the bytes where the scheduler reserved them, then commits."""
    c = reopen(path)
    fd = os.open(path, os.O_RDWR)
    data = mmap.mmap(fd, 8 * B, mmap.MAP_SHARED, offset=shared_catalog.meta_bytes(8, B))
    at = 0
    for start, count in extents:
        chunk = payload[at : at + count * B]
        data[start * B : start * B + len(chunk)] = chunk
        at += count * B
    c.commit(key, zlib.crc32(payload), generation=generation)
    out.put(os.getpid())


def _look_up(path, key, out):
    c = reopen(path)
    fd = os.open(path, os.O_RDWR)
    data = mmap.mmap(fd, 8 * B, mmap.MAP_SHARED, offset=shared_catalog.meta_bytes(8, B))
    e = c.pin(key)
    got = b"".join(data[s * B : (s + n) * B] for s, n in e.extents)[: e.nbytes]
    c.unpin(key)
    out.put((zlib.crc32(got) == e.checksum, c.stats().hits))


def test_reserve_write_commit_and_lookup_in_three_processes(tmp_path):
    path = str(tmp_path / "c")
    meta = shared_catalog.meta_bytes(8, B)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, meta + 8 * B)
    scheduler = SharedCatalog(fd, 0, meta, num_blocks=8, block_bytes=B)
    os.close(fd)
    scheduler.reserve("other", 3 * B)  # so the item's blocks do not start at 0
    e = scheduler.reserve("img", 2 * B + 100, "bfloat16", (2, 2098))
    payload = bytes(range(256)) * ((2 * B + 100) // 256) + bytes(range((2 * B + 100) % 256))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    worker = ctx.Process(target=_write_and_commit,
                         args=(path, "img", e.generation, e.extents, payload, out))  # fmt: skip
    worker.start()
    out.get(timeout=60)
    worker.join(30)
    assert scheduler.state("img") is ItemState.READY  # published without the scheduler
    consumer = ctx.Process(target=_look_up, args=(path, "img", out))
    consumer.start()
    assert out.get(timeout=60) == (True, 0)  # pin is not a lookup: no hit counted
    consumer.join(30)
    assert scheduler.entry("img").checksum == zlib.crc32(payload)
    scheduler.abort("other")
    scheduler.check()
    scheduler.close()


def open_ready(path, blocks, ready_blocks) -> SharedCatalog:
    """A fresh shared catalog whose ready watermark starts at ``ready_blocks``."""
    size = shared_catalog.meta_bytes(blocks, B)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return SharedCatalog(fd, 0, size, num_blocks=blocks, block_bytes=B,
                             ready_blocks=ready_blocks)  # fmt: skip
    finally:
        os.close(fd)


def test_only_blocks_below_the_ready_watermark_are_handed_out(tmp_path):
    c = open_ready(tmp_path / "c", 8, 2)
    assert (c.allocator.ready_blocks, c.stats().free_blocks, c.stats().ready_blocks) == (2, 2, 2)
    assert c.reserve("big", 3 * B) is None  # 3 blocks exist, but only 2 are ready
    assert c.reserve("a", B).extents == [(0, 1)] and c.reserve("b", B).extents == [(1, 1)]
    assert c.reserve("c", B) is None
    c.check()
    c.commit("b")
    c.evict("b")  # free [1, 2): the tail the newly ready blocks coalesce with
    assert c.allocator.add_ready(5) == 3 and c.allocator.ready_blocks == 5
    assert c.add_ready(4) == 0 and c.add_ready(5) == 0  # monotonic, idempotent
    c.check()
    assert c.stats().largest_free_extent == 4
    assert c.reserve("d", 4 * B).extents == [(1, 4)]  # one extent: coalesced
    assert c.reserve("e", B) is None  # blocks 5..7 are not ready
    assert c.add_ready(100) == 3 and c.reserve("e", 3 * B).extents == [(5, 3)]
    c.check()
    c.close()


def test_recovery_rebuilds_free_extents_below_the_watermark_only(tmp_path, monkeypatch):
    c = open_ready(tmp_path / "c", 16, 4)
    c.reserve("a", 2 * B)
    c.commit("a")

    def hook(name):
        if name == "add_ready:freed":
            raise _Died(name)

    monkeypatch.setattr(fault_points, "hook", hook)
    with pytest.raises(_Died):
        c.add_ready(10)  # stopped after freeing [4, 10), before the watermark moved
    monkeypatch.setattr(fault_points, "hook", None)
    other = reopen(tmp_path / "c")  # finds it dirty and rebuilds from the slot table
    assert other.recoveries >= 2
    assert (other.allocator.ready_blocks, other.stats().free_blocks) == (4, 2)
    other.check()
    other.recover()  # a clean rebuild keeps the watermark too
    assert other.stats().free_blocks == 2
    assert other.add_ready(10) == 6 and other.stats().free_blocks == 8
    other.check()
    c.close()
    other.close()


def test_check_refuses_a_free_block_beyond_the_watermark(tmp_path):
    c = open_ready(tmp_path / "c", 8, 4)
    c._w[shared_catalog_format.H_READY_BLOCKS] = 2  # the free extent [0, 4) now reaches past it
    with pytest.raises(AssertionError, match="beyond the ready watermark"):
        c.check()
    c.recover()  # a rebuild trusts the watermark: blocks 2 and 3 are neither free nor lost
    assert c.stats().free_blocks == 2
    c.check()
    c.close()


def _data_with(c, data, key, nbytes, fill, checksum=True):
    e = c.reserve(key, nbytes)
    for start, count in e.extents:
        data[start * B : (start + count) * B] = bytes([fill]) * (count * B)
    crc, left = 0, nbytes
    for start, count in e.extents:
        take = min(count * B, left)
        crc = zlib.crc32(data[start * B : start * B + take], crc)
        left -= take
    c.commit(key, crc if checksum else None)
    return e


def test_verify_drops_ready_items_whose_bytes_fail_their_crc(tmp_path, caplog):
    c = open_shared(tmp_path / "c", 16)
    data = bytearray(16 * B)
    good = _data_with(c, data, "good", 2 * B + 5, 1)
    bad = _data_with(c, data, "bad", 3 * B, 2)
    padded = _data_with(c, data, "padded", B + 7, 3)
    _data_with(c, data, "no-crc", B, 4, checksum=False)
    pinned = _data_with(c, data, "pinned", B, 5)
    c.reserve("writing", B)  # ours and alive: kept
    c.pin("pinned")
    data[bad.extents[0][0] * B + 17] ^= 0xFF
    data[pinned.extents[0][0] * B] ^= 0xFF
    end = padded.extents[0][0] * B + B + 7
    data[end : end + 8] = b"\xaa" * 8  # padding past the item's bytes: not its bytes
    before = c.recoveries
    with caplog.at_level("INFO"):
        assert c.verify(memoryview(data)) == 1
    assert c.recoveries == before + 1  # the structural rebuild ran first
    assert {k: c.state(k) for k in ("good", "bad", "padded", "no-crc", "pinned", "writing")} == {
        "good": ItemState.READY, "bad": None, "padded": ItemState.READY,
        "no-crc": ItemState.READY, "pinned": ItemState.READY, "writing": ItemState.WRITING,
    }  # fmt: skip
    assert c.entry("good").extents == good.extents
    assert "'bad' fails its CRC-32" in caplog.text and "'pinned'" in caplog.text
    assert "4 item(s) checked, 1 dropped, 1 without a CRC" in caplog.text
    c.check()
    with pytest.raises(InvalidSizeError, match="16 blocks"):
        c.verify(bytearray(B))
    c.close()


def _produce(path, key):
    c = reopen(path)
    c.reserve(key, B)
    c.commit(key)
    c.close()


def test_entries_name_the_process_that_produced_them(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    p = mp.get_context("spawn").Process(target=_produce, args=(str(tmp_path / "c"), "theirs"))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    mine = c.reserve("mine", B)
    me = (os.getpid(), process_start_time(os.getpid()))
    assert mine.producer == me
    other = reopen(tmp_path / "c")
    assert other.commit("mine").producer == me  # kept after another object's commit
    theirs = c.lookup("theirs")
    assert theirs.producer[0] == p.pid and theirs.producer != me and theirs.producer[1] > 0
    c.close()
    other.close()


def test_lookup_can_pin_a_hit_under_the_same_lock(tmp_path):
    a = open_shared(tmp_path / "c", 8, max_items=4, max_pins=1)
    b = reopen(tmp_path / "c")
    a.reserve("x", B)
    assert a.lookup("x", pin=True) is None  # WRITING: a miss, nothing pinned
    assert b.entry("x").dtype == "uint8"  # b's snapshot of the reservation
    a.commit("x", dtype="bfloat16", shape=(8, 256))  # the writer names dtype and shape
    got = a.lookup("x", pin=True)
    assert (got.pins, got.dtype, got.shape) == (1, "bfloat16", (8, 256))
    seen = b.lookup("x")  # the other object sees the pin and the commit's fields
    assert (seen.pins, seen.dtype, seen.shape) == (1, "bfloat16", (8, 256))
    a.reserve("y", B)
    a.commit("y")
    with pytest.raises(CatalogCapacityError):  # the one pin record is taken
        b.lookup("y", pin=True)
    b.check()  # a refused pin leaves the catalog clean
    assert b.state("y") is ItemState.READY and b.entry("y").pins == 0
    a.unpin("x")
    assert a.entry("x").pins == 0
    a.check()
    a.close()
    b.close()


def test_abort_names_its_reservation_like_commit(tmp_path):
    a = open_shared(tmp_path / "c", 8)
    a.reserve("pad", B)  # x in slot 1: its own generation word is read, not slot 0's
    old = a.reserve("x", B).generation
    a.abort("x", generation=old)
    new = a.reserve("x", B).generation
    with pytest.raises(ItemStateError, match="reserved again"):
        a.abort("x", generation=old)  # a stale abort leaves the newer reservation alone
    assert a.state("x") is ItemState.WRITING
    a.abort("x", generation=new)
    assert a.state("x") is None
    a.check()
    a.close()


@pytest.mark.parametrize("committer", ["reserver", "other"])
def test_entries_kept_by_an_object_equal_the_ones_another_decodes(tmp_path, committer):
    a = open_shared(tmp_path / "c", 16)
    b = reopen(tmp_path / "c")
    a.reserve("pad", 2 * B)  # so the item's extents do not start at 0
    made = a.reserve("x", 3 * B + 5, "float16", (3, 7, 1))
    assert made == b.entry("x")  # built from what reserve wrote, not decoded
    c = a if committer == "reserver" else b
    got = c.commit("x", checksum=99, generation=made.generation, dtype="bfloat16",
                   shape=(6, 7))  # fmt: skip
    for cat in (a, b):
        seen = cat.lookup("x")
        assert seen.state is ItemState.READY and (seen.dtype, seen.shape) == ("bfloat16", (6, 7))
        assert (seen.checksum, seen.blocks, seen.nbytes, seen.generation) == (
            99, 4, 3 * B + 5, made.generation)  # fmt: skip
    assert got == a.entry("x") == b.entry("x")
    # One object per item and object: updated in place by its own commit, rebuilt when
    # first seen READY after another's (which may have changed dtype and shape).
    assert (made is a.entry("x")) == (committer == "reserver")
    a.pin("x")
    assert b.entry("x").pins == 1 and a.lookup("x").pins == 1
    a.unpin("x")
    b.evict("x")
    again = b.reserve("x", B)  # a new reservation of the key: a's old entry is not reused
    assert a.entry("x") == again and a.entry("x") is not made and a.lookup("x") is None
    a.check()
    a.close()
    b.close()


# refusal -> (the call, the error, its message whole): each before anything is written
REFUSALS = {
    "reserve-a-key-in-the-catalog": (
        lambda c: c.reserve("r", B), DuplicateItemError,
        "key 'r' is already in the catalog (ready); look it up instead of saving it again, or "
        "evict it first"),
    "reserve-a-key-too-long": (  # named by its first 40 characters, refused before the lock
        lambda c: c.reserve("0123456789" * 26, B), CatalogCapacityError,
        f"key {'0123456789' * 4!r}... is 260 bytes, this catalog holds keys of at most 256: "
        "create the arena with a larger max_key_bytes"),
    "commit-a-ready-item": (
        lambda c: c.commit("r"), ItemStateError,
        "commit('r') needs an item in state 'writing', found 'ready'"),
    "commit-a-stale-reservation": (
        lambda c: c.commit("w", generation=1), ItemStateError,
        "commit('w'): reservation 1 is gone (the key was reserved again as 3); the bytes "
        "written may be stale"),
    "abort-a-ready-item": (
        lambda c: c.abort("r"), ItemStateError,
        "abort('r') needs an item in state 'writing', found 'ready'"),
    "abort-a-stale-reservation": (
        lambda c: c.abort("w", generation=1), ItemStateError,
        "abort('w'): reservation 1 is gone (the key was reserved again as 3); leaving the "
        "newer one alone"),
    "abort-an-unknown-key": (
        lambda c: c.abort("nope"), UnknownItemError,
        "key 'nope' is not in the catalog (never reserved, aborted or evicted)"),
    "evict-a-pinned-item": (
        lambda c: c.evict("p"), ItemStateError,
        "evict('p'): the item is pinned 1 time(s); unpin it first"),
    "evict-a-reservation": (
        lambda c: c.evict("w"), ItemStateError,
        "evict('w') needs an item in state 'ready', found 'writing'"),
    "lookup-pin-without-a-free-record": (
        lambda c: c.lookup("r", pin=True), CatalogCapacityError,
        "pin('r'): all 1 pin records are in use; create the catalog with a larger max_pins"),
}  # fmt: skip


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_call_leaves_the_catalog_clean(tmp_path, monkeypatch, refusal):
    """A CatalogError is raised before anything is written: the dirty mark is cleared, so
    the next locker does not rebuild (a rebuild of a large catalog stalls every process)."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "0")  # the Python way of each call
    call, error, message = REFUSALS[refusal]
    c = open_shared(tmp_path / "c", 8, max_pins=1)
    for key in ("r", "p", "w"):  # slots 0, 1, 2; p pinned, with the one pin record
        c.reserve(key, B)
    c.commit("r")
    c.commit("p")
    c.pin("p")
    recoveries = c.recoveries
    with pytest.raises(error) as err:
        call(c)
    assert err.value.args == (message,)  # generation 3: w, the third reservation
    assert c._w[shared_catalog_format.H_DIRTY] == 0
    other = reopen(tmp_path / "c")  # the next locker, another object
    assert [other.state(k) for k in ("r", "p", "w")] == [ItemState.READY, ItemState.READY,
                                                         ItemState.WRITING]  # fmt: skip
    assert other.recoveries == recoveries
    c.check()
    c.close()
    other.close()


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_an_object_counts_its_own_hits_and_misses_whichever_path_serves_them(
    tmp_path, monkeypatch, native
):
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1" if native else "0")
    c = open_shared(tmp_path / "c", 8)
    if native:
        assert c._fast is not None, "the C fast paths are not built"
    c.reserve("a", B)
    c.commit("a")
    for _ in range(2):
        assert c.lookup("a").key == "a"
        assert c.lookup("x") is None
    assert (c.local.hits, c.local.misses) == (2, 2)
    if native:
        assert c._fast.hits == 2  # the C path served both hits
    other = reopen(tmp_path / "c")
    assert other.lookup("a") is not None and other.lookup("y") is None
    assert (other.local.hits, other.local.misses) == (1, 1)
    assert (c.local.hits, c.local.misses) == (2, 2)
    assert (c.stats().hits, c.stats().misses) == (3, 3)  # the host-wide counters: both
    c.close()
    other.close()


def test_a_hit_on_an_item_seen_ready_asks_no_table(tmp_path, monkeypatch):
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "0")  # the Python way's own shortcut
    c, other, finds = two_ready_items_and_a_counting_reader(tmp_path / "c", monkeypatch)
    for _ in range(3):
        assert [other.lookup(k).key for k in "ba"] == ["b", "a"]
    assert finds == [b"b", b"a"]  # each once, the first time
    c.evict("b")
    assert other.lookup("b") is None  # its slot freed: the table asked again
    assert finds == [b"b", b"a", b"b"]
    assert other.stats().hits == 6
    other.check()
    other.close()
    c.close()


def test_a_lookup_marks_the_catalog_dirty_only_to_relink_or_pin(tmp_path, monkeypatch):
    """A hit marks the catalog dirty only from where it changes a structure: a lookup
    killed before that leaves nothing for the next locker to rebuild."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "0")
    c = open_shared(tmp_path / "c", 8)
    for key in "ab":
        c.reserve(key, B)
        c.commit(key)
    other = reopen(tmp_path / "c")
    marks = []

    def watch(name):
        inner = getattr(other, name)

        def watched(*args, **kwargs):
            marks.append((name, other._w[shared_catalog_format.H_DIRTY]))  # inside the call
            return inner(*args, **kwargs)

        monkeypatch.setattr(other, name, watched)

    for name in ("_slot_of", "_snapshot", "_pin_slot"):
        watch(name)
    assert other.lookup("nope") is None
    assert other.lookup("b").key == "b"  # the LRU's tail already: nothing relinked
    assert other.lookup("b", pin=True).pins == 1
    names = ["_slot_of", "_slot_of", "_snapshot", "_snapshot", "_pin_slot"]  # the table found b
    assert marks == [*((name, 0) for name in names[:-1]), ("_pin_slot", os.getpid())]
    assert other._w[shared_catalog_format.H_DIRTY] == 0
    other.check()
    other.close()
    c.close()


def test_add_ready_of_a_watermark_already_reached_takes_no_lock(tmp_path, monkeypatch):
    c = open_ready(tmp_path / "c", 8, 4)
    got = []

    def hook(name):
        if name == "reserve:allocated":  # this thread holds the catalog's lock here
            got.append((c.add_ready(4), c.add_ready(3)))

    monkeypatch.setattr(fault_points, "hook", hook)
    assert c.reserve("a", B) is not None
    monkeypatch.setattr(fault_points, "hook", None)
    assert got == [(0, 0)]  # answered from the word alone: no lock, so no EDEADLK
    c.check()
    c.close()


def test_add_ready_never_lowers_a_watermark_another_process_raised_meanwhile(tmp_path, monkeypatch):
    c = open_ready(tmp_path / "c", 16, 4)
    other = reopen(tmp_path / "c")
    enter = c._enter

    def raced(*args, **kwargs):  # another process raises it to 8 while this one waits
        monkeypatch.setattr(c, "_enter", enter)
        other.add_ready(8)
        return enter(*args, **kwargs)

    monkeypatch.setattr(c, "_enter", raced)
    assert c.add_ready(6) == 0  # 6 > 4 when asked, below 8 once locked: nothing to add
    assert (c.allocator.ready_blocks, c.stats().free_blocks) == (8, 8)
    c.check()
    c.close()
    other.close()


def test_reserve_and_commit_write_the_dtype_and_shape_they_are_given_whole(tmp_path):
    a = open_shared(tmp_path / "c", 8)
    made = a.reserve("x", B, "float8_e5m2fnuz", (1, 2, 3, 4, 5, 6, 7, 8))  # 15 bytes: two words
    b = reopen(tmp_path / "c")  # the writer: another object
    seen = b.entry("x")  # decoded from the slot, not the reserving object's entry
    assert (seen.dtype, seen.shape) == ("float8_e5m2fnuz", (1, 2, 3, 4, 5, 6, 7, 8))
    dims = (2, 3, 4, 5, 6, 7, 8, 9)  # every dimension word
    got = b.commit("x", generation=made.generation, dtype="float8_e4m3fnuz", shape=dims)
    assert (got.dtype, got.shape) == ("float8_e4m3fnuz", dims)  # 15 bytes: two words
    fresh = reopen(tmp_path / "c")
    for reader in (a, fresh):  # one that saw the reservation, one that did not
        seen = reader.lookup("x")
        assert (seen.dtype, seen.shape, seen.nbytes) == ("float8_e4m3fnuz", dims, B)
    a.check()
    for c in (a, b, fresh):
        c.close()


def test_reservations_stop_asking_the_arena_once_every_block_is_ready(tmp_path):
    c = open_ready(tmp_path / "c", 4, 1)
    asked = []
    c.follow_ready(lambda: asked.append(1) or 2 * len(asked))  # populate: 2, then 4 blocks
    assert c.reserve("a", 2 * B).extents == [(0, 2)] and len(asked) == 1
    assert c.reserve("b", 2 * B).extents == [(2, 2)] and len(asked) == 2
    for key in "cd":  # all 4 ready: the arena's progress is not read again
        assert c.reserve(key, B) is None
    assert len(asked) == 2
    c.check()
    c.close()
