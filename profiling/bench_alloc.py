"""Per-item cost of reserving and freeing blocks: ecoffload's extent allocator and
catalog against a per-block free list (one list pop per block, as vLLM's CPU
connector allocates).

    python -m ecoffload.profiling.bench_alloc [--items N] [--rows 1024] [--hidden 4096]

Items are 1024 rows x 4096 bf16 (8 MiB) by default; the arena holds 64 of
them and the loop keeps it under pressure (every reserve past the first 64
frees the oldest item), which is the steady state of a full cache.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from ..engine.allocator import BlockAllocator
from ..engine.catalog import Catalog


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
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
