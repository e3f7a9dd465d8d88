"""A warm restart of a persistent shared arena serves at once and verifies in the background.

The warm start only recovers the catalog's structure and marks every item saved
with a CRC-32 UNVERIFIED; the items are checked afterwards, by a thread of every
process that opens the arena meanwhile (or at once by a lookup), and an item
whose bytes changed while nobody held the file is never served.

``ECOFFLOAD_WARM_TEST_BYTES`` sizes the one large arena (default 1 GiB, for CI;
the issue's figure is measured at 8 GiB: ``ECOFFLOAD_WARM_TEST_BYTES=8GiB``).
"""

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time

import pytest

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import InvalidSizeError, ItemStateError
from ecoffload.engine.base.items import item_crc32
from ecoffload.engine.base.sizes import parse_bytes
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared.catalog import SharedCatalog, meta_bytes
from ecoffload.engine.catalog.shared.format import H_DIRTY, H_VERIFY_LEFT
from ecoffload.engine.shared_cache import open_catalog, open_shared_arena
from ecoffload.engine.survey import CatalogSnapshot
from ecoffload.profiling.bench_startup import available_bytes, fill_persistent

ITEM, BLOCK = 256 << 10, 64 << 10
WARM_BYTES = parse_bytes(os.environ.get("ECOFFLOAD_WARM_TEST_BYTES", "1GiB"), name="size")


def _open(name, directory, size, **kw):
    return open_shared_arena(name, block_bytes=BLOCK, num_blocks=size // BLOCK,
                             layout_key="bench-warm", directory=directory,
                             register_cuda="never", populate="eager", persistent=True,
                             max_items=size // ITEM, **kw)  # fmt: skip


def wait_verified(catalog, timeout_s):
    deadline = time.monotonic() + timeout_s
    while catalog.verification().items_left:
        assert time.monotonic() < deadline, catalog.verification()
        time.sleep(0.005)


def _joiner(name, directory, size, broken, go, out):
    """Another instance, opening the arena just after the restart began: how long its
    open took, whether items were left to verify then, its lock waits (one stats()
    call each) while they were, and any changed item it was served."""
    go.wait()
    time.sleep(0.05)  # the restart has begun
    t0 = time.perf_counter()
    arena = _open(name, directory, size)
    with arena, open_catalog(arena, max_items=size // ITEM) as catalog:
        opened = time.perf_counter() - t0
        left_at_join = catalog.verification().items_left
        waits, served = [], []
        while catalog.verification().items_left:
            t = time.perf_counter()
            catalog.stats()
            waits.append(time.perf_counter() - t)
            served += [k for k in broken if catalog.lookup(k) is not None]
            time.sleep(0.001)
    out.put((opened, left_at_join, waits, served))


def test_a_warm_restart_serves_within_a_second_and_never_an_item_changed_while_closed():
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="ecoffload-warm-", dir=shm)
    name, joiner = "warm", None
    try:
        if available_bytes(directory) < WARM_BYTES:
            pytest.skip(f"{WARM_BYTES} bytes do not fit {directory} and memory here")
        offsets = fill_persistent(name, WARM_BYTES, ITEM, BLOCK, directory)
        n = len(offsets)
        changed = sorted({0, n // 2, n - 3, n - 1})  # n - 1: the walk reaches it last
        fd = os.open(os.path.join(directory, name), os.O_RDWR)
        for i in changed:  # stray writes while nobody held the file
            at = offsets[i] + 100
            os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 2, at)), at)
        os.close(fd)
        broken = [f"item-{i}" for i in changed]
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        joiner = ctx.Process(target=_joiner, args=(name, directory, WARM_BYTES, broken, go, out))
        joiner.start()
        time.sleep(3)  # its imports
        go.set()
        t0 = time.perf_counter()
        arena = _open(name, directory, WARM_BYTES)
        with arena, open_catalog(arena, max_items=WARM_BYTES // ITEM) as catalog:
            assert arena.warm_started
            hit = catalog.lookup(f"item-{n - 2}")  # last but one: the walk's end
            first_hit = time.perf_counter() - t0
            assert hit is not None and first_hit < 1.0, first_hit
            left_then = catalog.verification().items_left
            for key in broken:  # never served, checked or not by the walk yet
                assert catalog.lookup(key) is None and catalog.state(key) is None
            wait_verified(catalog, timeout_s=300)
            verified = time.perf_counter() - t0
            v = catalog.verification()
            assert (v.items, v.nbytes, v.dropped, v.fraction) == (n, n * ITEM, len(changed), 1.0)
            assert len(catalog) == n - len(changed)
            host = arena.host.numpy()
            for i in (1, n // 3, n - 2):  # served with their bytes
                entry = catalog.lookup(f"item-{i}")
                head = bytes(host[entry.extents[0][0] * BLOCK :][:8])
                assert int.from_bytes(head, "little") == i
                assert item_crc32(host, entry.extents, BLOCK, ITEM) == entry.checksum
            del host
            catalog.check()
            opened, left_at_join, waits, served = out.get(timeout=300)
            joiner.join(60)
        waits.sort()
        p99 = waits[len(waits) * 99 // 100] if waits else 0
        print(f"\n{WARM_BYTES / 2**30:.1f} GiB, {n} items: first hit {first_hit:.3f} s "
              f"({left_then} items left then), every item verified at {verified:.3f} s; "
              f"joiner: open {opened:.3f} s, {len(waits)} lock takes: longest "
              f"{max(waits, default=0) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, median "
              f"{waits[len(waits) // 2] * 1e3 if waits else 0:.3f} ms")  # fmt: skip
        assert joiner.exitcode == 0 and served == []
        assert left_at_join and waits, "the joiner came after the verification: a bigger arena"
        # Served long before the verification ends, the joiner too (not after it, as when
        # the warm start verified every byte under the lock); its lock waits are a few ms
        # (the longest allows for a descheduled holder on a busy host).
        assert first_hit < min(1.0, verified / 2) and opened < min(1.0, verified / 2)
        assert p99 < 0.01 and waits[-1] < 0.1, (p99, waits[-1])
    finally:
        if joiner is not None and joiner.is_alive():  # a failed assertion left it waiting
            joiner.kill()
            joiner.join(60)
        try:
            Arena.remove_shared(name, directory=directory)
        finally:
            shutil.rmtree(directory)


SMALL, SMALL_BLOCK = 32, 4096


def _small_open(directory, on_warm_start=None):
    return Arena.open_shared("s", block_bytes=SMALL_BLOCK, num_blocks=SMALL, directory=directory,
                             register_cuda="never", persistent=True, on_warm_start=on_warm_start,
                             meta_bytes=meta_bytes(SMALL, SMALL_BLOCK))  # fmt: skip


def _small_fill(directory, keys, *, crc=True):
    """Save ``keys`` (one block each, filled with their index) and close; their offsets."""
    with _small_open(directory) as arena, SharedCatalog.for_arena(arena) as catalog:
        host, at = arena.host.numpy(), []
        for i, key in enumerate(keys):
            e = catalog.reserve(key, SMALL_BLOCK)
            start = e.extents[0][0] * SMALL_BLOCK
            host[start : start + SMALL_BLOCK] = i
            checksum = item_crc32(host, e.extents, SMALL_BLOCK, SMALL_BLOCK) if crc else None
            catalog.commit(key, checksum)
            at.append(arena.meta_offset + arena.meta_bytes + start)
        del host
    return at


def _flip(directory, at):
    with open(os.path.join(directory, "s"), "r+b") as f:
        f.seek(at)
        f.write(b"\xff")


def test_an_unverified_item_is_a_miss_for_every_reader_until_checked(arena_dir):
    at = _small_fill(arena_dir, ["a", "b", "c"])
    with _small_open(arena_dir) as arena, SharedCatalog.for_arena(arena) as catalog:
        catalog.reserve("plain", SMALL_BLOCK)
        catalog.commit("plain")  # saved without a CRC-32: cannot be checked
    _flip(arena_dir, at[1])
    marked = []
    with (
        _small_open(arena_dir, lambda a: marked.append(SharedCatalog.for_arena(a).begin_verify()))
        as arena,
        SharedCatalog.for_arena(arena) as catalog,
        SharedCatalog(arena.fileno(), arena.meta_offset, arena.meta_bytes) as blind,
    ):  # fmt: skip
        assert marked == [(3, 3 * SMALL_BLOCK, 1)] and arena.warm_started
        seen = {i.key: i.state for i in CatalogSnapshot.take(arena.path).items()}
        assert seen == {"a": "unverified", "b": "unverified", "c": "unverified", "plain": "ready"}
        assert catalog.state("a") is ItemState.UNVERIFIED and "a" not in catalog
        assert catalog.state("plain") is ItemState.READY and "plain" in catalog
        with pytest.raises(ItemStateError) as err:
            catalog.pin("a")
        assert str(err.value) == (
            "pin('a') needs an item in state 'ready', found 'unverified' (its CRC-32 is not "
            "checked yet since the warm start): look it up instead"
        )
        with pytest.raises(ItemStateError):
            catalog.pin_many(["plain", "a"])
        stats = catalog.stats()
        assert (stats.verify_items_left, stats.verify_bytes_left, stats.verify_bytes) == (
            3, 3 * SMALL_BLOCK, 3 * SMALL_BLOCK)  # fmt: skip
        # Without the data area (a catalog not opened for the arena) it stays a miss.
        assert blind.lookup("a") is None and blind.state("a") is ItemState.UNVERIFIED
        with pytest.raises(InvalidSizeError, match="verifying items needs the arena's data"):
            blind.verify_step()
        catalog.evict("c")  # evictable like any READY item
        assert catalog.verification().items_left == 2
        catalog.check()
        # A crash inside an update: recovery recounts what is left from the marks.
        catalog._w[H_VERIFY_LEFT] = 99
        catalog._w[H_DIRTY] = 1
        assert catalog.stats().verify_items_left == 2 and catalog.recoveries
        catalog.check()
        assert catalog.lookup("a").checksum is not None  # checked by the lookup: served
        assert catalog.state("a") is ItemState.READY and catalog.pin("a").pins == 1
        assert catalog.lookup("b") is None and catalog.state("b") is None  # changed: dropped
        v = catalog.verification()
        assert (v.items, v.items_left, v.dropped, v.fraction) == (3, 0, 1, 1.0)
        catalog.unpin("a")
        catalog.check()
    assert Arena.remove_shared("s", directory=arena_dir)


def _dies_verifying(directory):
    from ecoffload.engine import shared_cache

    def die(point):
        if point == "verify:taken":
            os.kill(os.getpid(), signal.SIGKILL)

    fault_points.hook = die
    arena = shared_cache.open_shared_arena("s", block_bytes=SMALL_BLOCK, num_blocks=SMALL,
                                           layout_key="", directory=directory,
                                           register_cuda="never", populate="eager",
                                           persistent=True)  # fmt: skip
    time.sleep(60)  # killed by its verifier thread long before
    arena.close()


def _verifies(directory):
    from ecoffload.engine import shared_cache

    with shared_cache.open_shared_arena("s", block_bytes=SMALL_BLOCK, num_blocks=SMALL,
                                        layout_key="", directory=directory,
                                        register_cuda="never", populate="eager",
                                        persistent=True) as arena:  # fmt: skip
        arena._verifier._thread.join(60)


def test_a_verifier_that_dies_mid_slice_leaves_it_to_the_next_opener(arena_dir):
    keys = [f"k{i}" for i in range(8)]
    at = _small_fill(arena_dir, keys)
    _flip(arena_dir, at[5])
    ctx = mp.get_context("spawn")

    def warm(arena):
        with SharedCatalog.for_arena(arena) as c:
            c.begin_verify()

    # This process holds the arena (so the others join) and verifies nothing itself.
    with _small_open(arena_dir, warm) as arena, SharedCatalog.for_arena(arena) as catalog:
        p = ctx.Process(target=_dies_verifying, args=(arena_dir,))
        p.start()
        p.join(120)
        assert p.exitcode == -signal.SIGKILL
        v = catalog.verification()
        assert v.items_left == 8 and v.dropped == 0  # its slice taken, never applied
        p = ctx.Process(target=_verifies, args=(arena_dir,))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        v = catalog.verification()
        assert (v.items_left, v.dropped) == (0, 1)
        assert catalog.state("k5") is None and catalog.state("k4") is ItemState.READY
        catalog.check()
    assert Arena.remove_shared("s", directory=arena_dir)


def test_a_verifier_stops_with_its_arena_and_a_joiner_starts_none_once_all_are_verified(
    arena_dir,
):
    _small_fill(arena_dir, [f"k{i}" for i in range(4)])
    kw = dict(block_bytes=SMALL_BLOCK, num_blocks=SMALL, layout_key="", directory=arena_dir,
              register_cuda="never", populate="eager", persistent=True)  # fmt: skip
    with open_shared_arena("s", **kw) as arena:
        verifier = arena._verifier
        assert verifier is not None
        verifier._thread.join(60)
        assert not verifier.alive and verifier.failure is None
        with open_shared_arena("s", **kw) as joined:
            assert not joined.warm_started and joined._verifier is None
    assert arena._verifier is None and verifier.catalog._mm is None  # stopped, closed
    assert Arena.remove_shared("s", directory=arena_dir)
