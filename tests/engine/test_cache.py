"""The engine-level transfer API on CPU (interpreter kernel and reference path)."""

import re

import pytest
import torch
from copy_gate import CopyGate

from ecoffload.engine import OffloadCache
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import ItemStateError
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.transfer import BlockMover
from ecoffload.kernels.step_table import StepTable

B = 4096


def items(n, rows=10, hidden=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        f"img-{i}": torch.randn(rows + i, hidden, generator=g).to(torch.bfloat16) for i in range(n)
    }


@pytest.fixture(params=["kernel", "reference"])
def cache(request, arena_dir, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr("ecoffload.engine.transfer.triton_available", lambda device: False)
    with OffloadCache.create("c", arena_bytes=64 * B, block_bytes=B, directory=arena_dir) as c:
        assert c.mover.path == request.param
        yield c


def test_save_then_load_round_trip(cache):
    data = items(5)
    result = cache.save(data)
    assert result.saved == list(data) and not result.no_room
    got = cache.load(["img-0", "img-4", "img-9"])
    assert set(got) == {"img-0", "img-4"}
    for key, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, data[key])
    s = cache.stats()
    assert (s.hits, s.misses, s.items_stored) == (2, 1, 5)


def test_duplicate_keys_are_not_saved_twice(cache):
    cache.save(items(2))
    result = cache.save(items(3))
    assert result.already_cached == ["img-0", "img-1"] and result.saved == ["img-2"]


def test_eviction_under_pressure_then_reload(cache):
    # 20 items of ~8 KiB in a 64-block arena: the oldest are evicted.
    data = {f"k{i}": torch.full((4000,), i, dtype=torch.int16) for i in range(40)}
    for key, tensor in data.items():
        cache.save({key: tensor})
    s = cache.stats()
    assert s.evictions > 0 and s.items_resident < 40
    got = cache.load(list(data))
    assert "k39" in got and "k0" not in got
    for key, tensor in got.items():
        assert torch.equal(tensor, data[key])
    cache.catalog.check()


def test_loads_unpin_after_completion(cache):
    cache.save(items(1))
    cache.load(["img-0"])
    cache.flush()
    assert cache.catalog.entry("img-0").pins == 0


def test_a_save_is_invisible_until_its_copy_completes(cache):
    gate = CopyGate.install(cache.mover)
    data = items(3)
    result = cache.save(data)
    assert result.saved == list(data) and len(gate.in_flight) == 1  # one launch, in flight
    assert not cache.arena.host.any()  # really in flight: not one byte written yet
    for _ in range(2):
        cache.poll()
        for key in data:
            assert cache.catalog.state(key) is ItemState.WRITING and key not in cache.catalog
        assert cache.load(list(data)) == {}  # never served half-written
    assert cache.save(data).already_cached == list(data)  # being saved: not saved twice
    cache.flush()  # waits for the copy, then commits
    assert all(cache.catalog.state(k) is ItemState.READY for k in data)
    got = cache.load(list(data))
    gate.complete()
    assert all(torch.equal(got[k], data[k]) for k in data)
    assert cache.stats().items_stored == 3


def test_a_load_stays_pinned_until_its_copy_completes(cache):
    data = items(1)
    cache.save(data)  # synchronous: ready at once
    gate = CopyGate.install(cache.mover)
    got = cache.load(["img-0"])
    for _ in range(2):
        cache.poll()
        assert cache.catalog.entry("img-0").pins == 1
    with pytest.raises(ItemStateError, match="pinned"):
        cache.catalog.evict("img-0")
    pressure = cache.save({"big": torch.ones(63 * B + 1, dtype=torch.uint8)})  # needs 64 blocks
    assert pressure.no_room == ["big"] and cache.catalog.state("img-0") is ItemState.READY
    assert gate.complete() == 1
    cache.poll()
    assert cache.catalog.entry("img-0").pins == 0 and torch.equal(got["img-0"], data["img-0"])
    assert cache.save({"big": torch.ones(63 * B + 1, dtype=torch.uint8)}).saved == ["big"]
    gate.complete()
    cache.flush()
    assert cache.catalog.state("img-0") is None  # unpinned: evicted by the pressure


def test_item_too_big_for_room_left_is_skipped(arena_dir):
    with OffloadCache.create("c", arena_bytes=4 * B, block_bytes=B, directory=arena_dir) as c:
        c.save({"a": torch.zeros(3 * B, dtype=torch.uint8)})
        c.catalog.pin("a")  # a load in flight: cannot be evicted
        result = c.save({"b": torch.zeros(2 * B, dtype=torch.uint8)})
        assert result.no_room == ["b"] and c.stats().reserve_failures == 1
        c.catalog.unpin("a")


def test_mover_save_and_load_directly(arena_dir):
    with OffloadCache.create("m", arena_bytes=16 * B, block_bytes=B, directory=arena_dir) as c:
        mover = BlockMover(c.arena)
        src = torch.arange(3000, dtype=torch.int32)
        mover.save([src], StepTable.of_pairs([[(3, 3)]])).wait()
        (out,), done = mover.load(StepTable.of_pairs([[(3, 3)]]), [(torch.int32, (3000,))])
        done.wait()
        assert done.done() and torch.equal(out, src)


def test_a_mover_refuses_a_closed_arena_by_name(arena_dir):
    arena = Arena.create("gone", block_bytes=B, num_blocks=4, directory=arena_dir)
    mover, path = BlockMover(arena), arena.path
    arena.close()
    with pytest.raises(ValueError, match=re.escape(f"{path} is closed")):
        mover.save([torch.zeros(B, dtype=torch.uint8)], StepTable.of_pairs([[(0, 1)]]))
    with pytest.raises(ValueError, match=re.escape(f"{path} is closed")):
        mover.load(StepTable.of_pairs([[(0, 1)]]), [(torch.uint8, (B,))])


@pytest.mark.parametrize("integrity", [True, False], ids=["integrity-on", "integrity-off"])
def test_integrity_mode_catches_corrupted_arena_bytes(arena_dir, integrity):
    with OffloadCache.create("i", arena_bytes=16 * B, block_bytes=B, directory=arena_dir,
                             integrity=integrity) as cache:  # fmt: skip
        data = items(3)
        cache.save(data)
        got = cache.load(list(data))
        assert all(torch.equal(got[k], data[k]) for k in data)  # clean loads pass
        start, _ = cache.catalog.entry("img-1").extents[0]
        cache.arena.host[start * B + 10] ^= 0xFF  # a stray write after the save
        got = cache.load(list(data))
        if integrity:
            assert set(got) == {"img-0", "img-2"} and cache.integrity_failures == 1
            assert cache.catalog.state("img-1") is None  # dropped: recomputed next time
        else:
            assert not torch.equal(got["img-1"], data["img-1"])  # off: not detected
        cache.catalog.check()


def test_a_batch_never_evicts_its_own_already_cached_items(arena_dir):
    # Found by the long engine state machine: k0 was reported "already cached"
    # and then evicted by the reservation of k1 in the same call.
    with OffloadCache.create("b", arena_bytes=4 * B, block_bytes=B, directory=arena_dir) as c:
        c.save({"k0": torch.zeros(10, dtype=torch.uint8)})
        c.save({"big": torch.zeros(3 * B, dtype=torch.uint8)})
        result = c.save({"k1": torch.ones(B, dtype=torch.uint8), "k0": torch.zeros(10)})
        assert result.already_cached == ["k0"] and "k0" in c.catalog
        assert result.saved == ["k1"] and c.catalog.state("big") is None  # big was evicted
        assert c.catalog.entry("k0").pins == 0


def _two_caches_on_one_shared_arena(arena_dir):
    """Two caches on one shared arena: "other" plays another process (its catalog object
    is another one; the words, pins and the lock are the same ones)."""
    kw = dict(arena_bytes=16 * B, block_bytes=B, directory=arena_dir, shared=True)
    return OffloadCache.create("race", **kw), OffloadCache.create("race", **kw)


def test_an_eviction_racing_a_load_is_a_miss_or_waits_for_the_load(arena_dir):
    # The other process evicts each item right after the load's catalog call returns:
    # found and pinned in that one call, the item stays (the eviction is refused) and
    # loads whole; with a lookup and then a pin, the pin found it gone and the load
    # raised (seen: ItemStateError from a shared OffloadCache loading while another
    # process churned the same keys).
    mine, other = _two_caches_on_one_shared_arena(arena_dir)
    with mine, other:
        data = items(3)
        other.save(data)
        other.flush()
        real_lookup, refused = mine.catalog.lookup, []

        def lookup_then_evicted(key, **kw):
            entry = real_lookup(key, **kw)
            try:
                other.catalog.evict(key)
            except ItemStateError:
                refused.append(key)
            return entry

        mine.catalog.lookup = lookup_then_evicted
        loaded = mine.load(list(data))
        mine.flush()
        assert refused == list(data)  # pinned by the time the other process tried
        assert {k: torch.equal(t, data[k]) for k, t in loaded.items()} == dict.fromkeys(data, True)
        assert [mine.catalog.entry(k).pins for k in data] == [0, 0, 0]  # unpinned after


def test_a_key_another_process_reserves_during_a_save_counts_as_already_cached(arena_dir):
    # The other process reserves "img-1" between the save's "is it cached?" and its
    # reservation: the save skips it (it raised DuplicateItemError before) and saves the rest.
    mine, other = _two_caches_on_one_shared_arena(arena_dir)
    with mine, other:
        data = items(3)
        real_state = mine.catalog.state

        def state_then_reserved_elsewhere(key):
            state = real_state(key)
            if key == "img-1" and state is None:
                other.catalog.reserve(key, data[key].nbytes, "bfloat16", tuple(data[key].shape))
            return state

        mine.catalog.state = state_then_reserved_elsewhere
        result = mine.save(data)
        mine.flush()
        assert result.saved == ["img-0", "img-2"] and result.already_cached == ["img-1"]
        assert other.catalog.state("img-1") is ItemState.WRITING  # still the other's to commit
        other.catalog.abort("img-1")
        loaded = mine.load(list(data))
        assert sorted(loaded) == ["img-0", "img-2"]


def test_a_save_protects_only_what_is_still_there_when_it_pins(arena_dir):
    # "img-0" was READY when the save asked and is evicted by the other process just
    # before the save pins it: nothing to protect, the save goes on (it raised before).
    mine, other = _two_caches_on_one_shared_arena(arena_dir)
    with mine, other:
        data = items(2)
        mine.save({"img-0": data["img-0"]})
        mine.flush()
        real_pin = mine.catalog.pin

        def evicted_elsewhere_then_pinned(key):
            if key == "img-0" and other.catalog.state(key) is ItemState.READY:
                other.catalog.evict(key)
            return real_pin(key)

        mine.catalog.pin = evicted_elsewhere_then_pinned
        result = mine.save(data)
        mine.flush()
        assert result.saved == ["img-1"] and result.already_cached == ["img-0"]
        assert mine.catalog.state("img-0") is None and mine.catalog.entry("img-1").pins == 0


def _load_in_another_process(arena_dir, keys, out):
    with OffloadCache.create("s", arena_bytes=16 * B, block_bytes=B, directory=arena_dir,
                             shared=True, integrity=True) as c:  # fmt: skip
        got = c.load(keys)
        out.put({k: t.float().sum().item() for k, t in got.items()})
        out.put(c.stats().hits)


def test_shared_caches_in_two_processes_see_the_same_items(arena_dir):
    import multiprocessing as mp

    data = items(3)
    with OffloadCache.create("s", arena_bytes=16 * B, block_bytes=B, directory=arena_dir,
                             shared=True, integrity=True) as mine:  # fmt: skip
        assert mine.catalog.__class__.__name__ == "SharedCatalog"
        mine.save(data)
        mine.flush()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_load_in_another_process,
                        args=(arena_dir, ["img-0", "img-2", "nope"], out))  # fmt: skip
        p.start()
        sums, hits = out.get(timeout=120), out.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        assert sums == {k: data[k].float().sum().item() for k in ("img-0", "img-2")}
        assert hits == 2 and mine.stats().hits == 2  # host-wide counters
        assert mine.integrity_failures == 0
        mine.catalog.check()


def _persistent_producer(arena_dir, out, die):
    import os

    with OffloadCache.create("p", arena_bytes=16 * B, block_bytes=B, directory=arena_dir,
                             shared=True, persistent=True, integrity=True) as c:  # fmt: skip
        c.save(items(3))
        c.flush()
        out.put(({k: c.catalog.entry(k).extents for k in items(3)}, c.arena._data_offset))
        out.close()
        out.join_thread()  # flushed before a SIGKILL
        if die:
            os.kill(os.getpid(), 9)  # the last holder crashes: nobody validates, nobody closes


@pytest.mark.parametrize("end", ["closed", "killed"])
def test_a_persistent_shared_cache_restarts_warm_and_drops_corrupted_items(arena_dir, end):
    import multiprocessing as mp
    import os

    from ecoffload.engine.arena.arena import Arena

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_persistent_producer, args=(arena_dir, out, end == "killed"))
    p.start()
    extents, data_offset = out.get(timeout=120)
    p.join(60)
    assert p.exitcode == (0 if end == "closed" else -9)
    path = os.path.join(arena_dir, "p")
    fd = os.open(path, os.O_RDWR)  # a stray write while nobody held the file
    (start, _), *_ = extents["img-1"]
    os.pwrite(fd, b"\xff\xfe", data_offset + start * B + 3)
    os.close(fd)
    with OffloadCache.create("p", arena_bytes=16 * B, block_bytes=B, directory=arena_dir,
                             shared=True, persistent=True, integrity=True) as c:  # fmt: skip
        assert c.arena.warm_started
        # A miss from the open on: unverified (the background check may have dropped it).
        assert c.catalog.state("img-1") in (None, ItemState.UNVERIFIED)
        got = c.load(["img-0", "img-1", "img-2"])
        assert c.catalog.state("img-1") is None  # its lookup checked it: dropped
        data = items(3)
        assert set(got) == {"img-0", "img-2"} and all(torch.equal(got[k], data[k]) for k in got)
        assert c.integrity_failures == 0 and c.stats().hits == 2
        assert c.catalog.entry("img-0").producer[0] == p.pid  # saved by the other instance
        c.catalog.check()
    assert Arena.remove_shared("p", directory=arena_dir)


def test_a_warm_start_says_what_verification_kept_and_dropped(arena_dir, caplog):
    import logging
    import os

    kw = dict(arena_bytes=16 * B, block_bytes=B, directory=arena_dir, shared=True,
              persistent=True, integrity=True, max_items=4)  # fmt: skip
    with OffloadCache.create("p", **kw) as c:  # a catalog of 4 items, not 16
        c.save(items(3))
        c.flush()
        (start, _), *_ = c.catalog.entry("img-1").extents
        at, path = c.arena._data_offset + start * B + 3, c.arena.path
    fd = os.open(path, os.O_RDWR)  # a stray write while nobody held the file
    os.pwrite(fd, b"\xff\xfe", at)
    os.close(fd)
    with (
        caplog.at_level(logging.INFO, logger="ecoffload.engine"),
        OffloadCache.create("p", **kw) as c,
    ):
        assert c.arena.warm_started
        wait_verified(c.catalog)
        assert len(c.catalog) == 2 and c.catalog.verification().dropped == 1
    said = [r.getMessage() for r in caplog.records if r.name.endswith(("cache", "catalog"))]
    assert said[:2] == [
        f"ecoffload: warm start from {path}: 3 items kept; 3 (6.4 KiB) to verify in the "
        "background, misses until then; 0 without a CRC-32",
        f"catalog {path}: item 'img-1' fails its CRC-32; dropped",
    ]
    assert re.fullmatch(rf"catalog {re.escape(path)}: every item verified, [0-9.]+ s after "
                        "the warm start; 1 dropped", said[2]), said  # fmt: skip
    assert Arena.remove_shared("p", directory=arena_dir)


def wait_verified(catalog, timeout_s=30):
    """Until no item of ``catalog`` is left unverified (its openers' background threads)."""
    import time

    deadline = time.monotonic() + timeout_s
    while catalog.verification().items_left:
        assert time.monotonic() < deadline, catalog.verification()
        time.sleep(0.005)


def _slow_background_creator(arena_dir, created):
    import time

    from ecoffload.engine.arena import populate as populate_mod

    populate_mod.POPULATE_CHUNK = B  # one block per chunk, 0.3 s each: saves outpace it
    fault = populate_mod.prefault
    populate_mod.prefault = lambda *a: (time.sleep(0.3), fault(*a))
    c = OffloadCache.create("bg", arena_bytes=32 * B, block_bytes=B, directory=arena_dir,
                            shared=True, populate="background")  # fmt: skip
    created.put(c.arena.created)
    time.sleep(120)


def test_shared_background_populate_hands_out_ready_blocks_only_and_survives_its_creator(
    arena_dir,
):
    import multiprocessing as mp
    import os
    import signal
    import time

    ctx = mp.get_context("spawn")
    created = ctx.Queue()
    p = ctx.Process(target=_slow_background_creator, args=(arena_dir, created))
    p.start()
    assert created.get(timeout=120)
    kw = {"arena_bytes": 32 * B, "block_bytes": B, "directory": arena_dir, "shared": True,
          "populate": "background"}  # fmt: skip
    mine = OffloadCache.create("bg", **kw)
    one = torch.ones(B, dtype=torch.uint8)
    n = 0
    while mine.arena.ready_blocks < 8:
        mine.save({f"k{n}": one * (n % 251)})
        n += 1
        ready = mine.catalog.allocator.ready_blocks
        assert ready <= mine.arena.ready_blocks
        for e in mine.catalog.entries():  # reservations got ready blocks only
            assert all(start + count <= ready for start, count in e.extents), (e, ready)
        mine.catalog.check()
        time.sleep(0.005)
    assert mine.stats().evictions > 0  # the ready prefix, not the arena, was the room
    os.kill(p.pid, signal.SIGKILL)  # the creator dies mid-populate
    p.join(60)
    assert mine.arena.ready_blocks < 32 and not mine.arena.wait_ready(timeout_s=10)
    with OffloadCache.create("bg", **kw) as other:  # a new instance takes the populate over
        assert not other.arena.created and other.arena.wait_ready(timeout_s=60)
        mine.flush()
        before = mine.stats()  # up to 8 one-block items: as many as were ready (a race)
        assert before.items_resident <= before.ready_blocks < 32
        result = mine.save({f"x{i}": one * i for i in range(32)})
        mine.flush()
        assert not result.no_room and mine.catalog.allocator.ready_blocks == 32
        assert mine.stats().free_blocks == 0 and mine.stats().items_resident == 32
        # only the items already there made way: the newly ready blocks took the rest
        assert mine.stats().evictions - before.evictions == before.items_resident
        mine.catalog.check()
        assert (other.load(["x31"])["x31"] == 31).all()
    mine.close()


def test_a_warm_start_before_any_catalog_was_opened_formats_it_with_its_own_size(arena_dir):
    from ecoffload.engine.base.errors import ArenaError
    from ecoffload.engine.shared_cache import meta_bytes, open_catalog, open_shared_arena

    kw = dict(block_bytes=B, num_blocks=16, layout_key="m", directory=arena_dir,
              register_cuda="never", populate="eager", persistent=True, max_items=4)  # fmt: skip
    with open_shared_arena("p", **kw) as arena:  # its holder goes before opening the catalog
        assert arena.layout_key == "m"
        assert arena.meta_bytes == meta_bytes(16, B, 4) < meta_bytes(16, B)  # 4 items' room
    with open_shared_arena("p", **kw) as arena, open_catalog(arena, max_items=4) as catalog:
        assert arena.warm_started and len(catalog) == 0  # verified: formatted for 4 items
    assert Arena.remove_shared("p", directory=arena_dir)
    with pytest.raises(ArenaError) as err:  # this host has no CUDA
        open_shared_arena("p", **{**kw, "register_cuda": "always"})
    assert str(err.value) == "register_cuda='always' but CUDA is not available"
    Arena.remove_shared("p", directory=arena_dir)
