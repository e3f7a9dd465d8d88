"""Shared-lifetime arenas (Arena.open_shared): the name lives while any process
holds the file open, whoever created it; the last close removes it unless the
arena is persistent; a file nobody holds is reclaimed (not persistent) or
warm-started (persistent); a dead populator's work is resumed.

Real processes (spawn), SIGKILL where crash behaviour matters.
"""

import fcntl
import logging
import multiprocessing as mp
import os
import signal
import struct
import threading
import time

import pytest
import torch

from ecoffload.engine.arena import arena as arena_mod
from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena import janitor as janitor_mod
from ecoffload.engine.arena import populate as populate_mod
from ecoffload.engine.arena.arena import HEADER_BYTES, Arena
from ecoffload.engine.base.errors import ArenaAttachTimeout, ArenaError, ArenaLayoutMismatch

B = 4096
KEY = {"model": "tiny", "dtype": "bfloat16"}


def open_shared(arena_dir, name="s", **kw) -> Arena:
    kw.setdefault("block_bytes", B)
    kw.setdefault("num_blocks", 8)
    kw.setdefault("layout_key", KEY)
    kw.setdefault("register_cuda", "never")
    kw.setdefault("timeout_s", 30)
    return Arena.open_shared(name, directory=arena_dir, **kw)


def inode(arena_dir, name="s"):
    return os.stat(os.path.join(arena_dir, name)).st_ino


def _holder(arena_dir, name, block, fill, opened, release, persistent):
    """Open the arena, write ``fill`` over block ``block``, wait, close (or be killed)."""
    with open_shared(arena_dir, name, persistent=persistent) as a:
        a.host[block * B : (block + 1) * B] = fill
        opened.put((a.created, os.fstat(a.fileno()).st_ino))
        release.wait(120)


class Holder:
    """A process holding the arena open until ``release`` (or SIGKILL)."""

    def __init__(self, arena_dir, block, fill, name="s", persistent=False):
        ctx = mp.get_context("spawn")
        self.opened, self.release = ctx.Queue(), ctx.Event()
        self.p = ctx.Process(target=_holder, args=(arena_dir, name, block, fill, self.opened,
                                                   self.release, persistent))  # fmt: skip
        self.p.start()
        self.created, self.inode = self.opened.get(timeout=120)

    def close(self):
        self.release.set()
        self.p.join(60)
        assert self.p.exitcode == 0

    def kill(self):
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.join(60)


def block_of(a, block):
    return a.host[block * B : (block + 1) * B]


def test_a_later_instance_joins_the_file_the_creator_left_to_another(arena_dir):
    a = Holder(arena_dir, 0, 1)  # creates
    b = Holder(arena_dir, 1, 2)  # joins
    assert (a.created, b.created) == (True, False) and a.inode == b.inode
    a.close()  # the creator exits: B still holds the file, so its name stays
    assert inode(arena_dir) == a.inode
    with open_shared(arena_dir) as c:
        assert not c.created and not c.warm_started
        assert os.fstat(c.fileno()).st_ino == a.inode
        assert (block_of(c, 0) == 1).all() and (block_of(c, 1) == 2).all()
        b.close()
        assert inode(arena_dir) == a.inode  # C holds it now
    assert not os.path.exists(os.path.join(arena_dir, "s"))  # the last close removed it


def test_close_of_one_holder_among_several_in_one_process_keeps_the_name(arena_dir):
    a, b = open_shared(arena_dir), open_shared(arena_dir)
    a.close()
    assert os.path.exists(b.path)
    b.close()
    assert not os.path.exists(b.path)


def test_a_joiner_that_finds_the_name_removed_under_it_creates_anew(arena_dir):
    with open_shared(arena_dir, persistent=True) as a:  # then a file nobody holds
        block_of(a, 0).fill_(9)
    fd = os.open(os.path.join(arena_dir, "s"), os.O_RDWR)
    # Stand in for a last holder in its close: it holds the write lock...
    assert janitor_mod.ofd_lock(fd, fcntl.F_WRLCK, arena_format.HOLDERS_BYTE, wait=False)
    got = []
    t = threading.Thread(target=lambda: got.append(open_shared(arena_dir, persistent=True)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not got  # the joiner waits for the closing holder
    os.unlink(os.path.join(arena_dir, "s"))  # ...removes the name, then lets go
    os.close(fd)
    t.join(30)
    (c,) = got
    created, fresh = c.created, (block_of(c, 0) == 0).all()  # (tmpfs may reuse the inode)
    c.close()
    assert created and fresh
    assert Arena.remove_shared("s", directory=arena_dir)


def janitors(path):
    """Pids of the janitor processes watching ``path``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if path.encode() in args and janitor_mod.__file__.encode() in args:
            found.append(int(pid))
    return found


def test_holders_that_all_die_leave_nothing_the_janitor_removes_the_name(arena_dir):
    path = os.path.join(arena_dir, "s")
    a, b = Holder(arena_dir, 0, 7), Holder(arena_dir, 1, 8)
    (janitor,) = janitors(path)  # started by the creator, once...
    with open(f"/proc/{janitor}/stat") as f:  # ...and no child of it (vLLM kills those)
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != a.p.pid
    a.kill()
    assert inode(arena_dir) == a.inode  # b still holds it
    b.kill()  # the last holder dies without closing anything
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(path)
    while janitors(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not janitors(path)  # and it is gone too


def test_a_file_left_with_its_janitor_killed_too_is_reclaimed(arena_dir, caplog):
    h = Holder(arena_dir, 0, 7)
    for pid in janitors(os.path.join(arena_dir, "s")):
        os.kill(pid, signal.SIGKILL)
    h.kill()  # the last holder dies and nobody removes the name
    assert inode(arena_dir) == h.inode
    with caplog.at_level(logging.WARNING), open_shared(arena_dir) as c:
        assert c.created and (block_of(c, 0) == 0).all()  # fresh (tmpfs may reuse the inode)
    assert "every holder crashed" in caplog.text
    assert not os.path.exists(os.path.join(arena_dir, "s"))


def test_a_persistent_file_outlives_its_holders_and_is_warm_started(arena_dir):
    h = Holder(arena_dir, 0, 3, persistent=True)
    h.close()
    assert inode(arena_dir) == h.inode  # kept after the last close
    k = Holder(arena_dir, 1, 4, persistent=True)  # a restart, then a crash
    assert not k.created
    k.kill()
    seen = []

    def on_warm_start(arena):
        # While it validates, no other process can finish opening the file.
        fd = os.open(arena.path, os.O_RDWR)
        locked = janitor_mod.ofd_lock(fd, fcntl.F_RDLCK, arena_format.HOLDERS_BYTE,
                                     wait=False)  # fmt: skip
        os.close(fd)
        seen.append((arena.warm_started, locked, block_of(arena, 0).tolist()[:2]))

    with open_shared(arena_dir, persistent=True, on_warm_start=on_warm_start) as c:
        assert not c.created and c.warm_started and os.fstat(c.fileno()).st_ino == h.inode
        assert seen == [(True, False, [3, 3])]
        assert (block_of(c, 1) == 4).all()
        with open_shared(arena_dir, persistent=True, on_warm_start=on_warm_start) as d:
            assert not d.warm_started and len(seen) == 1  # C holds it: a plain join
    assert Arena.remove_shared("s", directory=arena_dir)
    assert not Arena.remove_shared("s", directory=arena_dir)


def test_a_failed_warm_start_keeps_the_persistent_file(arena_dir):
    open_shared(arena_dir, persistent=True).close()

    def refuse(arena):
        raise ValueError("the catalog does not validate")

    with pytest.raises(ValueError, match="does not validate"):
        open_shared(arena_dir, persistent=True, on_warm_start=refuse)
    with open_shared(arena_dir, persistent=True) as c:
        assert c.warm_started
        with pytest.raises(ArenaError, match="held open by live processes"):
            Arena.remove_shared("s", directory=arena_dir)
    assert Arena.remove_shared("s", directory=arena_dir)


def test_joiners_must_agree_on_persistence_block_size_and_layout(arena_dir, caplog):
    with open_shared(arena_dir, num_blocks=8) as a:
        with pytest.raises(ArenaError, match=r"persistent=False .* asked persistent=True"):
            open_shared(arena_dir, persistent=True)
        with pytest.raises(ArenaLayoutMismatch, match="block_bytes") as exc:
            open_shared(arena_dir, block_bytes=2 * B)
        assert (exc.value.expected, exc.value.found) == (2 * B, B)
        with pytest.raises(ArenaLayoutMismatch, match="layout_key") as exc:
            open_shared(arena_dir, layout_key={"model": "other"})
        assert "other" in exc.value.expected and "tiny" in exc.value.found
        with caplog.at_level(logging.INFO), open_shared(arena_dir, num_blocks=99) as b:
            assert b.num_blocks == 8  # the first instance decides
        assert "has 8 blocks, this process asked for 99" in caplog.text
        with open_shared(arena_dir, num_blocks=None) as j:
            assert j.num_blocks == 8 and not j.created
        assert os.path.exists(a.path)
    with pytest.raises(ArenaAttachTimeout, match="give num_blocks"):
        open_shared(arena_dir, num_blocks=None, timeout_s=0.2)


def test_open_shared_refuses_an_arena_of_the_other_lifetime_and_attach_never_reclaims(arena_dir):
    with Arena.create("plain", directory=arena_dir, block_bytes=B, num_blocks=4,
                      layout_key=KEY) as a:  # fmt: skip
        with pytest.raises(ArenaError, match="made by Arena.create"):
            open_shared(arena_dir, "plain")
        with pytest.raises(ArenaError, match="not a shared-lifetime arena"):
            Arena.remove_shared("plain", directory=arena_dir)
        assert os.path.exists(a.path)
    h = Holder(arena_dir, 0, 5)
    k = Holder(arena_dir, 1, 6)
    h.close()  # its creator is gone: a plain attach must not call it stale
    with Arena.attach("s", directory=arena_dir, layout_key=KEY, timeout_s=5) as b:
        assert (block_of(b, 1) == 6).all()
    k.close()
    assert not os.path.exists(os.path.join(arena_dir, "s"))


def test_a_creator_that_died_before_the_magic_is_reclaimed(arena_dir):
    path = os.path.join(arena_dir, "s")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, HEADER_BYTES + 8 * B)
    dead = mp.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    header = arena_mod.Header(b"\0" * 8, arena_mod.FORMAT_VERSION, HEADER_BYTES, B, 8,
                              HEADER_BYTES, dead.pid, 1, 7, 0, 1, 0, 0, 0)  # fmt: skip
    os.pwrite(fd, arena_format.HEADER.pack(*header), 0)
    os.pwrite(fd, struct.pack("<I", arena_mod.SHARED_LIFETIME), arena_format.LIFETIME_OFFSET)
    os.close(fd)
    with open_shared(arena_dir, timeout_s=10) as c:
        assert c.created and c.nonce != 7
    assert not os.path.exists(path)


def _slow_populating_creator(arena_dir, name, created, persistent):
    populate_mod.POPULATE_CHUNK = B  # one page per chunk, 20 ms each
    fault = populate_mod.prefault

    def slow(*args):
        time.sleep(0.02)
        fault(*args)

    populate_mod.prefault = slow
    a = open_shared(arena_dir, name, num_blocks=64, populate="background", persistent=persistent)
    created.put(a.created)
    time.sleep(120)


def test_a_dead_populator_is_resumed_by_the_next_opener(arena_dir):
    ctx = mp.get_context("spawn")
    created = ctx.Queue()
    p = ctx.Process(target=_slow_populating_creator, args=(arena_dir, "s", created, False))
    p.start()
    assert created.get(timeout=120)
    h = open_shared(arena_dir, num_blocks=64, populate="background")
    assert not h.created and h._populator is None  # its creator still populates
    while h.ready_blocks < 4:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    stopped = h.ready_blocks
    assert 4 <= stopped < 64
    t0 = time.monotonic()
    assert not h.wait_ready(timeout_s=30)  # nobody populates: it says so at once
    assert time.monotonic() - t0 < 5
    with open_shared(arena_dir, num_blocks=64, populate="background") as c:
        assert c._populator is not None  # C took over
        assert c.wait_ready(timeout_s=60) and h.wait_ready(timeout_s=60)
        assert h.ready_blocks == 64
        assert not h.resume_populate()  # done: nothing to take over
    h.close()
    assert not os.path.exists(os.path.join(arena_dir, "s"))


def test_a_persistent_arena_whose_populator_died_alone_resumes_at_warm_start(arena_dir):
    ctx = mp.get_context("spawn")
    created = ctx.Queue()
    p = ctx.Process(target=_slow_populating_creator, args=(arena_dir, "s", created, True))
    p.start()
    assert created.get(timeout=120)
    fd = os.open(os.path.join(arena_dir, "s"), os.O_RDONLY)
    while struct.unpack("<Q", os.pread(fd, 8, arena_format.READY_OFFSET))[0] < 4 * B:
        time.sleep(0.01)
    os.close(fd)
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    with open_shared(arena_dir, num_blocks=64, populate="eager", persistent=True) as c:
        assert c.warm_started and c.ready_blocks == 64  # eager: finished before returning
        assert torch.equal(block_of(c, 63), torch.zeros(B, dtype=torch.uint8))
    assert Arena.remove_shared("s", directory=arena_dir)


def test_close_releases_the_hold_even_while_a_view_keeps_the_mapping(arena_dir):
    a = open_shared(arena_dir)
    b = open_shared(arena_dir)
    view = block_of(b, 0)  # keeps b's mapping, and with it b's file description, alive
    b.close()
    a.close()  # the last holder now: removes the name
    assert not os.path.exists(a.path)
    view.fill_(1)  # the memory itself stays valid until the view goes
    del view
