"""Multi-process soak: one arena shared by a coordinating process (it owns the
catalog, as vLLM's scheduler does), a saver process writing under eviction
pressure, and loader processes reading pinned items back. Every load is
checked against the CRC-32 the saver computed when it wrote the item.

Bounded time: ECOFFLOAD_SOAK_SECONDS (default 6 s in CI; `make soak` runs longer).
"""

import multiprocessing as mp
import os
import queue
import random
import time
import zlib

import pytest
import torch

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.catalog.allocator import BlockAllocator
from ecoffload.engine.catalog.catalog import Catalog
from ecoffload.kernels import empty_items, pack, unpack

pytestmark = pytest.mark.slow
B = 4096
NUM_BLOCKS = 64
LOADERS = 2


def item_bytes(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def worker(arena_dir: str, index: int, inbox, outbox) -> None:
    """Saver or loader: follows block tables sent by the coordinator."""
    with Arena.attach("soak", directory=arena_dir, timeout_s=60, register_cuda="never") as arena:
        outbox.put(("ready", index, None, None))
        while True:
            msg = inbox.get()
            if msg[0] == "stop":
                return
            kind, key, extents, nbytes, arg = msg
            if kind == "save":
                data = item_bytes(nbytes, arg)
                pack([data], [extents], arena.host, B)
                outbox.put(("saved", index, key, zlib.crc32(data.numpy())))
            else:
                (out,) = empty_items([(torch.uint8, (nbytes,))], "cpu")
                unpack(arena.host, [extents], B, [out])
                outbox.put(("loaded", index, key, zlib.crc32(out.numpy()) == arg))


def test_shared_arena_soak(arena_dir):
    seconds = float(os.environ.get("ECOFFLOAD_SOAK_SECONDS", "6"))
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(1 + LOADERS)]
    rng = random.Random(0)
    with Arena.create("soak", block_bytes=B, num_blocks=NUM_BLOCKS, directory=arena_dir,
                      processes=2 + LOADERS, register_cuda="never"):  # fmt: skip
        procs = [
            ctx.Process(target=worker, args=(arena_dir, i, q, outbox))
            for i, q in enumerate(inboxes)
        ]
        for p in procs:
            p.start()
        catalog = Catalog(BlockAllocator(NUM_BLOCKS, B))
        crcs: dict[str, int] = {}
        saving: set[str] = set()
        loading = [0] * LOADERS
        counts = {"saves": 0, "loads": 0, "no_room": 0, "evictions": 0}
        # The soak's time starts once every worker has imported and attached (a
        # spawned process takes seconds to import torch on a loaded machine).
        for _ in procs:
            try:
                assert outbox.get(timeout=120)[0] == "ready"
            except queue.Empty:
                pytest.fail("a soak worker did not start within 120 s")
        deadline = time.monotonic() + seconds
        next_key = 0
        try:
            while time.monotonic() < deadline or saving or any(loading):
                if time.monotonic() < deadline and len(saving) < 2:
                    key, nbytes = f"item-{next_key}", rng.randint(1, 12 * B)
                    next_key += 1
                    entry = catalog.reserve(key, nbytes)
                    if entry is None:
                        counts["no_room"] += 1
                    else:
                        saving.add(key)
                        inboxes[0].put(("save", key, entry.extents, nbytes, next_key))
                for i in range(LOADERS):
                    ready = [k for k in crcs if k in catalog]
                    if time.monotonic() < deadline and not loading[i] and ready:
                        key = rng.choice(ready)
                        entry = catalog.pin(key)
                        loading[i] = 1
                        inboxes[1 + i].put(("load", key, entry.extents, entry.nbytes, crcs[key]))
                try:
                    kind, index, key, value = outbox.get(timeout=30)
                except queue.Empty:
                    pytest.fail("a soak worker stopped answering")
                if kind == "saved":
                    saving.discard(key)
                    catalog.commit(key)
                    crcs[key] = value
                    counts["saves"] += 1
                else:
                    assert value, f"load of {key} does not match the checksum stored at save"
                    catalog.unpin(key)
                    loading[index - 1] = 0
                    counts["loads"] += 1
                crcs = {k: v for k, v in crcs.items() if catalog.state(k) is not None}
                catalog.check()
        finally:
            for q in inboxes:
                q.put(("stop",))
            for p in procs:
                p.join(30)
        counts["evictions"] = catalog.stats().evictions
    print(f"\nsoak {seconds:.0f} s: {counts}")
    assert all(p.exitcode == 0 for p in procs)
    assert counts["saves"] > 20 and counts["loads"] > 20 and counts["evictions"] > 0
    assert os.listdir(arena_dir) == []
