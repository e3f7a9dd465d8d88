"""Faults: a writer killed mid-save, a creating process killed, CUDA registration
that fails. Nothing half-written is ever visible, nothing is left in the arena
directory, and the fallback is announced once.

A save is committed only through the engine's own completion path
(``Completion`` / ``split_completed``), with copies really in flight: an
unfinished copy that were taken for a finished one would publish the item."""

import logging
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from copy_gate import CopyGate

from ecoffload.engine import OffloadCache
from ecoffload.engine.arena import arena as arena_mod
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import ArenaError
from ecoffload.engine.catalog.allocator import BlockAllocator
from ecoffload.engine.catalog.catalog import Catalog, ItemState
from ecoffload.engine.transfer import Completion, split_completed

pytestmark = pytest.mark.slow
B = 4096


class ChildCopy:
    """The event of a copy another process makes: done once the child says so."""

    def __init__(self, finished) -> None:
        self.finished = finished

    def query(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.finished.wait(5)  # a dead writer never sets it: give up, as a timed-out wait


def _writer(arena_dir, extents, started, finished, complete):
    with Arena.attach("faults", directory=arena_dir, timeout_s=30, register_cuda="never") as a:
        start, count = extents[0]
        a.host[start * B : (start + count // 2) * B] = 0x5A  # half the item...
        started.set()
        if not complete:
            time.sleep(60)  # ...then killed before the copy completes
        a.host[(start + count // 2) * B : (start + count) * B] = 0x5A
        finished.set()


def _save_in_child(ctx, arena_dir, catalog, key, *, complete):
    entry = catalog.reserve(key, 8 * B)
    started, finished = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_writer,
                         args=(arena_dir, entry.extents, started, finished, complete))  # fmt: skip
    writer.start()
    assert started.wait(60)
    return writer, (Completion(ChildCopy(finished)), [key])


def _commit_finished(catalog, pending):
    finished, still = split_completed(pending)
    for keys in finished:
        for key in keys:
            catalog.commit(key)
    return still


def test_writer_killed_mid_save_never_exposes_the_item(arena_dir):
    ctx = mp.get_context("spawn")
    with Arena.create("faults", block_bytes=B, num_blocks=16, directory=arena_dir,
                      register_cuda="never") as arena:  # fmt: skip
        catalog = Catalog(BlockAllocator(16, B))
        writer, copy = _save_in_child(ctx, arena_dir, catalog, "img", complete=False)
        pending = _commit_finished(catalog, [copy])  # polled while the writer is mid-copy
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        assert writer.exitcode == -signal.SIGKILL
        for _ in range(3):  # polled again and again: the completion never comes
            pending = _commit_finished(catalog, pending)
            assert catalog.lookup("img") is None and "img" not in catalog  # never visible
        assert catalog.state("img") is ItemState.WRITING and len(pending) == 1
        start, _ = catalog.entry("img").extents[0]
        assert (arena.host[start * B : (start + 4) * B] == 0x5A).all()  # half written...
        assert not arena.host[(start + 4) * B : (start + 8) * B].any()  # ...half not
        catalog.abort("img")  # the completion never came: give the blocks back
        catalog.check()
        assert catalog.allocator.free_blocks == 16
        # The same path publishes a copy that does complete (the check above can fail).
        writer, copy = _save_in_child(ctx, arena_dir, catalog, "ok", complete=True)
        writer.join(60)
        assert writer.exitcode == 0 and not _commit_finished(catalog, [copy])
        assert catalog.lookup("ok") is not None
    # ...and a restart starts from an empty catalog over a fresh arena: nothing is served.
    with Arena.create("faults", block_bytes=B, num_blocks=16, directory=arena_dir,
                      register_cuda="never") as fresh:  # fmt: skip
        assert not fresh.host.any()


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_cache_writer_killed_mid_copy_never_serves_the_item(arena_dir, monkeypatch, backend):
    if backend == "reference":
        monkeypatch.setattr("ecoffload.engine.transfer.triton_available", lambda device: False)
    with OffloadCache.create("killed", arena_bytes=16 * B, block_bytes=B,
                             directory=arena_dir) as cache:  # fmt: skip
        gate = CopyGate.install(cache.mover)
        cache.save({"img": torch.full((8 * B,), 0x5A, dtype=torch.uint8)})
        start, _ = cache.catalog.entry("img").extents[0]
        cache.arena.host[start * B : (start + 4) * B] = 0x5A  # half of it landed...
        gate.kill()  # ...and the writer died before the copy completed
        for _ in range(3):
            cache.poll()
            assert cache.load(["img"]) == {} and "img" not in cache.catalog
        cache.flush()  # waiting for a dead writer gives up; it stays unpublished
        assert cache.catalog.state("img") is ItemState.WRITING
        assert cache.catalog.lookup("img") is None and cache.stats().items_stored == 0


def _creator(arena_dir, processes, ready):
    arena = Arena.create("crash", block_bytes=B, num_blocks=8, directory=arena_dir,
                         processes=processes, register_cuda="never")  # fmt: skip
    ready.set()
    time.sleep(60)  # killed here, the arena still open
    arena.close()


def _attacher(arena_dir, done):
    with Arena.attach("crash", directory=arena_dir, timeout_s=30, register_cuda="never"):
        done.set()
        time.sleep(60)


@pytest.mark.parametrize("all_attached", [True, False], ids=["after-attach", "before-attach"])
def test_creator_killed_leaves_no_file_and_restart_is_clean(arena_dir, all_attached):
    ctx = mp.get_context("spawn")
    ready, attached = ctx.Event(), ctx.Event()
    creator = ctx.Process(target=_creator, args=(arena_dir, 2, ready))
    creator.start()
    assert ready.wait(60)
    others = []
    if all_attached:
        others.append(ctx.Process(target=_attacher, args=(arena_dir, attached)))
        others[0].start()
        assert attached.wait(60)
    os.kill(creator.pid, signal.SIGKILL)
    creator.join(30)
    for p in others:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    if all_attached:
        assert os.listdir(arena_dir) == []  # unlinked as soon as both had mapped it
    else:
        assert os.listdir(arena_dir) == ["crash"]  # the creator died first: stale file
    with Arena.create_or_attach("crash", block_bytes=B, num_blocks=8, directory=arena_dir,
                                register_cuda="never") as restarted:  # fmt: skip
        assert restarted.created
    assert os.listdir(arena_dir) == []


def test_failed_cuda_registration_falls_back_with_one_warning(arena_dir, monkeypatch, caplog):
    from ecoffload.engine.arena import cuda_host

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (simulated)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_host, "HostRegistration", refuse)
    with (
        caplog.at_level(logging.WARNING, logger="ecoffload.engine.arena.arena"),
        Arena.create("reg", block_bytes=B, num_blocks=4, directory=arena_dir) as a,
    ):
        assert not a.registered and a.device is None  # host copies, never wrong data
        a.host[:4] = 1
    warnings = [r.getMessage() for r in caplog.records if "registration failed" in r.msg]
    assert len(warnings) == 1 and "fall back" in warnings[0]
    with pytest.raises(ArenaError, match="registration .* failed"):
        Arena.create("reg2", block_bytes=B, num_blocks=4, directory=arena_dir,
                     register_cuda="always")  # fmt: skip
    assert os.listdir(arena_dir) == []


def test_no_cuda_with_register_always_is_a_clear_error(arena_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ArenaError, match="CUDA is not available"):
        Arena.create("x", block_bytes=B, num_blocks=4, directory=arena_dir, register_cuda="always")
    assert os.listdir(arena_dir) == []


def test_arena_module_never_imports_cupy_without_cuda():
    assert "cupy" not in dir(arena_mod)
