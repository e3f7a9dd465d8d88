"""The shared catalog's lock: a robust, process-shared pthread mutex in its header.

A holder that dies while holding it (SIGKILL, inside an update or outside one)
hands it to the next locker with EOWNERDEAD: that locker makes it consistent,
counts the death and recovers if the holder was inside an update. Threads of
one process exclude each other with it. A persistent arena whose holder died
holding it is warm started; a failed recovery still leaves it usable; a
mutex left unrecoverable by someone else, or taken twice by one thread, raises
:class:`CatalogLockError` instead of hanging; a file from another boot gets a
fresh mutex.
"""

import collections
import ctypes
import errno
import logging
import multiprocessing as mp
import os
import platform
import re
import signal
import threading
import time
import zlib

import pytest
from catalogs import B, open_shared
from test_shared_catalog import reopen

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base import liveness
from ecoffload.engine.base.errors import ArenaLayoutMismatch, CatalogLockError
from ecoffload.engine.base.liveness import boot_id, process_start_time
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import catalog as shared_catalog
from ecoffload.engine.catalog.shared import fault_points, robust_mutex
from ecoffload.engine.catalog.shared import lock as shared_catalog_lock
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
from ecoffload.engine.catalog.shared.format import (
    H_BOOT,
    H_VERSION,
    MUTEX_AT,
    MUTEX_SLOT,
    VERSION,
)

# "name#2": the point's second pass (a nested pin's count, the last unpin's unlink)
UPDATE_POINTS = ["reserve:written", "commit:published", "pin:record", "pin:record#2",
                 "unpin:record", "unpin:record#2", "drop:unpublished"]  # fmt: skip


def _child_script(c):
    """What the child does (passing every point of UPDATE_POINTS), after its setup."""
    c.reserve("c", 2 * B)
    c.commit("c")
    c.pin("c")
    c.pin("c")
    c.unpin("c")
    c.unpin("c")
    c.evict("c")


def kill_while_holding(path, point):
    """Fork a child that opens the catalog, reserves "w" and pins "a" (both its own),
    then is SIGKILLed by this process while it holds the lock: at ``point`` inside
    an update, or ("holding") right after taking the lock outside any update."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            c = reopen(path)
            c.reserve("w", B)
            c.pin("a")

            passes = collections.Counter()

            def hook(name):
                passes[name] += 1
                if point in (name, f"{name}#{passes[name]}"):
                    os.write(w, b"x")
                    time.sleep(60)

            fault_points.hook = hook
            if point == "holding":
                c._lock()
                os.write(w, b"x")
                time.sleep(60)
            _child_script(c)
        finally:
            os._exit(3)
    os.close(w)
    assert os.read(r, 1) == b"x", "the child never reached the point"
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _setup(path):
    c = open_shared(path, 8)
    for k in "ab":
        c.reserve(k, 2 * B)
        c.commit(k)
    c.pin("b")
    return c


LOG = "ecoffload.engine.catalog.shared.catalog"


def taken_over(path, inside: bool) -> str:
    """The warning of a locker that took the lock over from a dead holder."""
    pending = "inside an update: rebuilding" if inside else "no update pending"
    return (
        f"catalog {path}: its lock's holder (a process or thread) died holding it "
        f"({pending}); taken over"
    )


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelname == "WARNING"]


@pytest.mark.parametrize("point", [*UPDATE_POINTS, "holding"])
def test_a_holder_killed_holding_the_lock_is_taken_over_by_the_next_locker(tmp_path, point, caplog):
    caplog.set_level("WARNING", logger=LOG)
    path = tmp_path / "c"
    c = _setup(path)
    recoveries = c.recoveries
    kill_while_holding(path, point)
    assert c.state("a") is ItemState.READY  # the next locker: EOWNERDEAD, taken over
    assert c.lock_deaths == 1
    inside = point != "holding"
    assert c.recoveries == recoveries + inside  # rebuilt only if it died inside an update
    assert warnings_of(caplog) == [taken_over(path, inside)]
    other = reopen(path)  # a new process would: reaps the dead child's reservation and pin
    other.check()
    assert (other.state("w"), other.entry("a").pins, other.entry("b").pins) == (None, 0, 1)
    assert other.state("c") in (None, ItemState.READY)
    if other.state("c") is not None:  # published before the kill: kept, unpinned
        assert other.entry("c").pins == 0
        other.evict("c")
    assert other.lock_deaths == 1  # consistent again: nobody else sees the death
    e = other.reserve("d", 4 * B)  # every block not pinned is usable
    other.commit("d", generation=e.generation)
    c.unpin("b")
    other.check()
    c.close()
    other.close()


def test_a_killed_holder_blocks_a_waiter_until_its_death_then_hands_over(tmp_path):
    path = tmp_path / "c"
    c = _setup(path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            child = reopen(path)
            child._lock()
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(3)
    assert os.read(r, 1) == b"x"
    got = []
    t = threading.Thread(target=lambda: got.append(c.lookup("a")))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got, "the lookup did not wait for the holder"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    t.join(10)
    assert not t.is_alive() and got[0].key == "a" and c.lock_deaths == 1
    c.check()
    c.close()


def test_a_thread_waits_for_another_threads_update(tmp_path, monkeypatch):
    c = open_shared(tmp_path / "c", 8)
    c.reserve("x", B)
    inside, go = threading.Event(), threading.Event()

    def hook(name):
        if name == "commit:written" and threading.current_thread() is committer:
            inside.set()
            assert go.wait(10)

    monkeypatch.setattr(fault_points, "hook", hook)
    committer = threading.Thread(target=c.commit, args=("x",))
    committer.start()
    assert inside.wait(10)  # the committer holds the lock, halfway through its update
    seen = []
    reader = threading.Thread(target=lambda: seen.append(c.lookup("x")))  # the same object
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not seen, "a thread entered during another's update"
    go.set()
    committer.join(10)
    reader.join(10)
    assert seen[0] is not None and seen[0].state is ItemState.READY  # after the commit
    assert c.lock_deaths == 0 and c.recoveries == 1  # the format's only
    c.check()
    c.close()


class _CountingTimedlock:
    """robust_mutex.PT_WAIT, counting the timed waits a blocked locker makes."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def pthread_mutex_timedlock(self, mx, until):
        self.calls += 1
        return self.lib.pthread_mutex_timedlock(mx, until)


def _wait_for_a_holder(c, hold_s, caplog):
    """Another thread holds ``c``'s lock for ``hold_s`` seconds; this one waits for it.
    The number of warnings logged while the lock was still held."""
    held, logged = threading.Event(), []

    def holder():
        c._lock()
        held.set()
        time.sleep(hold_s)
        logged.append(len(caplog.records))
        c._unlock()

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    c._lock()  # waits in _lock_slow
    c._unlock()
    t.join(10)
    return logged[0]


def test_a_long_wait_for_the_lock_sleeps_in_slices_and_warns_once_naming_the_file(
    tmp_path, monkeypatch, caplog
):
    c = open_shared(tmp_path / "c", 8)
    waits = _CountingTimedlock(robust_mutex.PT_WAIT)
    monkeypatch.setattr(robust_mutex, "PT_WAIT", waits)
    monkeypatch.setattr(shared_catalog_lock, "_WAIT_WARN_S", 1.0)
    caplog.set_level("WARNING", logger="ecoffload.engine.catalog.shared.catalog")
    _wait_for_a_holder(c, 0.3, caplog)  # shorter than the warning's delay: no warning
    assert not caplog.records and 1 <= waits.calls <= 4
    waits.calls = 0
    # 0.2 s slices (no busy wait), one warning after 1 s, while the lock is still held
    assert _wait_for_a_holder(c, 2.0, caplog) == 1
    assert 5 <= waits.calls <= 20, f"{waits.calls} timed waits in 2 s of 0.2 s slices"
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    text = caplog.records[0].getMessage()
    pattern = (
        rf"catalog {re.escape(str(c.path))}: waiting (\d+) s for its lock; a process "
        r"holds it without releasing it \(stopped, or stuck inside an update\?\)"
    )
    m = re.fullmatch(pattern, text)
    assert m and 1 <= int(m[1]) <= 2, text
    assert c.lock_deaths == 0
    c.check()
    c.close()


def test_a_failed_recovery_still_leaves_the_lock_usable(tmp_path, monkeypatch):
    path = tmp_path / "c"
    c = _setup(path)
    c.close()
    kill_while_holding(path, "commit:published")

    def hook(name):
        if name == "recover:slots":
            raise RuntimeError("recovery failed")

    monkeypatch.setattr(fault_points, "hook", hook)
    with pytest.raises(RuntimeError, match="recovery failed"):
        reopen(path)  # took the lock over (EOWNERDEAD), then the rebuild failed
    monkeypatch.setattr(fault_points, "hook", None)
    other = reopen(path)  # not ENOTRECOVERABLE: marked consistent before the unlock
    assert other.lock_deaths == 1  # the death was seen once; the catalog stayed dirty
    other.check()
    assert other.state("c") is ItemState.READY and other.state("w") is None
    assert (other.entry("a").pins, other.entry("b").pins) == (0, 1)  # the child's pin dropped
    other.close()


def test_an_unrecoverable_lock_names_the_file_and_the_remedy(tmp_path):
    path = tmp_path / "c"
    c = _setup(path)
    kill_while_holding(path, "holding")
    pt = robust_mutex.PT  # what a foreign process could do: unlock without consistent
    assert pt.pthread_mutex_trylock(c._mx) == errno.EOWNERDEAD
    assert pt.pthread_mutex_unlock(c._mx) == 0
    with pytest.raises(CatalogLockError) as err:
        c.lookup("a")
    assert str(err.value) == (
        f"catalog {path}: its lock is unrecoverable (a process released it after its holder "
        "died without marking it consistent, which ecoffload never does): stop every process "
        "using this arena, then remove the file (a persistent arena: Arena.remove_shared) and "
        "start again"
    )
    with pytest.raises(CatalogLockError, match="unrecoverable"):
        reopen(path)  # the same thread again: told the same
    got = []

    def other_thread():
        try:
            c.lookup("a")
        except CatalogLockError as exc:
            got.append(str(exc))

    t = threading.Thread(target=other_thread, daemon=True)
    t.start()
    t.join(10)
    assert got and "unrecoverable" in got[0], "another thread waited instead of being told"
    c.close()


def test_a_catalog_call_inside_another_raises_instead_of_hanging(tmp_path, monkeypatch):
    c = open_shared(tmp_path / "c", 8)

    def hook(name):
        if name == "reserve:written":
            c.lookup("x")  # the same thread, the lock held

    monkeypatch.setattr(fault_points, "hook", hook)
    with pytest.raises(CatalogLockError) as err:
        c.reserve("x", B)
    assert str(err.value) == (
        f"catalog {tmp_path / 'c'}: this thread already holds its lock (a catalog call from "
        "inside another, e.g. from a fault hook or signal handler, or through a second catalog "
        "object of the same file)"
    )
    monkeypatch.setattr(fault_points, "hook", None)
    assert c.state("x") is None and c.recoveries == 2  # left dirty, rebuilt by the next
    c.check()
    c.close()


def _nobody_tid() -> int:
    tid = 4_000_000
    while os.path.exists(f"/proc/{tid}"):
        tid -= 1
    return tid


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="writes glibc's futex word")
def test_a_file_from_another_boot_gets_a_fresh_lock(tmp_path):
    path = tmp_path / "c"
    c = _setup(path)
    c.unpin("b")
    # As after a crash of the whole machine: the futex word names a thread of the old
    # boot, without OWNER_DIED (the kernel never got to mark it).
    c._w[MUTEX_AT // 8] = _nobody_tid()
    c._w[H_BOOT] ^= 1
    c.close()
    got = []
    t = threading.Thread(target=lambda: got.append(reopen(path)), daemon=True)
    t.start()
    t.join(20)
    assert got, "opening waited for a lock held by a thread of another boot"
    other = got[0]
    assert other._w[H_BOOT : H_BOOT + 2].tolist() == list(boot_id())
    assert other.state("a") is ItemState.READY and other.lock_deaths == 0
    other.check()
    other.close()


def _arena_holder_dies_in_commit(arena_dir, meta):
    def hook(name):
        if name == "commit:written":
            os.kill(os.getpid(), signal.SIGKILL)

    with Arena.open_shared(
        "p",
        block_bytes=B,
        num_blocks=16,
        directory=arena_dir,
        register_cuda="never",
        meta_bytes=meta,
        persistent=True,
    ) as arena:
        cat = SharedCatalog.for_arena(arena, max_items=8)  # fmt: skip
        e = cat.reserve("kept", 3 * B)
        arena.host[e.extents[0].start * B : (e.extents[0].start + 3) * B] = 7
        cat.commit("kept", zlib.crc32(bytes([7]) * 3 * B))
        cat.reserve("lost", 2 * B)
        fault_points.hook = hook
        cat.commit("lost")  # killed inside the update, holding the lock


def test_a_persistent_arena_whose_holder_died_holding_the_lock_is_warm_started(arena_dir):
    meta = shared_catalog.meta_bytes(16, B, max_items=8)
    p = mp.get_context("spawn").Process(target=_arena_holder_dies_in_commit,
                                        args=(arena_dir, meta))  # fmt: skip
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    seen = []

    def verify(arena):  # the warm start: nobody else can open the file meanwhile
        with SharedCatalog.for_arena(arena, max_items=8) as cat:
            dropped = cat.verify(arena.host.numpy())
            seen.append((cat.lock_deaths, cat.recoveries, dropped))

    with Arena.open_shared("p", block_bytes=B, num_blocks=16, directory=arena_dir,
                           register_cuda="never", meta_bytes=meta, persistent=True,
                           on_warm_start=verify) as arena:  # fmt: skip
        assert arena.warm_started
        deaths, recoveries, dropped = seen[0]
        assert deaths == 1 and recoveries == 3 and dropped == 0  # format, EOWNERDEAD, verify
        with SharedCatalog.for_arena(arena) as cat:
            assert cat.state("kept") is ItemState.READY and cat.state("lost") is None
            assert cat.stats().free_blocks == 13
            cat.check()
    assert Arena.remove_shared("p", directory=arena_dir)


def test_the_mutex_slot_holds_a_pthread_mutex():
    # ctypes cannot tell sizeof(pthread_mutex_t); the table must cover this machine.
    size = robust_mutex.MUTEX_BYTES.get(platform.machine())
    assert size is not None and size <= MUTEX_SLOT
    assert MUTEX_AT % 64 == 0 and MUTEX_AT + MUTEX_SLOT <= H_BOOT * 8
    assert ctypes.sizeof(ctypes.c_void_p) == 8


def test_a_file_of_the_previous_format_is_refused_before_its_lock_is_touched(tmp_path):
    path = tmp_path / "c"
    c = open_shared(path, 8)
    c._w[H_VERSION] = 2  # as a catalog of the fcntl-locked format leaves it
    c._w[MUTEX_AT // 8 : MUTEX_AT // 8 + 8] = memoryview(bytes(64)).cast("q")  # no mutex
    c.close()
    with pytest.raises(ArenaLayoutMismatch, match=f"'catalog version' is 2, expected {VERSION}"):
        reopen(path)


def test_a_child_forked_while_another_thread_holds_the_lock_waits_for_it(tmp_path, monkeypatch):
    c = open_shared(tmp_path / "c", 8)
    c.reserve("x", B)
    inside, go = threading.Event(), threading.Event()

    def hook(name):
        if name == "commit:written":
            inside.set()
            assert go.wait(10)

    monkeypatch.setattr(fault_points, "hook", hook)
    committer = threading.Thread(target=c.commit, args=("x",))
    committer.start()
    assert inside.wait(10)  # the parent's other thread holds the lock, mid-update
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: the owner is the parent's thread, not a copy
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            got = c.lookup("x")  # waits for the parent's thread, then sees its commit
            os.write(w, b"1" if got is not None and c._pid == os.getpid() else b"0")
        finally:
            os._exit(0)
    time.sleep(0.5)
    assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the child did not wait for the lock"
    go.set()
    committer.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and os.WEXITSTATUS(status) == 0
    assert c.lock_deaths == 0
    c.check()
    c.close()


@pytest.mark.parametrize("locker", ["python", "c"])
def test_every_holder_s_death_is_counted_and_logged_by_the_locker_that_meets_it(
    tmp_path, monkeypatch, caplog, locker
):
    """Two holders die one after the other (outside an update, then inside one): each death
    is counted and logged once, whether the Python way meets it or a C hit (which hands
    the mutex, marked consistent, to the Python way)."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1" if locker == "c" else "0")
    caplog.set_level("WARNING", logger=LOG)
    path = tmp_path / "c"
    c = _setup(path)  # "a" and "b" READY and seen by c
    fast = c._fast
    assert (fast is not None) == (locker == "c"), "the C fast paths are not built"
    recoveries, slow = c.recoveries, fast and fast.slow
    for deaths, point in enumerate(["holding", "commit:published"], start=1):
        kill_while_holding(path, point)
        assert c.lookup("a").key == "a"
        assert c.lock_deaths == deaths
    assert c.recoveries == recoveries + 1  # only the second holder died inside an update
    assert warnings_of(caplog) == [taken_over(path, False), taken_over(path, True)]
    assert (fast and fast.slow) == slow  # the C path met both deaths itself
    c.unpin("b")
    c.check()
    c.close()


@pytest.mark.parametrize("op", ["pin", "unpin"])
def test_a_c_pin_or_unpin_that_meets_a_dead_holder_hands_the_lock_to_the_python_way(
    tmp_path, monkeypatch, caplog, op
):
    """The C pin and unpin of a seen READY item meet a holder's death as the C hit does:
    the mutex, marked consistent, goes to the Python way, which counts it and pins."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    caplog.set_level("WARNING", logger=LOG)
    path = tmp_path / "c"
    c = _setup(path)  # "a" and "b" READY and seen by c; "b" pinned
    assert c._fast is not None, "the C fast paths are not built"
    if op == "unpin":
        c.pin("a")
    kill_while_holding(path, "holding")
    if op == "pin":  # the dead child's pin of "a" stays until a reap (no update pending)
        assert c.pin("a").pins == 2
    else:
        c.unpin("a")
    assert c.lock_deaths == 1
    assert warnings_of(caplog) == [taken_over(path, False)]
    assert c.entry("a").pins == (2 if op == "pin" else 1)
    assert c.reap() == 2  # the child's reservation "w" and its pin of "a"
    c.unpin_many(["b"] if op == "unpin" else ["a", "b"])
    c.check()
    c.close()


class Interrupt(Exception):
    """What a signal handler or a log handler raises in the middle of taking the lock."""


class _RaisingHandler(logging.Handler):
    def emit(self, record):
        raise Interrupt(record.getMessage())


class _InterruptedConsistent:
    """robust_mutex.PT whose first ``pthread_mutex_consistent`` is interrupted before the
    call, as by a signal handler that raises."""

    def __init__(self, lib):
        self.lib, self.interrupted = lib, False

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def pthread_mutex_consistent(self, mx):
        if not self.interrupted:
            self.interrupted = True
            raise Interrupt("before pthread_mutex_consistent")
        return self.lib.pthread_mutex_consistent(mx)


@pytest.mark.parametrize("when", ["before consistent", "in the warning"])
def test_an_exception_while_taking_over_releases_the_lock_consistent(tmp_path, monkeypatch, when):
    """An exception that arrives while a locker takes the lock over from a dead holder
    (before marking it consistent, or from the warning's log handler) leaves the mutex
    consistent and released: this thread and others take it again at once."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "0")
    path = tmp_path / "c"
    c = _setup(path)
    kill_while_holding(path, "holding")
    logger = logging.getLogger(LOG)
    handler = _RaisingHandler()
    if when == "in the warning":
        logger.addHandler(handler)
    else:
        monkeypatch.setattr(robust_mutex, "PT", _InterruptedConsistent(robust_mutex.PT))
    try:
        with pytest.raises(Interrupt):
            c.state("a")
    finally:
        logger.removeHandler(handler)
    got = []
    t = threading.Thread(target=lambda: got.append(c.state("a")), daemon=True)
    t.start()
    t.join(5)  # a free mutex is taken at once
    assert got == [ItemState.READY], "another thread found the lock still held"
    assert c.state("a") is ItemState.READY  # not EDEADLK: this thread let it go too
    # counted before the warning; an interruption before consistent leaves it uncounted
    assert c.lock_deaths == (when == "in the warning")
    c.unpin("b")
    c.check()
    c.close()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="writes glibc's mutex kind")
@pytest.mark.parametrize("locker", ["python", "c"])
def test_an_unexpected_error_of_the_mutex_is_named_with_its_code(tmp_path, monkeypatch, locker):
    """A mutex whose kind word was overwritten (no valid pthread type: glibc answers EINVAL)
    is refused with the file, the call and the error's name and text, by either path."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1" if locker == "c" else "0")
    path = tmp_path / "c"
    c = _setup(path)
    assert (c._fast is not None) == (locker == "c"), "the C fast paths are not built"
    kind = ctypes.c_int.from_address(c._mx.value + 16)  # int __lock, __count, __owner, __nusers
    was, kind.value = kind.value, 0x87  # process-shared, type 7: no such type
    try:
        with pytest.raises(CatalogLockError) as err:
            c.lookup("a")
    finally:
        kind.value = was
    assert str(err.value) == (
        f"catalog {path}: locking its mutex failed with EINVAL: Invalid argument"
    )
    assert c.lookup("a").key == "a" and c.lock_deaths == 0
    c.unpin("b")
    c.check()
    c.close()


def test_an_error_code_errno_has_no_name_for_is_named_by_its_number(tmp_path):
    path = tmp_path / "c"
    c = _setup(path)
    with pytest.raises(CatalogLockError) as err:
        c._lock_slow(4242)  # what trylock answered: neither busy nor an owner's death
    assert str(err.value) == (
        f"catalog {path}: locking its mutex failed with 4242: {os.strerror(4242)}"
    )
    c.unpin("b")
    c.check()
    c.close()


def test_releasing_a_lock_this_thread_does_not_hold_is_refused(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    with pytest.raises(CatalogLockError) as err:
        c._unlock()
    assert str(err.value) == (
        f"catalog {tmp_path / 'c'}: this thread released a lock it does not hold (a bug)"
    )
    c._lock()
    c._unlock()  # held: released without a word
    c.check()
    c.close()


def test_items_name_this_process_by_pid_and_start_time(tmp_path, monkeypatch):
    """Reservations carry (pid, start time); 0 where /proc does not tell the start time
    (``alive`` then checks the pid alone)."""
    c = open_shared(tmp_path / "c", 8)
    start = process_start_time(os.getpid())
    assert start
    c.reserve("x", B)
    assert c.entry("x").producer == (os.getpid(), start)
    monkeypatch.setattr(liveness, "process_start_time", lambda pid: None)
    d = reopen(tmp_path / "c")
    d.reserve("y", B)
    assert d.entry("y").producer == (os.getpid(), 0)
    d.close()
    c.close()


def test_an_item_s_producer_is_a_process_identity_record_whoever_reads_it(tmp_path):
    """``SharedEntry.producer`` is a :class:`ProcessId` (pid, start): the reservation's own
    entry, and the one another catalog object decodes from the slot."""
    c = open_shared(tmp_path / "c", 8)
    me = liveness.ProcessId.of_this_process()
    reserved = c.reserve("x", B)
    assert type(reserved.producer) is liveness.ProcessId and reserved.producer == me
    c.commit("x")
    other = reopen(tmp_path / "c")
    read = other.entry("x")
    assert type(read.producer) is liveness.ProcessId
    assert (read.producer.pid, read.producer.start) == (os.getpid(), me.start)
    other.close()
    c.close()


def test_the_fork_hook_gives_every_live_catalog_object_the_child_s_identity(tmp_path, monkeypatch):
    """What a forked child runs (``os.register_at_fork``): every catalog object still alive,
    and its C fast path, learn the process's pid and start time again."""
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    one = open_shared(tmp_path / "c", 8)
    two = reopen(tmp_path / "c")
    assert one._fast is not None and two._fast is not None, "the C fast paths are not built"
    one.reserve("x", B)
    one.commit("x")  # READY and seen by one: its pins go the C way
    for c in (one, two):  # as the parent's copies carry them into the child
        c._pid, c._start = 1, 1
        c._fast.identify(1, 1)
    shared_catalog_lock._after_fork_in_child()
    me = (os.getpid(), process_start_time(os.getpid()))
    assert (one._pid, one._start) == (two._pid, two._start) == me
    two.reserve("y", B)
    assert two.entry("y").producer == me
    pins = one._fast.pins
    assert one.lookup("x", pin=True).pins == 1 and one._fast.pins == pins + 1  # in C
    monkeypatch.setattr(fault_points, "hook", lambda name: None)  # the Python way only
    one.unpin("x")  # finds the C path's pin record under this process's identity
    monkeypatch.setattr(fault_points, "hook", None)
    one.check()
    two.close()
    one.close()
