"""The shared catalog's C fast paths (engine/catalog/shared/native.c) write what the Python
methods write, serve the hits, pins and unpins of the paths users take, and leave pins that
dead processes took through them to be reaped.

Each test opens its catalogs with ``ECOFFLOAD_NATIVE_CATALOG`` set explicitly (the switch
is read when a catalog opens), so they mean the same under either setting of the suite.
A missing build fails them: the C paths are part of what the install delivers.
"""

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest
from catalogs import B, open_shared

from ecoffload.engine.base.errors import CatalogError
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
from ecoffload.engine.catalog.shared.format import H_DIRTY, MUTEX_AT, MUTEX_SLOT

BUILT = "the C fast paths are not built: `pip install -e .` on a host with a C compiler"


def open_catalog(monkeypatch, path, native: bool, blocks: int = 32) -> SharedCatalog:
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1" if native else "0")
    if os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            return SharedCatalog(fd, 0, os.fstat(fd).st_size, path=str(path))
        finally:
            os.close(fd)
    return open_shared(path, blocks, max_pins=64)


def region(c: SharedCatalog) -> bytes:
    """The catalog's words; the mutex's bytes aside (its robust-list links are addresses)."""
    return bytes(c._mm[:MUTEX_AT]) + bytes(c._mm[MUTEX_AT + MUTEX_SLOT :])


def outcome(call):
    """What a call returned (an entry as its fields) or which error it raised."""
    try:
        got = call()
    except CatalogError as e:
        return type(e).__name__
    if got is None or got is True:
        return got
    return (got.key, got.state, got.pins, got.nbytes, got.generation, got.slot)


KEYS = [f"k{i}" for i in range(10)]
OPS, WEIGHTS = zip(("reserve", 6), ("commit", 6), ("hit", 10), ("hit_pin", 10), ("pin", 6),
                   ("unpin", 5), ("unpin_many", 6), ("evict", 2), ("abort", 2), ("dirty", 1),
                   strict=True)  # fmt: skip


def random_ops(rng: random.Random, n: int):
    """(who, method, args) steps over a few keys: enough to fill the catalog, evict, hit,
    pin, unpin (too often, too), by either of two objects of one file in this process
    (who 0, 1) or by another process (who 2)."""
    for _ in range(n):
        who, key = rng.randrange(3), rng.choice(KEYS)
        (op,) = rng.choices(OPS, WEIGHTS)
        if op == "reserve":
            yield who, "reserve", (key, rng.randint(1, 4) * B - rng.randrange(B))
        elif op == "hit":
            yield who, "lookup", (key,)
        elif op == "hit_pin":
            yield who, "lookup_pin", (key,)
        elif op == "unpin_many":
            yield who, "unpin_many", (rng.choices(KEYS[:4], k=rng.randint(1, 5)),)
        else:
            yield who, op, (key,)


def apply(c: SharedCatalog, method: str, args):
    if method == "lookup_pin":
        return outcome(lambda: c.lookup(*args, pin=True))
    if method == "dirty":  # an updater died inside an update: the next locker rebuilds
        c._w[H_DIRTY] = os.getpid()
        return None
    return outcome(lambda: getattr(c, method)(*args))


def other_process(catalogs: list[SharedCatalog]):
    """A forked child applying each operation sent to it to its inherited ``catalogs`` (one
    per side: they learn its pid at the fork); the parent's end of the pipe and its pid."""
    parent, child = mp.Pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            parent.close()
            while (msg := child.recv()) is not None:
                child.send(([apply(c, *msg) for c in catalogs],
                            [c._fast.hits + c._fast.pins + c._fast.unpins if c._fast else 0
                             for c in catalogs]))  # fmt: skip
        finally:
            os._exit(0)
    child.close()
    return parent, pid


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_c_paths_leave_the_region_byte_identical_to_the_python_methods(
    tmp_path, monkeypatch, seed
):
    """The same random operations on two catalogs, one with the C paths and one without,
    return the same and leave the same bytes after every operation: hits, ticks, LRU links,
    pin records of two processes and the free lists, recovery after a dirty mark included."""
    sides = []
    for native in (True, False):
        path = tmp_path / f"c-{native}"
        first = open_catalog(monkeypatch, path, native)
        sides.append((first, open_catalog(monkeypatch, path, native)))
    fast = [c._fast for c in sides[0]]
    assert all(f is not None for f in fast), BUILT
    assert all(c._fast is None for c in sides[1])
    conn, pid = other_process([objects[0] for objects in sides])
    try:
        rng = random.Random(seed)
        for i, (who, method, args) in enumerate(random_ops(rng, 600)):
            if who == 2:
                conn.send((method, args))
                got, served_there = conn.recv()
            else:
                got = [apply(objects[who], method, args) for objects in sides]
            assert got[0] == got[1], f"step {i}: {method}{args} by {who}"
            assert region(sides[0][0]) == region(sides[1][0]), f"step {i}: {method}{args}"
        for objects in sides:
            objects[0].check()
    finally:
        conn.send(None)
        os.waitpid(pid, 0)
    served = sum(f.hits + f.pins + f.unpins for f in fast)
    assert served > 100, f"the C paths served {served} calls: the test compared Python to Python"
    assert served_there[0] > 50 and served_there[1] == 0  # the other process's, too
    assert sum(f.slow for f in fast) > 100  # and the Python way answered the rest
    for objects in sides:
        for c in objects:
            c.close()


def test_the_connectors_hit_step_takes_the_c_paths_for_every_hit_and_unpin(tmp_path, monkeypatch):
    """Through vLLM's factory, as bench_host times it: 16 pinning lookups in C, and the
    worker's load report turned into 16 unpins in C; none sent the Python way."""
    pytest.importorskip("vllm")
    from ecoffload.testing.real_path_steps import SchedulerSteps

    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    steps = SchedulerSteps(str(tmp_path / "sched"))
    try:
        fast = steps.catalog._fast
        assert fast is not None, BUILT
        for n in (1, 2, 3):
            steps.hits()
            assert (fast.hits, fast.pins, fast.unpins, fast.slow) == (16 * n,) * 3 + (0,)
        monkeypatch.setattr(fault_points, "hook", lambda point: None)
        steps.hits()  # a crash test's hook: every call the Python way, with its fault points
        assert (fast.hits, fast.unpins, fast.slow) == (48, 48, 17)  # 16 lookups, 1 unpin_many
        assert steps.catalog.stats().hits == 64
    finally:
        steps.close()


def test_offload_caches_shared_load_takes_the_c_paths_for_every_hit_pin_and_unpin(
    arena_dir, monkeypatch
):
    torch = pytest.importorskip("torch")
    from ecoffload.engine.cache import OffloadCache

    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    made = OffloadCache.create("native", arena_bytes=64 * B, block_bytes=B, directory=arena_dir,
                               register_cuda="never", device="cpu", shared=True)  # fmt: skip
    with made as cache:
        fast = cache.catalog._fast
        assert fast is not None, BUILT
        items = {f"k{i}": torch.randn(300 + i, 5) for i in range(8)}
        cache.save(items)
        cache.flush()
        for n in (1, 2):
            got = cache.load(list(items))
            cache.flush()
            assert all(torch.equal(got[k], t) for k, t in items.items())
            assert (fast.hits, fast.pins, fast.unpins, fast.slow) == (8 * n,) * 3 + (0,)


def test_pins_a_killed_process_took_in_c_are_reaped(tmp_path, monkeypatch):
    """A forked child pins through the C paths with the catalog it inherited (they learn
    its pid at the fork) and is killed holding the pins: they are reaped as before."""
    c = open_catalog(monkeypatch, tmp_path / "c", True, blocks=8)
    assert c._fast is not None, BUILT
    for k in "ab":
        c.reserve(k, 4 * B)
        c.commit(k)
    c.lookup("a", pin=True)  # ours: stays
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            before = c._fast.pins
            c.lookup("a", pin=True)
            c.pin("b")
            c.pin("b")
            os.write(w, b"%d" % (c._fast.pins - before))
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 8) == b"3"  # all three pins of the child through C
    os.close(r)
    assert (c.entry("a").pins, c.entry("b").pins) == (2, 2)
    assert c.reserve("x", B) is None  # everything pinned
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(0.06)  # past the reaping rate limit
    assert c.reserve("x", 4 * B) is not None  # b evicted: the dead child's pins reaped
    assert c.entry("a").pins == 1 and c.state("b") is None  # our own pin stays
    c.unpin("a")
    c.check()
    c.close()


def test_a_module_built_for_another_layout_is_refused_with_one_warning(monkeypatch, caplog):
    mod = shared_catalog_native.module()
    assert mod is not None, BUILT
    monkeypatch.setitem(mod.LAYOUT, "S_PINS", mod.LAYOUT["S_PINS"] + 1)
    shared_catalog_native.forget()
    try:
        assert shared_catalog_native.module() is None
        assert shared_catalog_native.module() is None
    finally:
        monkeypatch.undo()
        shared_catalog_native.forget()
    refusals = [r for r in caplog.records if "built for another layout" in r.getMessage()]
    assert len(refusals) == 1 and "S_PINS" in refusals[0].getMessage()
    assert shared_catalog_native.module() is mod


@pytest.mark.parametrize("point", ["pin:record", "holding"])
def test_a_dead_holders_mutex_met_by_a_c_hit_is_taken_over_and_recovered(
    tmp_path, monkeypatch, point
):
    """The first locker after a holder's death is a pinning hit of a seen item: the C path
    marks the mutex consistent, the death is counted once, and the Python way rebuilds the
    catalog if the holder died inside an update."""
    from test_shared_catalog_lock import _setup, kill_while_holding

    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    path = tmp_path / "c"
    c = _setup(path)  # "a", "b" READY and seen by c, "b" pinned by it
    fast = c._fast
    assert fast is not None, BUILT
    recoveries, slow, pins, unpins = c.recoveries, fast.slow, fast.pins, fast.unpins
    kill_while_holding(path, point)
    entry = c.lookup("b", pin=True)
    assert entry.pins == 2 and c.lock_deaths == 1
    assert c.recoveries == recoveries + (point != "holding")
    assert (fast.slow, fast.pins) == (slow, pins)  # answered EOWNERDEAD, then Python
    c.check()
    c.lookup("b", pin=True)  # and C again
    assert fast.pins == pins + 1 and c.entry("b").pins == 3
    c.unpin_many(["b", "b", "b"])
    assert fast.unpins == unpins + 3 and c.entry("b").pins == 0
    c.check()
    c.close()


def test_a_busy_mutex_sends_a_c_hit_the_python_way_which_waits(tmp_path, monkeypatch):
    c = open_catalog(monkeypatch, tmp_path / "c", True, blocks=8)
    assert c._fast is not None, BUILT
    c.reserve("a", B)
    c.commit("a")
    held = threading.Event()

    def hold():
        c._lock()
        held.set()
        time.sleep(0.3)
        c._unlock()

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    start = time.monotonic()
    assert c.lookup("a", pin=True).pins == 1
    assert time.monotonic() - start > 0.1  # waited for the holder
    t.join(10)
    assert (c._fast.slow, c._fast.pins) == (1, 0)
    c.unpin("a")
    assert c._fast.unpins == 1
    c.check()
    c.close()
