"""Host cost of a step's copy: what the CPU spends before the device does anything.

    python -m ecoffload.profiling.bench_host [--repeat 200]

Side by side in one run, calls interleaved, on the same tensors and block
tables: the host path before issue 10 (:mod:`.anchor_host_path`, frozen) and
today's (:mod:`ecoffload.kernels`, with its C pass when it is built, else its
Python passes; ``ECOFFLOAD_NATIVE_PLAN=0`` measures those): item layout,
validation, planning (segment and program rows) and, for loads, the output
tensors; everything up to the device calls. Steps: 16 items of one extent
each (a typical 64 KiB-block step), and fragmented steps of 2,000 and 19,200
single-block extents (token-row blocks).

With CUDA it adds the full calls through a real :class:`BlockMover`: host time
per ``save``/``load`` (launch included) and the stall test, ``save`` + ``load``
issued behind ~50 ms of queued matmuls, which must return in microseconds.

The last line is a one-line summary of the ratios (old / new).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from ..kernels import PACK_CONFIG, UNPACK_CONFIG, empty_items, native
from ..kernels import api as kernels_api
from . import anchor_host_path as before

HIDDEN = 4096  # bf16 encoder rows of 8 KiB


def step(items: int, extents_per_item: int, block_bytes: int, seed: int = 0):
    """(sources, tables, arena): ``items`` bf16 items, each ``extents_per_item`` shuffled
    single-block extents (or one extent when 1), last block partly used."""
    rng = random.Random(seed)
    num_blocks = items * extents_per_item
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    sources, tables = [], []
    for i in range(items):
        nbytes = extents_per_item * block_bytes - (block_bytes // 2 if i % 2 else 0)
        sources.append(torch.empty(nbytes // 2, dtype=torch.bfloat16))
        mine, blocks = blocks[:extents_per_item], blocks[extents_per_item:]
        tables.append([(b, 1) for b in mine])
    arena = torch.empty(num_blocks * block_bytes, dtype=torch.uint8)
    return sources, tables, arena


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of one call (garbage collection off while timing)."""
    return timed_side_by_side([fn], repeat)[0]


def timed_side_by_side(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of one call of each, calls interleaved (a, b, a, b, ...) so that a
    busy or throttled machine slows all of them alike; garbage collection off."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    gc.disable()
    try:
        for _ in range(repeat):
            for fn, mine in zip(fns, samples, strict=True):
                start = time.perf_counter()
                fn()
                mine.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return [statistics.median(mine) for mine in samples]


def old_save(sources, tables, arena, block):
    base, offsets, nbytes, span = before._item_layout(list(sources))
    return before.plan_copy(offsets, nbytes, tables, block_bytes=block,
                            arena_bytes=arena.numel(), items_bytes=span,
                            items_base=base.data_ptr(), arena_base=arena.data_ptr())  # fmt: skip


def new_save(sources, tables, arena, block):
    return kernels_api._plan(sources, tables, arena, block, PACK_CONFIG)


def old_load(specs, tables, arena, block):
    outputs = before.empty_items(specs, "cpu")
    return old_save(outputs, tables, arena, block)


def new_load(specs, tables, arena, block):
    outputs = empty_items(specs, "cpu")
    return kernels_api._plan(outputs, tables, arena, block, UNPACK_CONFIG)


def host_rows(repeat: int) -> list[dict]:
    cases = [
        ("16 items x 1 extent (64 KiB blocks)", 16, 1, 64 << 10),
        ("16 items x 125 extents = 2,000 (8 KiB blocks)", 16, 125, 8 << 10),
        ("16 items x 1,200 extents = 19,200 (8 KiB blocks)", 16, 1200, 8 << 10),
    ]
    rows = []
    for name, items, extents, block in cases:
        sources, tables, arena = step(items, extents, block)
        specs = [(t.dtype, tuple(t.shape)) for t in sources]
        n = max(5, repeat // (1 + extents // 50))
        for direction, old, new, first in (
            ("save", old_save, new_save, sources),
            ("load", old_load, new_load, specs),
        ):
            calls = [partial(fn, first, tables, arena, block) for fn in (old, new)]
            t_old, t_new = timed_side_by_side(calls, n)
            rows.append(dict(step=name, direction=direction, extents=items * extents,
                             before_us=t_old * 1e6, now_us=t_new * 1e6,
                             ratio=t_old / t_new))  # fmt: skip
    return rows


def cuda_rows(repeat: int) -> list[dict]:
    """Full save/load host time through a real mover, and the stall test (CUDA only)."""
    from ..engine.arena import Arena
    from ..engine.transfer import BlockMover

    rows = []
    with Arena.create("ecoffload-bench-host", block_bytes=64 << 10, num_blocks=256,
                      processes=1, register_cuda="always") as arena:  # fmt: skip
        mover = BlockMover(arena, "cuda")
        src = [torch.randn(512, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(16)]
        tables = [[(i * 16, 16)] for i in range(16)]
        specs = [(t.dtype, tuple(t.shape)) for t in src]
        t_save = timed(lambda: mover.save(src, tables), repeat)
        t_load = timed(lambda: mover.load(tables, specs), repeat)
        torch.cuda.synchronize()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(6):  # ~50 ms of queued compute
            a = a @ a / 8192
        start = time.perf_counter()
        mover.save(src, tables)
        mover.load(tables, specs)
        behind = time.perf_counter() - start
        torch.cuda.synchronize()
        rows.append(dict(step="16 items x 1 MiB, CUDA", direction="save call",
                         now_us=t_save * 1e6))  # fmt: skip
        rows.append(dict(step="16 items x 1 MiB, CUDA", direction="load call",
                         now_us=t_load * 1e6))  # fmt: skip
        rows.append(dict(step="behind ~50 ms of queued matmuls", direction="save + load",
                         now_us=behind * 1e6))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    c_pass = native.planner()
    where = f"C pass ({c_pass.__file__})" if c_pass else "Python passes (no C pass: see the log)"
    print(f"torch {torch.__version__}, host cost per call, median of up to {args.repeat} calls "
          f"(interleaved); planning and item layout now: {where}\n")  # fmt: skip
    print("| step | direction | extents | before issue 10 (us) | now (us) | before / now |")
    print("|---|---|---|---|---|---|")
    rows = host_rows(args.repeat)
    for r in rows:
        print(f"| {r['step']} | {r['direction']} | {r['extents']:,} | {r['before_us']:.1f} | "
              f"{r['now_us']:.1f} | {r['ratio']:.1f}x |")  # fmt: skip
    if torch.cuda.is_available():
        print("\n| CUDA | call | host us |\n|---|---|---|")
        for r in cuda_rows(args.repeat):
            print(f"| {r['step']} | {r['direction']} | {r['now_us']:.1f} |")
    summary = ", ".join(f"{r['direction']} {r['extents']:,} ext {r['ratio']:.1f}x" for r in rows)
    print(f"\nsummary (before / now): {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
