"""Arena start-up: time from ``create`` to the first successful save, and to full
readiness, with the populate done eagerly (before ``create`` returns) or in the
background, side by side at each arena size.

    python -m ecoffload.profiling.bench_startup [--sizes 1GiB,4GiB,16GiB] [--dir /dev/shm]

Each run creates a fresh arena (``OffloadCache.create``), then saves one item
(1024 rows x 4096 bf16 = 8 MiB by default) until the save succeeds, then waits
until every block is ready (populated and, with CUDA, registered), and closes.
Sizes that do not fit the arena directory or the available memory (with 1 GiB
to spare) are skipped and said so. One arena at a time; each size runs
``--repeat`` rounds of both modes, the order flipped every round (the first
run of a size may pay for the kernel reclaiming page cache), and the table
shows the fastest run of each mode.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ..engine.base.sizes import format_bytes, parse_bytes
from ..engine.cache import OffloadCache

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


def run_once(size: int, mode: str, directory: str, item: torch.Tensor) -> tuple[float, ...]:
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


def populate_threads(size: int) -> int:
    from ..engine.arena.populate import PARALLEL_POPULATE_BYTES

    return 1 if size < PARALLEL_POPULATE_BYTES else min(8, os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GiB,4GiB,16GiB", help="comma-separated arena sizes")
    parser.add_argument("--dir", default="/dev/shm", help="arena directory")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of both modes per size")
    args = parser.parse_args(argv)
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
