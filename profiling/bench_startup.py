"""Arena start-up: time from ``create`` to the first successful save, and to full
readiness, with the populate done eagerly (before ``create`` returns) or in the
background, side by side at each arena size.

    python -m ecoffload.profiling.bench_startup [--sizes 1GiB,4GiB,16GiB] [--dir /dev/shm]
    python -m ecoffload.profiling.bench_startup --warm [--sizes 2GiB,8GiB] [--item-bytes 256KiB]

Each run creates a fresh arena (``OffloadCache.create``), then saves one item
(1024 rows x 4096 bf16 = 8 MiB by default) until the save succeeds, then waits
until every block is ready (populated and, with CUDA, registered), and closes.
Sizes that do not fit the arena directory or the available memory (with 1 GiB
to spare) are skipped and said so. One arena at a time; each size runs
``--repeat`` rounds of both modes, the order flipped every round (the first
run of a size may pay for the kernel reclaiming page cache), and the table
shows the fastest run of each mode.

``--warm``: the warm restart of a persistent shared arena instead. The arena is
filled with items of ``--item-bytes`` saved with their CRC-32, closed, then
reopened as a new instance would (``open_shared_arena`` + ``open_catalog``):
the table gives the seconds from the call until the open returns, until the
first hit (a lookup of the item saved last, so a verification walking the
slots in order reaches it last), and until every item is verified; and the
longest wait of a second process that joins meanwhile and takes the catalog's
lock in a loop.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import TYPE_CHECKING

import torch

from ..engine.base.items import item_crc32
from ..engine.base.sizes import format_bytes, parse_bytes
from ..engine.cache import OffloadCache

if TYPE_CHECKING:
    from ..engine.arena.arena import PopulateMode

_SPARE = 1 << 30


def available_bytes(directory: str) -> int:
    """What one more arena may take: free space in ``directory`` and MemAvailable."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = min(free, int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    return free - _SPARE


def run_once(
    size: int, mode: PopulateMode, directory: str, item: torch.Tensor
) -> tuple[float, ...]:
    """(create returned, first save done, fully ready), seconds after the call, one arena."""
    name = f"ecoffload-bench-startup-{os.getpid()}"
    t0 = time.perf_counter()
    cache = OffloadCache.create(name, arena_bytes=size, directory=directory, populate=mode,
                                device=item.device)  # fmt: skip
    created = time.perf_counter() - t0
    with cache:
        while not cache.save({"item": item}).saved:
            time.sleep(0.001)
        cache.flush()
        first = time.perf_counter() - t0
        cache.arena.wait_ready()
        ready = time.perf_counter() - t0
    return created, first, ready


def fill_persistent(
    name: str, size: int, item_bytes: int, block_bytes: int, directory: str
) -> list[int]:
    """A persistent shared arena of ``size`` bytes full of ``item_bytes`` items
    (``item-<i>``: random bytes, the first 8 the index), each committed with its CRC-32,
    then closed (nobody holds it). The file offset of each item's first byte."""
    import numpy as np

    from ..engine.shared_cache import open_catalog, open_shared_arena

    arena = open_shared_arena(name, block_bytes=block_bytes, num_blocks=size // block_bytes,
                              layout_key="bench-warm", directory=directory,
                              register_cuda="never", populate="eager", persistent=True,
                              max_items=size // item_bytes)  # fmt: skip
    with arena, open_catalog(arena, max_items=size // item_bytes) as catalog:
        host = arena.host_tensor().numpy()
        tile = np.random.default_rng(0).integers(0, 256, item_bytes, dtype=np.uint8)
        n, offsets, data_at = 0, [], arena.meta_offset + arena.meta_bytes
        need = -(-item_bytes // block_bytes)
        while n < size // item_bytes and catalog.stats().free_blocks >= need:  # no eviction
            entry = catalog.reserve(f"item-{n}", item_bytes)
            assert entry is not None, "free blocks were counted above"
            tile[:8] = np.frombuffer(n.to_bytes(8, "little"), dtype=np.uint8)
            left = item_bytes
            for start, count in entry.extents:
                take = min(count * block_bytes, left)
                at = start * block_bytes
                host[at : at + take] = tile[item_bytes - left : item_bytes - left + take]
                left -= take
            catalog.commit(entry.key, item_crc32(host, entry.extents, block_bytes, item_bytes))
            offsets.append(data_at + entry.extents[0][0] * block_bytes)
            n += 1
        del host
    return offsets


def _joiner(name: str, directory: str, block_bytes: int, num_blocks: int, max_items: int,
            go, out) -> None:  # fmt: skip
    """A second instance opening the arena 50 ms after the first began reopening it:
    how long its open took, then its longest and median wait for the catalog's lock
    (one ``stats()`` call) until every item is verified."""
    from ..engine.shared_cache import open_catalog, open_shared_arena

    go.wait()
    time.sleep(0.05)
    t0 = time.perf_counter()
    arena = open_shared_arena(name, block_bytes=block_bytes, num_blocks=num_blocks,
                              layout_key="bench-warm", directory=directory,
                              register_cuda="never", populate="eager", persistent=True,
                              max_items=max_items)  # fmt: skip
    waits = []
    with arena, open_catalog(arena, max_items=max_items) as catalog:
        opened = time.perf_counter() - t0
        verification = getattr(catalog, "verification", None)
        t_end = time.perf_counter() + 60
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            catalog.stats()  # takes the lock
            waits.append(time.perf_counter() - t)
            if verification is None or not verification().items_left:
                break
            time.sleep(0.001)
    out.put((opened, max(waits), sorted(waits)[len(waits) // 2]))


def run_warm(size: int, item_bytes: int, block_bytes: int, directory: str) -> tuple:
    """(items, open returns, first hit, fully verified, the joiner's open, its longest
    and median lock wait), seconds, for one warm restart of a freshly filled arena."""
    import multiprocessing as mp

    from ..engine.arena.arena import Arena
    from ..engine.shared_cache import open_catalog, open_shared_arena

    name = f"ecoffload-bench-warm-{os.getpid()}"
    max_items, num_blocks = size // item_bytes, size // block_bytes
    try:
        n = len(fill_persistent(name, size, item_bytes, block_bytes, directory))
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        joiner = ctx.Process(target=_joiner, args=(name, directory, block_bytes, num_blocks,
                                                   max_items, go, out))  # fmt: skip
        joiner.start()
        time.sleep(3)  # its imports, before the clock starts
        go.set()
        t0 = time.perf_counter()
        arena = open_shared_arena(name, block_bytes=block_bytes, num_blocks=num_blocks,
                                  layout_key="bench-warm", directory=directory,
                                  register_cuda="never", populate="eager", persistent=True,
                                  max_items=max_items)  # fmt: skip
        with arena, open_catalog(arena, max_items=max_items) as catalog:
            opened = time.perf_counter() - t0
            while catalog.lookup(f"item-{n - 1}") is None:
                time.sleep(0.0005)
            first = time.perf_counter() - t0
            verification = getattr(catalog, "verification", None)
            while verification is not None and verification().items_left:
                time.sleep(0.002)
            verified = time.perf_counter() - t0
            joined, longest, median = out.get(timeout=300)
            joiner.join(60)
    finally:
        Arena.remove_shared(name, directory=directory)
    return n, opened, first, verified, joined, longest, median


def warm_main(args: argparse.Namespace) -> int:
    item = parse_bytes(args.item_bytes, name="--item-bytes")
    block = parse_bytes(args.block_bytes, name="--block-bytes")
    sizes = [parse_bytes(s.strip(), name="--sizes") for s in args.sizes.split(",") if s.strip()]
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, arena dir "
          f"{args.dir}; items of {format_bytes(item)} in blocks of {format_bytes(block)}, "
          "saved with their CRC-32")  # fmt: skip
    print()
    print("Seconds after the reopening call; the joiner is a second process that starts "
          "opening the arena 50 ms after it, then takes the catalog's lock in a loop.")  # fmt: skip
    print()
    print("| arena | items | open returns s | first hit (last item) s | fully verified s | "
          "verified GiB/s | joiner's open s | its longest lock wait ms | median ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        room = available_bytes(args.dir)
        if size > room:
            print(f"| {format_bytes(size)} | skipped: {format_bytes(max(room, 0))} available |"
                  " | | | | | | |")  # fmt: skip
            continue
        n, opened, first, verified, joined, longest, median = run_warm(size, item, block,
                                                                       args.dir)  # fmt: skip
        print(f"| {format_bytes(size)} | {n} | {opened:.3f} | {first:.3f} | {verified:.3f} | "
              f"{n * item / 2**30 / verified:.2f} | {joined:.3f} | {longest * 1e3:.1f} | "
              f"{median * 1e3:.2f} |", flush=True)  # fmt: skip
    return 0


def populate_threads(size: int) -> int:
    from ..engine.arena.populate import PARALLEL_POPULATE_BYTES

    return 1 if size < PARALLEL_POPULATE_BYTES else min(8, os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="1GiB,4GiB,16GiB", help="comma-separated arena sizes")
    parser.add_argument("--dir", default="/dev/shm", help="arena directory")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of both modes per size")
    parser.add_argument("--warm", action="store_true",
                        help="time a persistent arena's warm restart instead")  # fmt: skip
    parser.add_argument("--item-bytes", default="256KiB", help="--warm: item size")
    parser.add_argument("--block-bytes", default="64KiB", help="--warm: block size")
    args = parser.parse_args(argv)
    if args.warm:
        return warm_main(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    item = torch.randn(args.rows, args.hidden, device=device).to(torch.bfloat16)
    sizes = [parse_bytes(s.strip(), name="--sizes") for s in args.sizes.split(",") if s.strip()]
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, device "
          f"{device}, arena dir {args.dir}; item {args.rows} x {args.hidden} bf16 = "
          f"{format_bytes(item.nbytes)}")  # fmt: skip
    print()
    print(f"Fastest of {max(1, args.repeat)} run(s) per mode (orders alternated); seconds "
          "after the create call.")  # fmt: skip
    print()
    print("| arena | populate | threads | create returns s | first save s | fully ready s | "
          "GiB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    run_once(16 << 20, "eager", args.dir, item)  # warm-up: first-call costs, not start-up
    ratios = []
    for size in sizes:
        room = available_bytes(args.dir)
        if size > room:
            print(f"| {format_bytes(size)} | skipped: {format_bytes(max(room, 0))} available "
                  f"(free space / MemAvailable less 1 GiB) | | | | | |")  # fmt: skip
            continue
        runs: dict[str, list[tuple[float, ...]]] = {"eager": [], "background": []}
        for round_ in range(max(1, args.repeat)):
            modes = ("eager", "background") if round_ % 2 == 0 else ("background", "eager")
            for mode in modes:
                runs[mode].append(run_once(size, mode, args.dir, item))
        ready = {}
        for mode, times in runs.items():
            created, first, ready[mode] = min(times, key=lambda t: t[2])
            print(f"| {format_bytes(size)} | {mode} | {populate_threads(size)} | {created:.3f} | "
                  f"{first:.3f} | {ready[mode]:.3f} | {size / 2**30 / ready[mode]:.2f} |",
                  flush=True)  # fmt: skip
        ratios.append((size, ready["background"] / ready["eager"]))
    if ratios:
        print()
        print("| arena | background full readiness / eager |")
        print("|---|---|")
        for size, ratio in ratios:
            print(f"| {format_bytes(size)} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
