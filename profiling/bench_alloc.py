"""Per-item cost of reserving and freeing blocks: ecoffload's extent allocator and
catalog against a per-block free list (one list pop per block, as vLLM's CPU
connector allocates).

    python -m ecoffload.profiling.bench_alloc [--items N] [--rows 1024] [--hidden 4096]
    python -m ecoffload.profiling.bench_alloc --shared [--resident 100000]

Items are 1024 rows x 4096 bf16 (8 MiB) by default; the arena holds 64 of
them and the loop keeps it under pressure (every reserve past the first 64
frees the oldest item), which is the steady state of a full cache.

``--shared``: the in-process catalog and the shared (arena-resident) catalog
side by side, same keys (64 hex characters, like vLLM's multimodal hashes),
``--resident`` items of one block each resident in a full arena: lookup of a
resident key, reserve+commit of a new key (evicting the LRU item), pin+unpin.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import random
import statistics
import tempfile
import threading
import time

from ..engine.catalog.allocator import BlockAllocator
from ..engine.catalog.catalog import Catalog
from ..engine.catalog.shared import catalog as shared_catalog


class FreeListAllocator:
    """The anchor: one free-list entry per block; alloc pops, free appends."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.free_blocks = list(range(num_blocks))

    def alloc(self, nbytes: int) -> list[int] | None:
        need = -(-nbytes // self.block_bytes)
        if need > len(self.free_blocks):
            return None
        return [self.free_blocks.pop() for _ in range(need)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)


def churn(alloc, free, item_bytes: int, capacity: int, items: int) -> float:
    """Median microseconds per item for (alloc + free of the oldest) under pressure."""
    live: collections.deque = collections.deque()
    times = []
    for i in range(items):
        t0 = time.perf_counter()
        if len(live) == capacity:
            free(live.popleft())
        got = alloc(item_bytes)
        times.append((time.perf_counter() - t0) * 1e6)
        assert got is not None, f"item {i} did not fit"
        live.append(got)
    return statistics.median(times[capacity:])


def catalog_churn(catalog: Catalog, item_bytes: int, items: int) -> float:
    """Median microseconds per item for reserve (evicting LRU when full) + commit."""
    times = []
    for i in range(items):
        t0 = time.perf_counter()
        catalog.reserve(f"item-{i}", item_bytes, "bfloat16", (item_bytes // 8192, 4096))
        catalog.commit(f"item-{i}")
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[len(times) // 2 :])


def per_op(fn, keys: list, repeats: int = 5, clock=time.process_time) -> float:
    """Median over ``repeats`` runs of the mean microseconds of ``fn(key)`` per key.

    The clock is this process's CPU time (user + kernel, so the lock's system
    calls count) unless told otherwise: on a shared machine, wall time also
    counts the time other processes held the CPU.
    """
    runs = []
    for _ in range(repeats):
        t0 = clock()
        for key in keys:
            fn(key)
        runs.append((clock() - t0) * 1e6 / len(keys))
    return statistics.median(runs)


def shared_vs_local(resident: int, sample: int = 20000) -> list[tuple[str, float, float]]:
    """(operation, in-process us/op, shared us/op) with ``resident`` items resident."""
    block = 4096
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(resident + 6 * sample)]
    size = shared_catalog.meta_bytes(resident, block, max_items=resident, max_key_bytes=128)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=directory, prefix="ecoffload-bench-") as f:
        os.ftruncate(f.fileno(), size)
        shared = shared_catalog.SharedCatalog(f.fileno(), 0, size, num_blocks=resident,
                                              block_bytes=block, max_items=resident,
                                              max_key_bytes=128)  # fmt: skip
        local = Catalog(BlockAllocator(resident, block))
        rows: dict[str, list[float]] = {}
        for cat in (local, shared):
            for key in keys[:resident]:
                cat.reserve(key, block)
                cat.commit(key)
            rng = random.Random(0)
            hits = rng.sample(keys[:resident], sample)
            fresh = iter(keys[resident:])

            def reserve_commit(_, cat=cat, fresh=fresh):
                key = next(fresh)
                cat.reserve(key, block)
                cat.commit(key)

            def pin_unpin(key, cat=cat):
                cat.pin(key)
                cat.unpin(key)

            rows.setdefault("lookup (hit)", []).append(per_op(cat.lookup, hits))
            rows.setdefault("reserve+commit (evicts LRU)", []).append(
                per_op(reserve_commit, hits[: sample // 5])
            )
            resident_now = keys[resident + sample // 2 : resident + sample]  # just committed
            rows.setdefault("pin+unpin", []).append(per_op(pin_unpin, resident_now))
            batches = [resident_now[i : i + 16] for i in range(0, len(resident_now), 16)]

            def pin_unpin_16(batch, cat=cat):
                cat.pin_many(batch)
                cat.unpin_many(batch)

            rows.setdefault("pin_many+unpin_many, 16 keys (per key)", []).append(
                per_op(pin_unpin_16, batches) / 16
            )

            def connector_hit(key, cat=cat):  # has_cache_item, then the load's unpin
                if cat is shared:
                    cat.lookup(key, pin=True)
                else:
                    cat.lookup(key)
                    cat.pin(key)
                cat.unpin(key)

            rows.setdefault("connector hit: lookup+pin, then unpin", []).append(
                per_op(connector_hit, resident_now)
            )
            rows.setdefault("lookup (miss)", []).append(per_op(cat.lookup, keys[-sample:]))
            if cat is shared:  # the floor of every shared operation: the kernel's lock
                rows.setdefault("lock+unlock only (thread lock / shared lock)", []).append(
                    per_op(lambda _: (shared._lock(), shared._unlock()), hits)
                )
            else:
                tlock = threading.Lock()
                rows.setdefault("lock+unlock only (thread lock / shared lock)", []).append(
                    per_op(lambda _, tlock=tlock: (tlock.acquire(), tlock.release()), hits)
                )
            assert cat.stats().items_resident == resident
        shared.check()
        shared.close()
    return [(op, lo, sh) for op, (lo, sh) in rows.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--shared", action="store_true", help="in-process vs shared catalog with --resident items"
    )
    parser.add_argument("--resident", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.shared:
        print(
            f"{args.resident} items resident (one 4 KiB block each, arena full), "
            "keys of 64 hex characters; mean us/op of process CPU time (user + system), "
            "median of 5 runs\n"
        )
        print("| operation | in-process Catalog us/op | SharedCatalog us/op | ratio |")
        print("|---|---|---|---|")
        for op, lo, sh in shared_vs_local(args.resident):
            print(f"| {op} | {lo:.2f} | {sh:.2f} | {sh / lo:.1f}x |")
        return 0
    row_bytes = args.hidden * 2
    item_bytes = args.rows * row_bytes
    capacity = 64
    print(f"items of {args.rows} rows x {args.hidden} bf16 = {item_bytes >> 20} MiB, "
          f"arena of {capacity} items, {args.items} reserve+free cycles\n")  # fmt: skip
    rows = []
    for block in (row_bytes, 64 << 10):
        blocks = capacity * -(-item_bytes // block)
        fl = FreeListAllocator(blocks, block)
        ex = BlockAllocator(blocks, block)
        base = churn(fl.alloc, fl.free, item_bytes, capacity, args.items)
        ours = churn(ex.alloc, ex.free, item_bytes, capacity, args.items)
        cat = catalog_churn(Catalog(BlockAllocator(blocks, block)), item_bytes, args.items)
        per_item = -(-item_bytes // block)
        rows.append((block, per_item, base, ours, cat))
    print("| block | blocks/item | free list us/item | extent allocator us/item | ratio | "
          "catalog reserve+commit (with eviction) us/item |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for block, per_item, base, ours, cat in rows:
        print(f"| {block >> 10} KiB | {per_item} | {base:.2f} | {ours:.2f} | "
              f"{base / ours:.0f}x | {cat:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
