"""Opening the shared catalog's region (engine/catalog/shared/region.py): the
first opener formats it with the layout given, later openers check theirs
against it, every refusal says what was found and leaves no descriptor or map
behind, and opening reaps what dead processes left."""

import fcntl
import gc
import logging
import mmap
import os
import signal
import threading
import weakref
import zlib

import pytest
from catalogs import B

from ecoffload.engine.arena import populate as populate_mod
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.arena.janitor import ofd_lock
from ecoffload.engine.base.errors import ArenaLayoutMismatch, CatalogLockError, InvalidSizeError
from ecoffload.engine.base.liveness import boot_id
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import format as f
from ecoffload.engine.catalog.shared import recovery as shared_catalog_recovery
from ecoffload.engine.catalog.shared import robust_mutex
from ecoffload.engine.catalog.shared.catalog import SharedCatalog, meta_bytes

LAYOUT = {"num_blocks": 8, "block_bytes": B, "max_items": 5, "max_key_bytes": 16,
          "max_pins": 6}  # fmt: skip


def zero_file(path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    return fd


def open_region(path, size: int | None = None, **layout) -> SharedCatalog:
    """A catalog over the whole file at ``path`` (``size``: the region's bytes)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return SharedCatalog(fd, 0, size or os.fstat(fd).st_size, path=str(path), **layout)
    finally:
        os.close(fd)


def descriptors() -> set[str]:
    """This process's open descriptors, once garbage (an earlier test's catalog) is gone."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


def refusal(exc_type, path, size=None, **layout):
    """The error opening ``path`` raises; the opener left no descriptor behind."""
    before = descriptors()
    with pytest.raises(exc_type) as err:
        open_region(path, size, **layout)
    assert descriptors() == before
    return err.value


def test_the_first_opener_formats_the_header_with_its_layout(tmp_path):
    size = meta_bytes(8, B, 5, 16, 6)
    os.close(zero_file(tmp_path / "c", size))
    c = open_region(tmp_path / "c", **LAYOUT, ready_blocks=3)
    w = c._w
    header = [w[k] for k in (f.H_MAGIC, f.H_VERSION, f.H_META_BYTES, f.H_NUM_BLOCKS,
                             f.H_BLOCK_BYTES, f.H_MAX_ITEMS, f.H_MAX_KEY, f.H_MAX_PINS,
                             f.H_BUCKETS, f.H_READY_BLOCKS, f.H_DIRTY)]  # fmt: skip
    assert header == [f.MAGIC, f.VERSION, size, 8, B, 5, 16, 6, 8, 3, 0]
    assert (w[f.H_BOOT], w[f.H_BOOT + 1]) == boot_id()
    assert c.layout == f.Layout(8, B, 5, 16, 6) and c.path == str(tmp_path / "c")
    c.check()
    c.close()
    again = open_region(tmp_path / "c", **LAYOUT, ready_blocks=8)  # formatted: ignored
    assert again.allocator.ready_blocks == 3 and again.recoveries == 1  # the format's
    again.close()


@pytest.mark.parametrize(("given", "ready"), [(None, 8), (0, 0), (5, 5), (-2, 0), (9, 8)])
def test_the_ready_watermark_starts_within_the_blocks(tmp_path, given, ready):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B, ready_blocks=given)
    assert c.allocator.ready_blocks == ready
    c.check()
    c.close()


def test_later_openers_take_the_recorded_layout_or_are_refused_by_field(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B, 5, 16, 6)))
    open_region(tmp_path / "c", **LAYOUT).close()
    c = open_region(tmp_path / "c")  # None takes what the region records
    assert c.layout == f.Layout(8, B, 5, 16, 6)
    c.close()
    for name, value in LAYOUT.items():
        err = refusal(ArenaLayoutMismatch, tmp_path / "c", **(LAYOUT | {name: value + 1}))
        assert (err.path, err.field, err.expected, err.found) == (
            str(tmp_path / "c"), f"catalog {name}", value + 1, value)  # fmt: skip


def test_a_region_without_a_catalog_needs_both_block_sizes_to_format_it(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    for layout in ({}, {"num_blocks": 8}, {"block_bytes": B}):
        err = refusal(ArenaLayoutMismatch, tmp_path / "c", **layout)
        assert (err.path, err.field, err.expected, err.found) == (
            str(tmp_path / "c"), "catalog magic", f.MAGIC, 0)  # fmt: skip


def test_refusals_of_the_region_say_what_it_needs(tmp_path):
    os.close(zero_file(tmp_path / "c", 4 * mmap.PAGESIZE))
    fd = os.open(tmp_path / "c", os.O_RDWR)
    with pytest.raises(InvalidSizeError) as err:
        SharedCatalog(fd, 100, mmap.PAGESIZE, num_blocks=8, block_bytes=B)
    assert str(err.value) == "the region offset must be page aligned, got 100"
    os.close(fd)
    err = refusal(InvalidSizeError, tmp_path / "c", 1016, num_blocks=8, block_bytes=B)
    assert str(err) == "the catalog region must hold its 1024-byte header, got 1016 bytes"
    err = refusal(InvalidSizeError, tmp_path / "c", 1030, num_blocks=8, block_bytes=B)
    assert str(err) == ("the catalog region is made of 8-byte words, got 1030 bytes: give "
                        "the size meta_bytes() computed")  # fmt: skip
    err = refusal(InvalidSizeError, tmp_path / "c", 1024, num_blocks=8, block_bytes=B)
    assert str(err) == (f"the catalog needs a region of {meta_bytes(8, B)} bytes, got 1024: "
                        "size the region with shared_catalog.meta_bytes(...)")  # fmt: skip
    need = meta_bytes(100_000, B)
    err = refusal(InvalidSizeError, tmp_path / "c", num_blocks=100_000, block_bytes=B)
    assert str(err) == (f"the catalog needs a region of {need} bytes, got {4 * mmap.PAGESIZE}: "
                        "size the region with shared_catalog.meta_bytes(...)")  # fmt: skip
    with open(tmp_path / "c", "rb") as file:
        assert file.read(8) == bytes(8)  # left unformatted


def test_a_recorded_size_that_disagrees_with_the_layout_or_the_region_is_refused(tmp_path):
    size = meta_bytes(8, B)
    os.close(zero_file(tmp_path / "c", 2 * size))
    open_region(tmp_path / "c", size, num_blocks=8, block_bytes=B).close()

    def record(meta: int) -> None:
        with open(tmp_path / "c", "r+b") as file:
            file.seek(8 * f.H_META_BYTES)
            file.write(meta.to_bytes(8, "little"))

    record(size + mmap.PAGESIZE)
    err = refusal(ArenaLayoutMismatch, tmp_path / "c", 2 * size)
    assert (err.field, err.expected, err.found) == ("catalog meta_bytes", size,
                                                    size + mmap.PAGESIZE)  # fmt: skip
    record(size)
    open_region(tmp_path / "c", size).close()
    err = refusal(ArenaLayoutMismatch, tmp_path / "c", size - mmap.PAGESIZE)  # too short
    assert (err.path, err.field, err.expected, err.found) == (
        str(tmp_path / "c"), "catalog meta_bytes", size, size)  # fmt: skip
    with open(tmp_path / "c", "r+b") as file:
        file.seek(8 * f.H_VERSION)
        file.write((f.VERSION - 1).to_bytes(8, "little"))
    err = refusal(ArenaLayoutMismatch, tmp_path / "c", size)
    assert (err.path, err.field, err.expected, err.found) == (
        str(tmp_path / "c"), "catalog version", f.VERSION, f.VERSION - 1)  # fmt: skip


def test_without_a_robust_mutex_the_catalog_is_refused_by_name(tmp_path, monkeypatch):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    monkeypatch.setattr(robust_mutex, "PT", None)
    err = refusal(CatalogLockError, tmp_path / "c", num_blocks=8, block_bytes=B)
    assert str(err) == (
        "the C library offers no robust process-shared pthread mutex "
        "(pthread_mutex_consistent): the shared catalog needs glibc or musl on Linux"
    )


def test_a_lock_from_another_boot_is_made_afresh_and_the_boot_recorded(tmp_path, caplog):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B)
    c.reserve("a", B)
    c.commit("a")
    c._w[f.H_BOOT + 1] ^= 1
    c.close()
    with caplog.at_level(logging.INFO, logger="ecoffload.engine.catalog.shared.catalog"):
        c = open_region(tmp_path / "c")
    assert [r.getMessage() for r in caplog.records] == [
        f"catalog {tmp_path / 'c'}: its lock is from another boot; initialising it afresh"
    ]
    assert (c._w[f.H_BOOT], c._w[f.H_BOOT + 1]) == boot_id()
    assert "a" in c and c.recoveries == 1  # nothing rebuilt: it was clean
    c.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ecoffload.engine.catalog.shared.catalog"):
        open_region(tmp_path / "c").close()
    assert caplog.records == []  # this boot's: nothing to say


def test_opening_reaps_what_a_dead_process_reserved(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        code = 1
        try:
            code = 0 if c.reserve("dead", 3 * B) is not None else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert c._w[f.H_FREE_BLOCKS] == 5  # this object has not reaped since
    other = open_region(tmp_path / "c")
    assert other.state("dead") is None and other.stats().free_blocks == 8
    other.check()
    other.close()
    c.close()


def test_close_is_idempotent_and_leaves_nothing_mapped(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    before = descriptors()
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B)
    assert descriptors() > before  # its own description of the file, and the map's
    c.close()
    c.close()
    assert descriptors() == before and c._mm is None
    for name in ("_w", "_i", "_k", "_fs", "_fe", "_fn", "_fp", "_ec", "_en", "_mx", "_fast"):
        assert name not in c.__dict__  # a later call fails on the name, never the address
    with open_region(tmp_path / "c") as d:
        assert d._mm is not None
    assert d._mm is None and descriptors() == before
    d = open_region(tmp_path / "c")
    del d
    gc.collect()
    assert descriptors() == before  # dropped without close: closed all the same


def test_for_arena_needs_a_metadata_region_and_follows_the_arena_weakly(tmp_path):
    with Arena.create("plain", block_bytes=B, num_blocks=8, directory=str(tmp_path),
                      register_cuda="never") as arena:  # fmt: skip
        with pytest.raises(InvalidSizeError) as err:
            SharedCatalog.for_arena(arena)
        assert str(err.value) == (
            f"arena {arena.path} has no metadata region: create it with "
            "meta_bytes=shared_catalog.meta_bytes(...)"
        )
    arena = Arena.create("cat", block_bytes=B, num_blocks=8, directory=str(tmp_path),
                         meta_bytes=meta_bytes(8, B, 4), register_cuda="never")  # fmt: skip
    c = SharedCatalog.for_arena(arena, max_items=4)
    assert (c.layout.num_blocks, c.layout.max_items, c.path) == (8, 4, arena.path)
    assert c._ready_of() == arena.ready_blocks == 8
    ref = weakref.ref(arena)
    arena.close()
    del arena
    gc.collect()
    assert ref() is None  # the catalog kept no reference to it
    assert c._ready_of() == 0
    c.close()


def test_for_arena_formats_with_the_arena_s_ready_watermark_and_close_unmaps_its_data(
    tmp_path, monkeypatch
):
    """An arena still populating: its catalog starts with the blocks ready so far (a
    reservation gets no unpopulated block), follows the populate, and its mapping of
    the data area (a warm start's verification) goes with it at close."""
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", B)  # chunk i = block i
    real, release, calls = populate_mod.prefault, threading.Event(), []

    def fault(*args):
        calls.append(args)
        if len(calls) == 2:  # chunk 1 (chunk 0 ran in create): held
            assert release.wait(30), "the test never released chunk 1"
        real(*args)

    monkeypatch.setattr(populate_mod, "prefault", fault)
    arena = Arena.create("cat", block_bytes=B, num_blocks=6, directory=str(tmp_path),
                         meta_bytes=meta_bytes(6, B, 4), register_cuda="never",
                         populate="background", populate_threads=1)  # fmt: skip
    try:
        assert arena.ready_blocks == 1
        c = SharedCatalog.for_arena(arena, max_items=4)
        assert c.stats().ready_blocks == 1  # formatted with the arena's watermark
        assert c.reserve("one", B) is not None and c.reserve("two", B) is None  # no room yet
        release.set()
        assert arena.wait_ready(30)
        assert c.reserve("two", B) is not None  # the watermark followed the populate
        c.abort("one")
        c.abort("two")
        view = c._data_view()
        c.close()
        assert view.closed  # unmapped with the catalog, not when collected
    finally:
        release.set()
        arena.close()


def test_a_catalog_opened_without_a_path_is_named_by_its_descriptor(tmp_path):
    fd = zero_file(tmp_path / "c", meta_bytes(8, B))
    c = SharedCatalog(fd, 0, meta_bytes(8, B), num_blocks=8, block_bytes=B)
    assert c.path == f"fd {fd}"
    c.close()
    os.close(fd)


def test_the_first_opener_says_nothing_of_another_boot(tmp_path, caplog):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    with caplog.at_level(logging.INFO, logger="ecoffload.engine.catalog.shared.catalog"):
        c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B)
    assert caplog.records == []  # it recorded this boot as it formatted
    assert (c._w[f.H_BOOT], c._w[f.H_BOOT + 1]) == boot_id()
    c.close()


def test_a_key_is_chained_in_the_bucket_its_crc32_names(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B, 5)))
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B, max_items=5)
    for key in ("a", "b", "c", "d", "e"):  # 8 buckets: what another process or the C path reads
        s = c.reserve(key, B).slot
        at = c._w[c._bk + zlib.crc32(key.encode()) % 8]
        while at != s:
            assert at >= 0, f"{key!r} is not in bucket {zlib.crc32(key.encode()) % 8}"
            at = c._w[c._sl + at * f.SLOT_WORDS + f.S_HNEXT]
    c.close()


def test_a_refused_open_leaves_nothing_for_its_finaliser(tmp_path, monkeypatch):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    raised = []
    monkeypatch.setattr("sys.unraisablehook", raised.append)
    fd = os.open(tmp_path / "c", os.O_RDWR)
    for offset, size in ((100, mmap.PAGESIZE), (0, 1016), (0, 1030)):  # nothing opened
        with pytest.raises(InvalidSizeError):
            SharedCatalog(fd, offset, size, num_blocks=8, block_bytes=B)
        gc.collect()
    os.close(fd)
    assert raised == []


def test_opening_waits_for_another_opener_formatting_the_region(tmp_path):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    other = os.open(tmp_path / "c", os.O_RDWR)  # another description: its lock conflicts
    ofd_lock(other, fcntl.F_WRLCK, 0, wait=True)
    got = []
    t = threading.Thread(target=lambda: got.append(open_region(tmp_path / "c", num_blocks=8,
                                                              block_bytes=B)))  # fmt: skip
    t.start()
    t.join(0.3)
    assert t.is_alive() and got == []  # waiting for the first byte's lock
    ofd_lock(other, fcntl.F_UNLCK, 0, wait=False)
    t.join(20)
    assert len(got) == 1
    got[0].check()
    got[0].close()
    os.close(other)


def test_an_error_while_reaping_on_open_leaves_the_rebuild_to_the_next_locker(
    tmp_path, monkeypatch
):
    os.close(zero_file(tmp_path / "c", meta_bytes(8, B)))
    c = open_region(tmp_path / "c", num_blocks=8, block_bytes=B)
    c.reserve("w", B)  # a reservation: opening asks whether its process lives
    recoveries = c.recoveries

    def fails(*args):
        raise RuntimeError("/proc unreadable")

    monkeypatch.setattr(shared_catalog_recovery, "alive", fails)
    before = descriptors()
    with pytest.raises(RuntimeError, match="/proc unreadable"):
        open_region(tmp_path / "c")
    assert descriptors() == before
    monkeypatch.undo()
    assert c.state("w") is ItemState.WRITING  # the reap may have stopped anywhere: rebuilt
    assert c.recoveries == recoveries + 1
    c.check()
    c.close()
