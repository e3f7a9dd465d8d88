"""Multi-process soak of the shared catalog with SIGKILLs, inside locked updates too.

Producers reserve random keys, write random bytes into the blocks and commit
with the bytes' CRC-32; consumers pin READY items and check their bytes
against that CRC; an evictor evicts, reaps and forces recoveries. Every
process also kills itself with a small probability at the fault points inside
locked updates (or sleeps there, widening the window for the parent's kills),
and the parent SIGKILLs a random running process every 0.1-0.5 s and
starts a new one in its place. Afterwards the parent recovers and checks
every invariant (no block owned twice, none lost), that no reservation of a
dead process survives, and that every READY item's bytes match its CRC.

Bounded work: ECOFFLOAD_SHARED_SOAK_OPS operations (default 3,000 in CI; the
long profile is 100,000), at most ECOFFLOAD_SHARED_SOAK_SECONDS seconds
(default 60).
"""

import mmap
import multiprocessing as mp
import os
import random
import signal
import time
import zlib

import pytest

from ecoffload.engine.base.errors import CatalogError
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import catalog as shared_catalog
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared.catalog import SharedCatalog

pytestmark = pytest.mark.slow
B = 4096
NUM_BLOCKS = 256
MAX_ITEMS = 48  # fewer slots than keys: slots run out too
KEYS = [f"img-{i}" for i in range(96)]
META = shared_catalog.meta_bytes(NUM_BLOCKS, B, max_items=MAX_ITEMS, max_pins=64)
ROLES = ["producer", "producer", "consumer", "consumer", "evictor"]
P_KILL, P_SLEEP = 0.0005, 0.01  # per fault point passed


def _open(path):
    fd = os.open(path, os.O_RDWR)
    catalog = SharedCatalog(fd, 0, META)
    data = mmap.mmap(fd, NUM_BLOCKS * B, mmap.MAP_SHARED, offset=META)
    os.close(fd)
    return catalog, data


def read_item(data, entry) -> bytes:
    out = b"".join(data[s * B : (s + c) * B] for s, c in entry.extents)
    return out[: entry.nbytes]


def role_main(path, role, index, seed, ops, kills_inside, bad, started):
    rng = random.Random(seed)

    def hook(point):
        r = rng.random()
        if r < P_KILL:
            kills_inside[index] += 1
            os.kill(os.getpid(), signal.SIGKILL)
        elif r < P_KILL + P_SLEEP:
            time.sleep(0.002)

    fault_points.hook = hook
    catalog, data = _open(path)
    started[index] = os.getpid()  # the parent kills only processes that got this far
    done = 0
    while True:
        key = rng.choice(KEYS)
        try:
            if role == "producer":
                nbytes = rng.randint(1, 6 * B)
                entry = catalog.reserve(key, nbytes)
                if entry is not None:
                    payload = rng.randbytes(nbytes)
                    at = 0
                    for s, c in entry.extents:
                        chunk = payload[at : at + c * B]
                        data[s * B : s * B + len(chunk)] = chunk
                        at += c * B
                    if rng.random() < 0.05:
                        catalog.abort(key)
                    else:
                        catalog.commit(key, zlib.crc32(payload), generation=entry.generation)
            elif role == "consumer":
                if catalog.lookup(key) is not None:
                    entry = catalog.pin(key)
                    if zlib.crc32(read_item(data, entry)) != entry.checksum:
                        bad[index] += 1
                    catalog.unpin(key)
            else:
                r = rng.random()
                if r < 0.01:
                    catalog.recover()
                elif r < 0.05:
                    catalog.reap()
                elif r < 0.25:
                    catalog.evict(key)
                else:
                    catalog.lookup(key)  # reorders the LRU under the others' feet
                    time.sleep(0.0005)
        except CatalogError:
            pass  # raced with another process: evicted, duplicate, still writing
        done += 1
        if done % 20 == 0:
            ops[index] += 20


def test_shared_catalog_survives_sigkills(tmp_path):
    target = int(os.environ.get("ECOFFLOAD_SHARED_SOAK_OPS", "3000"))
    seconds = float(os.environ.get("ECOFFLOAD_SHARED_SOAK_SECONDS", "60"))
    path = str(tmp_path / "arena")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, META + NUM_BLOCKS * B)
    SharedCatalog(fd, 0, META, num_blocks=NUM_BLOCKS, block_bytes=B, max_items=MAX_ITEMS,
                  max_pins=64).close()  # fmt: skip
    os.close(fd)
    ctx = mp.get_context("spawn")
    ops = ctx.RawArray("q", len(ROLES))
    kills_inside = ctx.RawArray("q", len(ROLES))
    bad = ctx.RawArray("q", len(ROLES))
    started = ctx.RawArray("q", len(ROLES))
    rng = random.Random(12)
    starts = 0

    def start(i):
        nonlocal starts
        starts += 1
        p = ctx.Process(target=role_main, args=(path, ROLES[i], i, rng.getrandbits(32), ops,
                                                 kills_inside, bad, started),
                       daemon=True)  # fmt: skip
        p.start()
        return p

    procs = [start(i) for i in range(len(ROLES))]
    kills_outside = 0
    deadline = time.monotonic() + seconds
    try:
        # Until the work is done, every role has run and one kill came from outside:
        # fast operations can reach the target before a slow spawn has finished.
        while (sum(ops) < target or not all(started) or not kills_outside) and (
            time.monotonic() < deadline
        ):
            time.sleep(rng.uniform(0.1, 0.5))
            victim = rng.randrange(len(ROLES))
            if started[victim] == procs[victim].pid and procs[victim].is_alive():
                os.kill(procs[victim].pid, signal.SIGKILL)
                kills_outside += 1
            for i, p in enumerate(procs):
                if not p.is_alive():
                    p.join()
                    assert p.exitcode == -signal.SIGKILL, f"{ROLES[i]} failed: {p.exitcode}"
                    procs[i] = start(i)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)
    failed = [(ROLES[i], p.exitcode) for i, p in enumerate(procs) if p.exitcode != -signal.SIGKILL]
    assert not failed, f"processes ended otherwise than by SIGKILL: {failed}"
    total = sum(ops)
    catalog, data = _open(path)  # opening reaps the dead (all of them now)
    catalog.check()
    entries = catalog.entries()
    assert all(e.state is ItemState.READY and e.pins == 0 for e in entries)
    for e in entries:
        assert zlib.crc32(read_item(data, e)) == e.checksum, f"{e.key}: bytes do not match"
    stats = catalog.stats()
    print(f"\nshared soak: {total} ops, {starts} process starts, {kills_outside} kills from "
          f"outside, {sum(kills_inside)} inside locked updates, {catalog.recoveries} recoveries, "
          f"{len(entries)} items resident, {stats.items_stored} committed, "
          f"{stats.evictions} evictions, {stats.reserve_failures} reserve failures")  # fmt: skip
    assert sum(bad) == 0, "a consumer read a pinned READY item whose bytes did not match"
    assert total >= min(target, 500) and kills_outside + sum(kills_inside) > 0
    data.close()
    catalog.close()
