import errno
import gc
import logging
import multiprocessing as mp
import os
import stat
import struct
from pathlib import Path

import pytest
import torch

from ecoffload.engine.arena import arena as arena_mod
from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena import populate as populate_mod
from ecoffload.engine.arena.arena import ANY_LAYOUT, HEADER_BYTES, Arena, layout_key_text
from ecoffload.engine.base.errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaExistsError,
    ArenaLayoutMismatch,
    ArenaStaleError,
)

B = 4096
KEY = {"model": "tiny", "dtype": "bfloat16", "hidden": 128}


def create(arena_dir, name="a", **kw):
    kw.setdefault("block_bytes", B)
    kw.setdefault("num_blocks", 16)
    kw.setdefault("layout_key", KEY)
    return Arena.create(name, directory=arena_dir, **kw)


def test_create_file_mode_size_and_header(arena_dir):
    with create(arena_dir) as a:
        st = os.stat(a.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == HEADER_BYTES + 16 * B
        assert a.host.numel() == 16 * B and a.host.dtype == torch.uint8
        assert a.host.data_ptr() % 4096 == 0  # data area is page aligned
        assert a.layout_key == '{"dtype":"bfloat16","hidden":128,"model":"tiny"}'
        assert a.device is None and not a.registered
    assert not os.path.exists(a.path)  # creator's close unlinks


def test_create_refuses_existing_file(arena_dir):
    with create(arena_dir), pytest.raises(ArenaExistsError, match="already exists"):
        create(arena_dir)


def test_attach_sees_creator_bytes(arena_dir):
    with create(arena_dir) as a, Arena.attach("a", directory=arena_dir, layout_key=KEY) as b:
        a.host[100:108] = torch.arange(8, dtype=torch.uint8)
        assert b.host[100:108].tolist() == list(range(8))
        assert (b.block_bytes, b.num_blocks, b.created) == (B, 16, False)
        assert b.attached_processes() == 2


@pytest.mark.parametrize(
    "expect,field",
    [
        ({"block_bytes": 2 * B}, "block_bytes"),
        ({"num_blocks": 17}, "num_blocks"),
        ({"layout_key": {**KEY, "hidden": 4096}}, "layout_key"),
    ],
)
def test_attach_mismatch_names_field_expected_and_found(arena_dir, expect, field):
    with create(arena_dir), pytest.raises(ArenaLayoutMismatch) as err:
        Arena.attach("a", directory=arena_dir, timeout_s=0.2, **expect)
    assert err.value.field == field
    assert repr(err.value.expected) in str(err.value) or str(err.value.expected) in str(err.value)


def test_attach_rejects_other_format(arena_dir):
    path = os.path.join(arena_dir, "a")
    with open(path, "wb") as f:
        f.write(b"NOTOURS!" + bytes(2 * HEADER_BYTES))
    os.chmod(path, 0o600)
    try:
        with pytest.raises(ArenaLayoutMismatch, match="'magic'"):
            Arena.attach("a", directory=arena_dir, timeout_s=0.2)
    finally:
        os.unlink(path)


def test_attach_rejects_other_version(arena_dir):
    with create(arena_dir) as a:
        struct.pack_into("<I", a._mm, 8, 99)
        with pytest.raises(ArenaLayoutMismatch, match="format_version"):
            Arena.attach("a", directory=arena_dir, timeout_s=0.2)


def test_attach_times_out_on_missing_or_unfinished_arena(arena_dir):
    with pytest.raises(ArenaAttachTimeout, match="does not exist"):
        Arena.attach("missing", directory=arena_dir, timeout_s=0.1)
    path = os.path.join(arena_dir, "half")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, HEADER_BYTES + B)  # sized, header not yet written
    try:
        with pytest.raises(ArenaAttachTimeout, match="header is not written"):
            Arena.attach("half", directory=arena_dir, timeout_s=0.1)
    finally:
        os.close(fd)
        os.unlink(path)


def test_attach_refuses_symlink_and_wide_permissions(arena_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(HEADER_BYTES))
    os.symlink(target, os.path.join(arena_dir, "link"))
    try:
        with pytest.raises(ArenaError, match="symbolic link"):
            Arena.attach("link", directory=arena_dir, timeout_s=0.1)
    finally:
        os.unlink(os.path.join(arena_dir, "link"))
    with create(arena_dir) as a:
        os.chmod(a.path, 0o644)
        with pytest.raises(ArenaError, match="mode 644, expected 600"):
            Arena.attach("a", directory=arena_dir, timeout_s=0.1)


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "a..b", "x" * 201])
def test_bad_names_are_refused(arena_dir, name):
    with pytest.raises(ArenaError, match="not allowed"):
        create(arena_dir, name=name)


def test_name_unlinked_once_expected_processes_attached(arena_dir):
    with (
        create(arena_dir, processes=3) as a,
        Arena.attach("a", directory=arena_dir, layout_key=KEY),
    ):
        assert os.path.exists(a.path)
        with Arena.attach("a", directory=arena_dir, layout_key=KEY) as c:
            assert not os.path.exists(a.path)  # third process: name gone, mapping stays
            c.host[0] = 7
            assert a.host[0].item() == 7


def test_single_process_arena_is_unlinked_at_once(arena_dir):
    with create(arena_dir, processes=1) as a:
        assert not os.path.exists(a.path)
        a.host.fill_(1)


def test_attacher_close_never_unlinks(arena_dir):
    with create(arena_dir) as a:
        Arena.attach("a", directory=arena_dir, layout_key=KEY).close()
        assert os.path.exists(a.path)


def test_creator_close_leaves_a_replacement_file_alone(arena_dir):
    a = create(arena_dir)
    os.unlink(a.path)
    with create(arena_dir) as b:  # a new arena under the same name
        a.close()
        assert os.path.exists(b.path)


def test_close_is_idempotent_and_tolerates_live_views(arena_dir):
    a = create(arena_dir)
    view = a.host[:B]  # the caller still holds a view
    view.fill_(3)
    a.close()
    a.close()
    assert a.closed and a.host is None
    assert view.sum().item() == 3 * B  # mapping lives until the view is freed
    del view


def test_refuses_arena_larger_than_free_space(arena_dir):
    with pytest.raises(ArenaError, match="free"):
        create(arena_dir, num_blocks=1 << 40)


def test_populate_falls_back_without_madvise_support(arena_dir, monkeypatch):
    monkeypatch.setattr(populate_mod, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL
    with create(arena_dir) as a:
        assert a.host.sum().item() == 0


def test_populate_in_parallel_logs_progress(arena_dir, monkeypatch, caplog):
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", 8 * B)
    with (
        caplog.at_level(logging.INFO, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, num_blocks=64, populate_threads=2),
    ):
        pass
    assert any("pre-faulted" in r.message for r in caplog.records)


def _child_attach_write(arena_dir, queue):
    with Arena.attach("shared", directory=arena_dir, layout_key=KEY, timeout_s=10) as b:
        b.host[5 * B : 6 * B] = torch.full((B,), 42, dtype=torch.uint8)
        queue.put(b.attached_processes())


def test_second_process_attaches_writes_and_is_read_back(arena_dir):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with create(arena_dir, name="shared", processes=2) as a:
        child = ctx.Process(target=_child_attach_write, args=(arena_dir, queue))
        child.start()
        assert queue.get(timeout=60) == 2
        child.join(60)
        assert child.exitcode == 0
        assert torch.equal(a.host[5 * B : 6 * B], torch.full((B,), 42, dtype=torch.uint8))
        assert not os.path.exists(a.path)  # both processes mapped it: name already gone


def _child_create_late(arena_dir):
    import time

    time.sleep(0.5)
    with create(arena_dir, name="late", processes=2) as a:
        a.host[0] = 9
        deadline = time.time() + 30
        while os.path.exists(a.path) and time.time() < deadline:
            time.sleep(0.01)


def test_attach_waits_for_a_creator_that_starts_later(arena_dir):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_child_create_late, args=(arena_dir,))
    child.start()
    try:
        with Arena.attach("late", directory=arena_dir, layout_key=KEY, timeout_s=30) as b:
            assert b.block_bytes == B
    finally:
        child.join(60)
    assert child.exitcode == 0


def test_create_or_attach(arena_dir):
    kw = {"directory": arena_dir, "block_bytes": B, "num_blocks": 4}
    with Arena.create_or_attach("c", **kw) as a, Arena.create_or_attach("c", **kw) as b:
        assert a.created and not b.created


def test_create_or_attach_gives_create_and_attach_only_their_own_arguments(arena_dir):
    kw = {"directory": arena_dir, "block_bytes": B, "num_blocks": 4, "timeout_s": 5.0,
          "processes": 0, "populate_threads": 1, "meta_bytes": B}  # fmt: skip
    with Arena.create_or_attach("c", **kw) as a, Arena.create_or_attach("c", **kw) as b:
        assert a.created and not b.created and a.meta_bytes == b.meta_bytes == B


def test_create_or_attach_gives_up_after_three_files_gone_stale_under_it(
    arena_dir, monkeypatch, caplog
):
    path, tries = os.path.join(arena_dir, "c"), []

    def exists(cls, name, **kw):
        tries.append("create")
        raise ArenaExistsError(f"{path} already exists")

    def stale(cls, name, **kw):
        tries.append("attach")
        raise ArenaStaleError(path, 7, 4242)

    monkeypatch.setattr(Arena, "create", classmethod(exists))
    monkeypatch.setattr(Arena, "attach", classmethod(stale))
    with (
        caplog.at_level(logging.WARNING, logger=arena_mod.log.name),
        pytest.raises(ArenaError) as err,
    ):
        Arena.create_or_attach("c", directory=arena_dir, block_bytes=B, num_blocks=4)
    assert str(err.value) == "could not create or attach 'c': it keeps changing under us"
    assert tries == ["create", "attach"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        f"arena {path} was created by process 4242, which is gone: the file is stale. Remove it "
        "(Arena.create_or_attach and the vLLM connector reclaim it themselves); reclaiming it"
    ] * 3


def _child_create_and_die(arena_dir):
    a = create(arena_dir, name="stale", processes=2)  # nobody else attaches: name stays
    a.host[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    os._exit(0)  # no close: as if killed


def test_stale_arena_of_a_dead_creator_is_refused_then_reclaimed(arena_dir):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_child_create_and_die, args=(arena_dir,))
    child.start()
    child.join(60)
    path = os.path.join(arena_dir, "stale")
    assert os.path.exists(path)
    with pytest.raises(ArenaStaleError, match="is gone"):
        Arena.attach("stale", directory=arena_dir, timeout_s=5)
    with Arena.create_or_attach("stale", directory=arena_dir, block_bytes=B, num_blocks=16) as a:
        assert a.created and a.host[:4].tolist() == [0, 0, 0, 0]  # a fresh arena


def test_creator_that_died_while_initialising_is_detected_without_waiting(arena_dir):
    path = os.path.join(arena_dir, "half")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, HEADER_BYTES + B)
    dead = mp.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    header = arena_mod.Header(
        b"\0" * 8, 1, HEADER_BYTES, B, 1, HEADER_BYTES, dead.pid, 1, 7, 2, 1, 0, 0, 0
    )
    os.pwrite(fd, arena_format.HEADER.pack(*header), 0)
    os.close(fd)
    with pytest.raises(ArenaStaleError):
        Arena.attach("half", directory=arena_dir, timeout_s=30)
    os.unlink(path)


def test_every_process_sees_the_same_nonce(arena_dir):
    with create(arena_dir) as a, Arena.attach("a", directory=arena_dir, layout_key=KEY) as b:
        assert a.nonce == b.nonce != 0
    with create(arena_dir) as c:
        assert c.nonce != a.nonce


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the file to another user")
def test_attach_refuses_a_file_of_another_user(arena_dir):
    with create(arena_dir) as a:
        os.chown(a.path, 65534, 65534)
        with pytest.raises(ArenaError, match="belongs to uid 65534"):
            Arena.attach("a", directory=arena_dir, timeout_s=0.1)


def _claim(arena_dir, result):
    with Arena.attach("a", directory=arena_dir, layout_key=KEY, timeout_s=10) as b:
        try:
            b.claim_ownership()
            result.put("claimed")
        except ArenaError as exc:
            result.put(str(exc))


def test_one_catalog_owner_per_arena(arena_dir):
    with create(arena_dir) as a:
        a.claim_ownership()
        a.claim_ownership()  # the owner may claim again
        ctx = mp.get_context("spawn")
        result = ctx.Queue()
        other = ctx.Process(target=_claim, args=(arena_dir, result))
        other.start()
        assert "already has a catalog owner" in result.get(timeout=60)
        other.join(30)


def test_attach_without_a_key_refuses_a_keyed_arena(arena_dir):
    with create(arena_dir):  # made with KEY
        with pytest.raises(ArenaLayoutMismatch) as err:
            Arena.attach("a", directory=arena_dir, timeout_s=0.2)
        assert err.value.field == "layout_key" and err.value.expected == ""
        with pytest.raises(ArenaLayoutMismatch, match="layout_key"):
            Arena.create_or_attach("a", directory=arena_dir, block_bytes=B, num_blocks=16)
        with Arena.attach("a", directory=arena_dir, layout_key=ANY_LAYOUT) as b:
            assert b.layout_key == layout_key_text(KEY)  # the explicit opt-out maps any key
        kw = {"directory": arena_dir, "block_bytes": B, "num_blocks": 16}
        with Arena.create_or_attach("a", layout_key=ANY_LAYOUT, **kw) as c:
            assert not c.created
    with Arena.create_or_attach("n", layout_key=ANY_LAYOUT, **kw) as d:
        assert d.created and d.layout_key == ""
        with pytest.raises(ArenaLayoutMismatch, match="layout_key"):
            Arena.attach("n", directory=arena_dir, layout_key=KEY, timeout_s=0.2)
        with Arena.attach("n", directory=arena_dir) as e:  # no key on either side
            assert e.layout_key == ""
    with pytest.raises(ArenaError, match="ANY_LAYOUT is for attach"):
        create(arena_dir, layout_key=ANY_LAYOUT)


def test_attach_refuses_a_header_without_blocks_and_saturates_the_attach_count(arena_dir):
    # Found by the header fuzzer: block_bytes 0 in a header-sized file escaped as a
    # ValueError from torch.frombuffer; a full attach counter as a struct.error.
    with create(arena_dir) as a:
        struct.pack_into("<I", a._mm, arena_format.ATTACHED_OFFSET, 2**32 - 1)
        with Arena.attach("a", directory=arena_dir, layout_key=KEY, timeout_s=0.2) as b:
            assert b.attached_processes() == 2**32 - 1
        header = arena_mod.Header(*arena_format.HEADER.unpack_from(a._mm))
        arena_format.HEADER.pack_into(a._mm, 0, *header._replace(block_bytes=0))
        os.truncate(a.path, HEADER_BYTES)
        with pytest.raises(ArenaLayoutMismatch) as err:
            Arena.attach("a", directory=arena_dir, layout_key=KEY, timeout_s=0.2)
        assert err.value.field == "block_bytes"


def test_create_refuses_bad_sizes_and_keys_by_name(arena_dir):
    for block_bytes in (0, -B, B + 1):
        with pytest.raises(ArenaError) as err:
            create(arena_dir, block_bytes=block_bytes)
        assert str(err.value) == (
            f"block_bytes must be a positive multiple of the page size ({B}), got {block_bytes}"
        )
    most = arena_format.MAX_LAYOUT_KEY_BYTES
    with pytest.raises(ArenaError) as err:
        create(arena_dir, layout_key="k" * (most + 1))
    assert str(err.value) == f"layout key is {most + 1} bytes, at most {most} fit the header"
    with create(arena_dir, layout_key="k" * most) as a:  # exactly what fits
        assert a.layout_key == "k" * most
    with pytest.raises(ArenaError) as err:
        create(arena_dir, layout_key=ANY_LAYOUT)
    assert str(err.value) == "ANY_LAYOUT is for attach: give create the arena's real layout key"
    for kw, message in [
        ({"num_blocks": 0}, "num_blocks must be positive, got 0"),
        ({"processes": -1}, "processes must be >= 0, got -1"),
        ({"meta_bytes": -1}, "meta_bytes must be >= 0, got -1"),
    ]:
        with pytest.raises(ArenaError) as err:
            create(arena_dir, **kw)
        assert str(err.value) == message
    with create(arena_dir, num_blocks=1, meta_bytes=1) as a:  # one block; a page of metadata
        assert (a.num_blocks, a.meta_offset, a.meta_bytes) == (1, HEADER_BYTES, B)
        assert os.stat(a.path).st_size == HEADER_BYTES + 2 * B
        with pytest.raises(ArenaExistsError) as err:
            create(arena_dir)
        assert str(err.value) == (
            f"{a.path} already exists: attach to it, pick another arena name, or remove the "
            "file if no process uses it"
        )
    assert os.listdir(arena_dir) == []


def test_a_create_that_fails_before_mapping_raises_its_error_and_leaves_no_file(
    arena_dir, monkeypatch
):
    def no_room(fd, size):
        raise OSError(errno.ENOSPC, "no room for the arena")

    monkeypatch.setattr(os, "ftruncate", no_room)
    with pytest.raises(OSError) as err:
        create(arena_dir)
    assert err.value.errno == errno.ENOSPC and str(err.value) == "[Errno 28] no room for the arena"
    assert os.listdir(arena_dir) == []


def test_attach_waits_30_s_by_default_and_names_the_file_it_waited_for(arena_dir, monkeypatch):
    class Clock:  # the wait's clock: a sleep passes at once
        now = 100.0

        @classmethod
        def monotonic(cls):
            return cls.now

        @classmethod
        def sleep(cls, seconds):
            cls.now += seconds

    monkeypatch.setattr(arena_mod, "time", Clock)
    monkeypatch.setattr(arena_format, "time", Clock)
    path = os.path.join(arena_dir, "a")
    with pytest.raises(ArenaAttachTimeout) as err:
        Arena.attach("a", directory=arena_dir)
    assert str(err.value) == (
        f"no valid arena at {path} after 30.0 s (the file does not exist): start the creating "
        "process first, or raise the attach timeout"
    )
    assert 130.0 <= Clock.now < 131.0
    with create(arena_dir), pytest.raises(ArenaLayoutMismatch) as err:
        Arena.attach("a", directory=arena_dir, num_blocks=17)
    assert err.value.path == path


def test_attach_logs_the_file_and_registers_as_asked(arena_dir, caplog):
    with create(arena_dir, register_cuda="never") as a:
        with caplog.at_level(logging.INFO, logger=arena_mod.log.name):
            Arena.attach("a", directory=arena_dir, layout_key=KEY, register_cuda="never").close()
        assert [r.getMessage() for r in caplog.records] == [f"attached arena {a.path}"]
        with pytest.raises(ArenaError) as err:  # this host has no CUDA
            Arena.attach("a", directory=arena_dir, layout_key=KEY, register_cuda="always")
        assert str(err.value) == "register_cuda='always' but CUDA is not available"


def test_a_refused_attach_unmaps_at_once(arena_dir):
    with create(arena_dir, register_cuda="never") as a:
        with pytest.raises(ArenaError) as err:  # this host has no CUDA
            Arena.attach("a", directory=arena_dir, layout_key=KEY, register_cuda="always")
        mapped = [m for m in Path("/proc/self/maps").read_text().splitlines() if a.path in m]
        assert len(mapped) == 1 and err.value  # the creator's alone, while the error lives


def test_the_header_names_the_creator_the_sizes_and_no_catalog_owner(arena_dir):
    with create(arena_dir, processes=3, meta_bytes=1) as a:
        header = arena_format.read_header(a._mm)
        pid = os.getpid()
        assert header == arena_mod.Header(
            arena_format.MAGIC, arena_format.FORMAT_VERSION, HEADER_BYTES, B, 16, HEADER_BYTES + B,
            pid, arena_mod.process_start_time(pid), a.nonce, 3, 1, len(a.layout_key), 0, 0,
        )  # fmt: skip
        assert header.creator_start > 0 and not a.warm_started
        a.claim_ownership()  # nobody owns a new arena


def test_an_arena_dropped_without_close_is_closed_by_the_collector(arena_dir):
    a = create(arena_dir)
    path, fd = a.path, a.fileno()
    del a
    gc.collect()
    assert not os.path.exists(path)  # the creator's close unlinked it
    with pytest.raises(OSError):
        os.fstat(fd)  # and closed its descriptor


def test_a_view_that_outlives_close_keeps_the_mapping_until_it_is_freed(arena_dir, caplog):
    a = create(arena_dir)
    view = a.host[:4]
    view[:] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger=arena_mod.log.name):
        a.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"arena {a.path}: tensors created from it are still alive; the mapping is released "
        "when they are freed"
    ]
    assert view.tolist() == [1, 2, 3, 4]  # still mapped, never dangling
    del view
    gc.collect()
    assert [m for m in Path("/proc/self/maps").read_text().splitlines() if a.path in m] == []


def test_an_attacher_judges_the_creator_s_populate_by_its_pid_and_start_time(
    arena_dir, monkeypatch
):
    """The creator recorded as a process identity (pid and start time): once its pid runs
    another process (started at another time), an attacher no longer waits for its
    populate; with the same start it does."""
    from ecoffload.engine.base import liveness

    with create(arena_dir) as a, Arena.attach("a", directory=arena_dir, layout_key=KEY) as b:
        assert b._creator == liveness.ProcessId.of_this_process()
        assert type(b._creator) is liveness.ProcessId and b._populator_alive()
        start = b._creator.start
        monkeypatch.setattr(liveness, "process_start_time", lambda pid: start + 1)
        assert not b._populator_alive()  # the pid was reused
        assert a.ready_bytes == a.nbytes
