"""Shared lifetime (engine/arena/lifetime.py) within one process: each refusal and
each log line whole, the catalog owner's claim against a live owner and a reused pid, a
reclaimed leftover and a resumed populate made by rewriting a kept file's header.

The process-crossing cases (holders killed, janitors, populators that die) are in
test_arena_shared.py; these are the fast ones, where what is checked is the text a
reader acts on and the state left behind.
"""

import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import threading

import pytest
import torch

from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena import populate
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.arena.format import ANY_LAYOUT, OWNER, OWNER_OFFSET
from ecoffload.engine.arena.janitor import ofd_lock as janitor_lock
from ecoffload.engine.base.errors import ArenaAttachTimeout, ArenaError
from ecoffload.engine.base.liveness import process_start_time

B = 4096
KEY = {"model": "tiny"}
LOG = "ecoffload.engine.arena.arena"


def open_shared(arena_dir, name="s", **kw) -> Arena:
    kw.setdefault("block_bytes", B)
    kw.setdefault("num_blocks", 8)
    kw.setdefault("layout_key", KEY)
    kw.setdefault("register_cuda", "never")
    kw.setdefault("timeout_s", 10)
    return Arena.open_shared(name, directory=arena_dir, **kw)


def leftover(arena_dir, content: bytes, mode: int = 0o600) -> str:
    """A file under the arena's name as another program (or a creator cut short) left it."""
    path = os.path.join(arena_dir, "s")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.write(fd, content)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG]


def test_open_shared_refuses_what_it_cannot_open_saying_what_to_do(arena_dir):
    path = os.path.join(arena_dir, "s")
    with pytest.raises(ArenaError) as err:
        open_shared(arena_dir, layout_key=ANY_LAYOUT)
    assert str(err.value) == "open_shared needs the arena's real layout key, not ANY_LAYOUT"
    for bad in (0, -1):
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir, num_blocks=bad)
        assert str(err.value) == f"num_blocks must be positive or None (join only), got {bad}"
    with pytest.raises(ArenaAttachTimeout) as err:
        open_shared(arena_dir, num_blocks=None, timeout_s=0)
    assert str(err.value) == (
        f"no valid shared arena at {path} after 0.0 s (the file does not exist): give "
        "num_blocks so this process may create it, start the creating process first, or "
        "raise the timeout"
    )
    os.symlink(os.path.join(arena_dir, "elsewhere"), path)
    try:
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir)
        assert str(err.value) == f"{path} is a symbolic link; refusing to follow it"
    finally:
        os.unlink(path)


def test_an_arena_of_the_other_lifetime_or_persistence_is_refused_whole(arena_dir):
    with Arena.create("plain", directory=arena_dir, block_bytes=B, num_blocks=4,
                      layout_key=KEY) as a:  # fmt: skip
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir, "plain")
        assert str(err.value) == (
            f"{a.path} was made by Arena.create (its name lives as long as its creator or "
            "`processes` count), not by open_shared: use another arena name, or stop the "
            "processes using it and remove the file"
        )
        with pytest.raises(ArenaError) as err:
            Arena.remove_shared("plain", directory=arena_dir)
        assert str(err.value) == (
            f"{a.path} is not a shared-lifetime arena (made by Arena.create): its creator "
            "removes it; remove the file by hand if no process uses it"
        )
    with open_shared(arena_dir) as s:
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir, persistent=True)
        assert str(err.value) == (
            f"arena {s.path} is persistent=False (set by the instance that created it), this "
            "process asked persistent=True: give every instance the same setting, or use "
            "another arena name"
        )
        with pytest.raises(ArenaError) as err:
            Arena.remove_shared("s", directory=arena_dir)
        assert str(err.value) == f"arena {s.path} is held open by live processes: close them first"
    assert not Arena.remove_shared("s", directory=arena_dir)  # the last close removed it
    path = leftover(arena_dir, bytes(arena_format.HEADER_BYTES), mode=0o644)
    with pytest.raises(ArenaError) as err:
        Arena.remove_shared("s", directory=arena_dir)  # not ours alone: left alone
    assert str(err.value).startswith(f"{path} has mode 644, expected 600")
    os.unlink(path)


def test_opening_joining_and_warm_starting_are_logged_by_name(arena_dir, caplog):
    path = os.path.join(arena_dir, "s")
    with caplog.at_level(logging.DEBUG, logger=LOG):
        a = open_shared(arena_dir, persistent=True)
        with open_shared(arena_dir, persistent=True, num_blocks=99) as b:
            assert b.num_blocks == 8 and not b.warm_started
        a.close()
        assert messages(caplog)[-3:] == [
            f"arena {path} has 8 blocks, this process asked for 99: the first instance "
            "decides; using 8",
            f"joined shared arena {path}",
            f"arena {path}: closed by its last holder, kept (persistent)",
        ]
        caplog.clear()
        seen = []
        with open_shared(arena_dir, persistent=True, on_warm_start=seen.append) as c:
            assert c.warm_started and seen == [c]
        assert messages(caplog) == [
            f"arena {path}: warm start of a persistent arena nobody held",
            f"joined shared arena {path}",
            f"arena {path}: closed by its last holder, kept (persistent)",
        ]
    assert Arena.remove_shared("s", directory=arena_dir)


def test_a_leftover_nobody_holds_is_reclaimed_with_a_warning(arena_dir, caplog):
    open_shared(arena_dir, persistent=True).close()
    path = os.path.join(arena_dir, "s")
    fd = os.open(path, os.O_RDWR)  # as if every holder of a non-persistent arena crashed
    os.pwrite(fd, struct.pack("<I", arena_format.SHARED_LIFETIME), arena_format.LIFETIME_OFFSET)
    old = os.fstat(fd).st_ino
    with caplog.at_level(logging.DEBUG, logger=LOG), open_shared(arena_dir) as c:
        assert c.created and os.fstat(c.fileno()).st_ino != old
        assert (
            f"arena {path}: no process holds it (every holder crashed) and it is not "
            "persistent; reclaiming it"
        ) in messages(caplog)
    os.close(fd)
    assert not os.path.exists(path)
    assert messages(caplog)[-1] == f"arena {path}: closed by its last holder, name removed"


def test_a_warm_start_resumes_the_populate_a_dead_process_left_from_its_prefix(arena_dir, caplog):
    open_shared(arena_dir, num_blocks=256, persistent=True).close()  # 1 MiB, all ready
    path = os.path.join(arena_dir, "s")
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, struct.pack("<Q", 128 * B), arena_format.READY_OFFSET)  # died half way
    os.close(fd)
    with (
        caplog.at_level(logging.INFO, logger=LOG),
        open_shared(arena_dir, persistent=True, populate="eager") as c,
    ):
        assert c.warm_started and c.ready_blocks == 256
        assert not c.resume_populate()  # done: nothing left to take over
    assert (
        f"arena {path}: its populate stopped at 0.5 of 1.0 MiB (that process is gone); "
        "this process resumes it"
    ) in messages(caplog)
    assert Arena.remove_shared("s", directory=arena_dir)


@pytest.fixture
def other_process():
    """A live child process, (pid, start time); it ends itself after 60 s at the latest."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant strands must not outlive the run
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    yield pid, process_start_time(pid)
    os.close(w)
    os.waitpid(pid, 0)


def test_the_catalog_owner_is_the_first_live_claimant(arena_dir, other_process):
    with Arena.create("a", directory=arena_dir, block_bytes=B, num_blocks=4,
                      layout_key=KEY) as a:  # fmt: skip
        me = (os.getpid(), process_start_time(os.getpid()))
        other = other_process
        OWNER.pack_into(a._mm, OWNER_OFFSET, *other)  # a live process owns it
        with pytest.raises(ArenaError) as err:
            a.claim_ownership()
        assert str(err.value) == (
            f"arena {a.path} already has a catalog owner (process {other[0]}): every "
            "serving instance, and every data-parallel rank, needs its own arena_name"
        )
        assert OWNER.unpack_from(a._mm, OWNER_OFFSET) == other  # left as it was
        OWNER.pack_into(a._mm, OWNER_OFFSET, other[0], 0)  # its start time was not known
        with pytest.raises(ArenaError, match="already has a catalog owner"):
            a.claim_ownership()
        OWNER.pack_into(a._mm, OWNER_OFFSET, other[0], other[1] + 1)  # its pid, reused
        a.claim_ownership()
        assert OWNER.unpack_from(a._mm, OWNER_OFFSET) == me
        a.claim_ownership()  # the owner may claim again
        assert OWNER.unpack_from(a._mm, OWNER_OFFSET) == me


@pytest.fixture
def held_populate(monkeypatch):
    """Chunks of one block; every chunk after an arena's first waits for the event."""
    monkeypatch.setattr(populate, "POPULATE_CHUNK", B)
    release, real = threading.Event(), populate.prefault

    def fault(mm, base, offset, size, path):
        if offset != arena_format.HEADER_BYTES:  # not the first chunk (no metadata region)
            assert release.wait(30), "the test never released the populate"
        real(mm, base, offset, size, path)

    monkeypatch.setattr(populate, "prefault", fault)
    yield release
    release.set()


def test_only_a_shared_arena_whose_populator_is_gone_is_taken_over(arena_dir, held_populate):
    a = open_shared(arena_dir, populate="background")  # this process populates it
    try:
        populator = a._populator
        assert populator is not None and a.ready_blocks == 1
        assert a._populator_alive()  # its own populate runs
        assert not a.resume_populate() and a._populator is populator  # not again
        with open_shared(arena_dir, populate="background") as j:  # its populator lives
            assert j._populator is None and not j.resume_populate() and j._populator is None
            assert j._populator_alive()  # a holds the populator's lock...
            held_populate.set()
            a.close()
            assert not j._populator_alive()  # ...until it closes: nobody populates now
    finally:
        held_populate.set()
        a.close()
    assert not a.resume_populate()  # closed
    held_populate.clear()
    plain = Arena.create("p", directory=arena_dir, block_bytes=B, num_blocks=8,
                         layout_key=KEY, register_cuda="never", populate="background")  # fmt: skip
    try:
        with Arena.attach("p", directory=arena_dir, layout_key=KEY, register_cuda="never",
                          populate="background") as b:  # fmt: skip
            assert b.ready_blocks < 8
            assert not b.resume_populate() and b._populator is None  # its creator does it
            assert b._populator_alive()  # the creator (this process) lives
    finally:
        held_populate.set()
        plain.close()


def test_a_shared_arena_whose_janitor_cannot_start_is_closed_and_refused(
    arena_dir, monkeypatch, caplog
):
    path = os.path.join(arena_dir, "s")
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the janitor's Python: exits 1
    with pytest.raises(ArenaError) as err:
        open_shared(arena_dir)
    assert str(err.value) == (
        f"could not start the janitor that removes {path} once its last holder ends "
        f"({err.value.__cause__}): check that /bin/false can run a script with -I -S"
    )
    assert isinstance(err.value.__cause__, subprocess.CalledProcessError)
    # closed by its only holder, so removed, though the error (and its traceback) is
    # kept here: no descriptor, no mapping, no name left
    assert not os.path.exists(path)
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]  # fmt: skip
    assert not [fd for fd in fds if fd.startswith(path)]
    with open("/proc/self/maps") as maps:
        assert path not in maps.read()
    assert "still alive" not in caplog.text


def test_a_file_that_is_no_arena_or_not_ours_alone_is_refused_by_a_joiner(arena_dir):
    found = b"NOTOURS!"
    # a whole header's worth (exactly: read, not taken for a short file) or more
    for size in (arena_format.HEADER_BYTES, 2 * arena_format.HEADER_BYTES):
        path = leftover(arena_dir, found + bytes(size - 8))
        for num_blocks in (8, None):  # a creator finds it there, or a joiner
            with pytest.raises(ArenaError) as err:
                open_shared(arena_dir, num_blocks=num_blocks, timeout_s=0)
            assert str(err.value) == (
                f"arena {path}: header field 'magic' is {found!r}, expected "
                f"{arena_format.MAGIC!r}. Another model, dtype, block size or ecoffload version "
                "created it: use another arena name, or stop the processes using it and remove "
                "the file."
            )
        os.unlink(path)
    path = leftover(arena_dir, arena_format.MAGIC, mode=0o644)
    with pytest.raises(ArenaError) as err:
        open_shared(arena_dir, timeout_s=0)
    assert str(err.value) == (
        f"{path} has mode 644, expected 600: other users could read or change cached data; "
        "remove the file and let ecoffload create it"
    )
    os.unlink(path)
    # shorter than a header, all zeros: a creator that has not written it yet (or died
    # before its pid): waited for, never reclaimed without a dead creator to name
    for size in (0, 100):
        path = leftover(arena_dir, bytes(size))
        with pytest.raises(ArenaAttachTimeout) as err:
            open_shared(arena_dir, num_blocks=None, timeout_s=0)
        assert str(err.value).startswith(
            f"no valid shared arena at {path} after 0.0 s (the header is not written yet)"
        )
        assert os.path.getsize(path) == size
        os.unlink(path)


@pytest.mark.parametrize("mode", ["eager", "background"])
def test_a_joiner_resumes_what_the_populating_process_left_from_its_prefix(
    arena_dir, held_populate, monkeypatch, mode
):
    published = []
    real = populate.write_ready

    def record(mm, ready):
        published.append(ready)
        real(mm, ready)

    monkeypatch.setattr(populate, "write_ready", record)
    a = open_shared(arena_dir, populate="background")  # this process populates it...
    with open_shared(arena_dir, populate="background") as j:
        assert j._populator is None and not j.resume_populate(mode)  # ...and lives
        held_populate.set()  # (close waits for the chunk in progress)
        a.close()
        done = j.ready_bytes
        assert 0 < done < j.nbytes  # stopped half-way: the populator's lock is free
        del published[:]
        assert j.resume_populate(mode)
        if mode == "eager":  # finished before returning, nothing left running
            assert j.ready_bytes == j.nbytes and j._populator is None
        else:  # threads of this process go on, and the arena stops them when closed
            assert j._populator is not None and j.wait_ready(10)
        assert published and min(published) > done  # from its prefix on: never backwards
        assert not j.resume_populate(mode)  # nothing left to resume


def unwritten_header(pid: int, start: int) -> bytes:
    """A file whose creator (``pid``, started at ``start`` ticks) has not written the magic."""
    raw = bytearray(2 * arena_format.HEADER_BYTES)
    arena_format.HEADER.pack_into(raw, 0, arena_format.UNWRITTEN, arena_format.FORMAT_VERSION,
                                  arena_format.HEADER_BYTES, B, 1, arena_format.HEADER_BYTES,
                                  pid, start, 1, 0, 1, 0, 0, 0)  # fmt: skip
    return bytes(raw)


def test_only_an_unfinished_file_nobody_holds_whose_creator_died_is_reclaimed(arena_dir, caplog):
    me = (os.getpid(), process_start_time(os.getpid()))
    path = leftover(arena_dir, unwritten_header(*me))  # its creator (this process) lives
    with pytest.raises(ArenaAttachTimeout):
        open_shared(arena_dir, num_blocks=None, timeout_s=0)
    assert os.path.exists(path)
    os.unlink(path)
    path = leftover(arena_dir, unwritten_header(me[0], me[1] + 1))  # that pid, reused: dead
    holder = os.open(path, os.O_RDWR)  # another holder: not this joiner's to decide
    assert janitor_lock(holder, fcntl.F_RDLCK, arena_format.HOLDERS_BYTE, wait=False)
    with pytest.raises(ArenaAttachTimeout):
        open_shared(arena_dir, num_blocks=None, timeout_s=0)
    assert os.path.exists(path)
    os.close(holder)
    with (
        caplog.at_level(logging.WARNING, logger=LOG),
        pytest.raises(ArenaAttachTimeout),  # alone: reclaimed, then nothing to join
    ):
        open_shared(arena_dir, num_blocks=None, timeout_s=0)
    assert not os.path.exists(path)
    assert messages(caplog) == [
        f"arena {path}: its creator (process {me[0]}) died before finishing it; reclaiming it"
    ]


def test_a_joiner_s_refusals_name_the_file_and_what_it_found(arena_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU host too
    with open_shared(arena_dir, persistent=True) as s:
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir, persistent=False)
        assert str(err.value) == (
            f"arena {s.path} is persistent=True (set by the instance that created it), this "
            "process asked persistent=False: give every instance the same setting, or use "
            "another arena name"
        )
        with pytest.raises(ArenaError) as err:
            open_shared(arena_dir, persistent=True, layout_key={"model": "other"})
        assert str(err.value).startswith(f"arena {s.path}: header field 'layout_key' is ")
        with pytest.raises(ArenaError) as err:  # no CUDA: "always" is refused at join
            open_shared(arena_dir, persistent=True, register_cuda="always")
        assert str(err.value) == "register_cuda='always' but CUDA is not available"
    assert Arena.remove_shared("s", directory=arena_dir)


def test_open_shared_s_defaults_open_a_one_block_arena(arena_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto": host only
    with Arena.open_shared("d", directory=arena_dir, block_bytes=B, num_blocks=1,
                           layout_key=KEY) as a:  # fmt: skip
        assert a.num_blocks == 1 and not a.registered and a.wait_ready(10)


def test_an_opener_giving_num_blocks_joins_an_arena_larger_than_the_free_space(
    arena_dir, monkeypatch
):
    """Every process of an instance opens the shared arena with its size (the connector
    does): once the arena takes most of /dev/shm, the room check must not refuse the
    processes that only join it. A creator without room is refused, leaving no file."""
    first = open_shared(arena_dir)
    room = os.statvfs(arena_dir)
    tight = os.statvfs_result((*room[:4], 0, *room[5:]))  # f_bavail: no block free
    monkeypatch.setattr(os, "statvfs", lambda path: tight)
    with open_shared(arena_dir) as joiner:
        assert not joiner.created and joiner.nonce == first.nonce
    with pytest.raises(ArenaError, match="arena needs .* free: give the arena fewer bytes"):
        open_shared(arena_dir, name="other")
    assert not os.path.exists(os.path.join(arena_dir, "other"))
    first.close()
