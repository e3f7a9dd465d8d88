"""Host cost of a step's copy: what the CPU spends before the device does anything.

    python -m ecoffload.profiling.bench_host [--repeat 200] [--json FILE]

Real-path rows first (:mod:`..testing.real_path_steps`): ``OffloadCache.save``/``load``
steps, in-process and on the shared catalog, with the tables the catalog hands
out; the planning of those same tables beside the frozen anchor; and the
connector's scheduler hooks per step for 16 hits and 16 saves on the shared
catalog (vLLM's factory, a real ``VllmConfig``; skipped without vLLM).
``--json`` writes them for a "before" column measured on another checkout
with the same command.

Kernel-level rows next (the planner alone, tables built as lists of tuples):

Side by side in one run, calls interleaved, on the same tensors and block
tables: the host path before issue 10 (:mod:`.anchor_host_path`, frozen) and
today's (:mod:`ecoffload.kernels`, with its C pass when it is built, else its
Python passes; ``ECOFFLOAD_NATIVE_PLAN=0`` measures those): item layout,
validation, planning (segment and program rows) and, for loads, the output
tensors; everything up to the device calls. Steps: 16 items of one extent
each (a typical 64 KiB-block step), and fragmented steps of 2,000 and 19,200
single-block extents (token-row blocks).

With CUDA it first prints the host time of ``OffloadCache.save``/``load`` calls
(16 items of 1 MiB, tables from the catalog, launch included, copy not) and the
stall test, ``save`` + ``load`` issued behind ~50 ms of queued matmuls, which
must return in microseconds (first: ``gpu_check.sh`` gives the whole command
40 s). The real-path rows after it run on the CPU (``OffloadCache(device="cpu")``).

The last line is a one-line summary of the ratios (old / new).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch

from ..engine import cache as cache_module
from ..engine.cache import OffloadCache
from ..kernels import PACK_CONFIG, UNPACK_CONFIG, empty_items, native, planner
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
    assert base is not None, "a step has items"
    return before.plan_copy(offsets, nbytes, tables, block_bytes=block,
                            arena_bytes=arena.numel(), items_bytes=span,
                            items_base=base.data_ptr(), arena_base=arena.data_ptr())  # fmt: skip


def new_save(sources, tables, arena, block):
    return planner.plan_items(sources, tables, arena, block, PACK_CONFIG)


def old_load(specs, tables, arena, block):
    outputs = before.empty_items(specs, "cpu")
    return old_save(outputs, tables, arena, block)


def new_load(specs, tables, arena, block):
    outputs = empty_items(specs, "cpu")
    return planner.plan_items(outputs, tables, arena, block, UNPACK_CONFIG)


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
            calls: list[Callable[[], object]] = [
                partial(fn, first, tables, arena, block) for fn in (old, new)
            ]
            t_old, t_new = timed_side_by_side(calls, n)
            rows.append(dict(step=name, direction=direction, extents=items * extents,
                             before_us=t_old * 1e6, now_us=t_new * 1e6,
                             ratio=t_old / t_new))  # fmt: skip
    return rows


REAL_CASES = [  # (name, items, extents per item, block bytes)
    ("16 items x 1 extent (64 KiB blocks)", 16, 1, 64 << 10),
    ("16 items x 125 extents = 2,000 (8 KiB blocks)", 16, 125, 8 << 10),
]


def real_path_rows(repeat: int, directory: str) -> list[dict]:
    """OffloadCache.save (+ flush) and load per step, both catalogs, copies included (on a
    CPU host: the reference copy, torch slice copies); and the planning of the step the
    catalog made, beside the anchor planning the same tables."""
    from ..testing.real_path_steps import CacheSteps

    rows = []
    for name, items, extents, block in REAL_CASES:
        for shared in (False, True):
            steps = CacheSteps(directory, shared=shared, items=items, extents_per_item=extents,
                               block_bytes=block)  # fmt: skip
            try:
                steps.check()
                n = max(5, repeat // (1 + extents // 25))
                catalog = "shared" if shared else "in-process"
                count = steps.extents()
                (t_save,) = timed_side_by_side([steps.save_then_forget], n)
                steps.save()
                (t_load,) = timed_side_by_side([steps.load], n)
                rows.append(dict(group="OffloadCache (full call, copy included)", step=name,
                                 catalog=catalog, direction="save + flush", extents=count,
                                 now_us=t_save * 1e6))  # fmt: skip
                rows.append(dict(group="OffloadCache (full call, copy included)", step=name,
                                 catalog=catalog, direction="load", extents=count,
                                 now_us=t_load * 1e6))  # fmt: skip
                rows += planning_rows(steps, name, catalog, count, n)
                steps.forget()
            finally:
                steps.close()
    return rows


# Planning rows take at least this many interleaved pairs: a 2,000-extent step had 5
# (--repeat 60), and its ratio to the anchor ranged 8.7x-21.9x over five runs of a
# quiet machine; 25 pairs of a ~5 ms anchor cost well under a second a row.
PLANNING_SAMPLES = 25


def planning_rows(steps, name: str, catalog: str, count: int, n: int) -> list[dict]:
    """The mover's planning (item layout, validation, segment and program rows) of the
    tables the catalog hands out for the step, interleaved with the anchor's."""
    cache, keys = steps.cache, steps.keys
    sources = list(steps.sources.values())
    specs = [(t.dtype, tuple(t.shape)) for t in sources]
    arena, block = cache.arena.host, cache.arena.block_bytes
    entries = [cache.catalog.entry(k) for k in keys]
    anchor_tables = [list(e.extents) for e in entries]
    # What OffloadCache hands its mover for these entries (timed with the plan); a
    # checkout without engine.cache.step_tables hands the entries' extent lists.
    tables_of = getattr(cache_module, "step_tables", lambda es, **_: [e.extents for e in es])
    rows = []
    for direction, old, new, first, fresh in (
        ("save", old_save, new_save, sources, True),  # a save plans fresh reservations
        ("load", old_load, new_load, specs, False),
    ):
        calls = [partial(old, first, anchor_tables, arena, block),
                 lambda new=new, first=first, fresh=fresh: new(
                     first, tables_of(entries, fresh=fresh), arena, block)]  # fmt: skip
        t_old, t_new = timed_side_by_side(calls, max(n, PLANNING_SAMPLES))
        rows.append(dict(group="planning the catalog's tables", step=name, catalog=catalog,
                         direction=direction, extents=count, before_us=t_old * 1e6,
                         now_us=t_new * 1e6, ratio=t_old / t_new))  # fmt: skip
    return rows


def scheduler_rows(repeat: int, directory: str, before: str | None = None) -> list[dict]:
    """The connector's scheduler hooks per step (16 hits; 16 saves) on the shared catalog;
    with ``before`` (another checkout), its connector too, calls interleaved."""
    try:
        from ..testing.real_path_steps import SchedulerSteps, mount_checkout

        made = [SchedulerSteps(os.path.join(directory, "now"))]
        if before is not None:
            module = f"{mount_checkout(before)}.connector"
            made.insert(0, SchedulerSteps(os.path.join(directory, "before"),
                                          connector_module=module))  # fmt: skip
    except ImportError as e:  # no vLLM here
        print(f"(scheduler rows skipped: {e})")
        return []
    try:
        t_hits = timed_side_by_side([steps.hits for steps in made], repeat)
        samples: list[list[float]] = [[] for _ in made]
        for _ in range(repeat):
            for steps, mine in zip(made, samples, strict=True):
                request = steps.fresh_request()
                start = time.perf_counter()
                _, meta = steps.saves(request)
                mine.append(time.perf_counter() - start)
                steps.settle_saves(meta)
        t_saves = [statistics.median(mine) for mine in samples]
    finally:
        for steps in made:
            steps.close()
    group = "connector scheduler hooks per step (shared catalog)"
    rows = []
    for step, times in (("16 hits: lookup+pin, alloc, meta, load report", t_hits),
                        ("16 saves: lookup, reserve, meta", t_saves)):  # fmt: skip
        row = dict(
            group=group,
            step=step,
            catalog="shared",
            extents=16,
            direction="load" if "hits" in step else "save",
            now_us=times[-1] * 1e6,
        )
        if before is not None:
            row.update(before_us=times[0] * 1e6, ratio=times[0] / times[-1])
        rows.append(row)
    return rows


def worker_rows(repeat: int, directory: str, before: str | None = None) -> list[dict]:
    """The connector's worker hooks per step through vLLM's V1 runner code (16 saves; 16
    loads; copies included: on a CPU host the reference copy); with ``before`` (another
    checkout), its connector too, steps interleaved."""
    try:
        from ..testing.real_path_steps import SchedulerSteps, WorkerSteps, mount_checkout

        modules = ["ecoffload.connector"]
        if before is not None:
            modules.insert(0, f"{mount_checkout(before)}.connector")
        made = []
        for i, module in enumerate(modules):
            sched = SchedulerSteps(os.path.join(directory, f"worker-{i}"),
                                   connector_module=module)  # fmt: skip
            made.append(WorkerSteps(sched))
    except ImportError as e:  # no vLLM here
        print(f"(worker rows skipped: {e})")
        return []
    rows = []
    try:
        for steps in made:  # the bytes come back as saved (a wrong copy is no benchmark)
            steps.deliver(steps.run(steps.save_step()))
            steps.deliver(steps.run(steps.load_step()))
            for key, tensor in steps.outputs.items():
                if not torch.equal(steps.encoder_cache[key], tensor):
                    raise AssertionError(f"{key}: the worker loaded other bytes than it saved")
        for direction, prepare in (("save", "save_step"), ("load", "load_step")):
            samples: list[list[float]] = [[] for _ in made]
            for _ in range(max(5, repeat // 4)):
                for steps, mine in zip(made, samples, strict=True):
                    step = getattr(steps, prepare)()
                    start = time.perf_counter()
                    output = steps.run(step)
                    mine.append(time.perf_counter() - start)
                    steps.deliver(output)
            times = [statistics.median(mine) for mine in samples]
            row = dict(group="connector worker hooks per step (vLLM's V1 runner code)",
                       step=f"16 {direction}s of 196 x 768 bf16, copies included",
                       catalog="shared", direction=direction, extents=16,
                       now_us=times[-1] * 1e6)  # fmt: skip
            if before is not None:
                row.update(before_us=times[0] * 1e6, ratio=times[0] / times[-1])
            rows.append(row)
    finally:
        for steps in made:
            steps.close()
            steps.s.close()
    return rows


LAUNCH_ITEMS, LAUNCH_ROWS = 16, 128  # 16 items of 128 x 4096 bf16: 1 MiB each


def launch_rows(repeat: int, directory: str, device: str = "cuda") -> list[dict]:
    """Host time per ``OffloadCache.save`` and ``load`` call (the launch, not the copy),
    16 items of 1 MiB with the tables the catalog hands out; then the stall test:
    a save and a load issued behind ~50 ms of queued matmuls (CUDA), which must return
    in microseconds. Checks the bytes first. On ``"cpu"`` the calls include the copy
    (the CPU copies synchronously): that is how the suite runs this code."""
    cuda = device != "cpu"
    g = torch.Generator(device=device).manual_seed(0)

    def fresh(tag: str) -> dict[str, torch.Tensor]:
        return {f"{tag}-{i}": torch.randn(LAUNCH_ROWS, HIDDEN, generator=g, device=device)
                .to(torch.bfloat16) for i in range(LAUNCH_ITEMS)}  # fmt: skip

    items = fresh("item")
    item_bytes = LAUNCH_ROWS * HIDDEN * 2
    cache = OffloadCache.create(
        f"ecoffload-bench-launch-{os.getpid()}", arena_bytes=3 * LAUNCH_ITEMS * item_bytes,
        block_bytes=64 << 10, directory=directory, device=device,
        register_cuda="always" if cuda else "never",
    )  # fmt: skip
    try:
        cache.save(items)
        cache.flush()
        loaded = cache.load(list(items))
        cache.flush()
        if sorted(loaded) != sorted(items) or not all(
            torch.equal(loaded[k], t) for k, t in items.items()
        ):
            raise AssertionError("the loaded bytes differ from the saved ones")

        def forget(keys) -> None:
            cache.flush()
            for key in keys:
                cache.catalog.evict(key)

        save_s, load_s = [], []
        for _ in range(repeat):
            forget(items)  # untimed: the next save reserves and launches anew
            start = time.perf_counter()
            cache.save(items)
            save_s.append(time.perf_counter() - start)
            cache.flush()  # untimed: the copy, then the commit
            start = time.perf_counter()
            cache.load(list(items))
            load_s.append(time.perf_counter() - start)
            cache.flush()  # untimed: the copy, then the unpins
        more = fresh("behind")
        if cuda:
            torch.cuda.synchronize()
            a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            for _ in range(6):  # ~50 ms of queued compute
                a = a @ a / 8192
        start = time.perf_counter()
        cache.save(more)
        cache.load(list(items))
        behind = time.perf_counter() - start
        cache.flush()
    finally:
        cache.close()
    step = f"{LAUNCH_ITEMS} items x 1 MiB, {device}"
    return [
        dict(step=step, direction="OffloadCache.save call", now_us=statistics.median(save_s) * 1e6),
        dict(step=step, direction="OffloadCache.load call", now_us=statistics.median(load_s) * 1e6),
        dict(step="behind ~50 ms of queued matmuls" if cuda else "save + load, back to back",
             direction="save + load", now_us=behind * 1e6),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", help="also write the real-path rows to this file")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads (default 1: on a busy 2-vCPU host its "
        "pool's spin-waits made a 300 KB host copy_ 10-30x slower)",
    )
    parser.add_argument("--real-only", action="store_true", help="only the real-path rows")
    parser.add_argument(
        "--before",
        metavar="CHECKOUT",
        help="an older checkout of the repository: its connector's scheduler "
        "hooks timed interleaved with this one's (the 'before' column)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    c_pass = native.planner()
    where = f"C pass ({c_pass.__file__})" if c_pass else "Python passes (no C pass: see the log)"
    print(f"torch {torch.__version__} ({args.torch_threads} intra-op threads), host cost per "
          f"call, median of up to {args.repeat} calls (interleaved); planning and item layout "
          f"now: {where}\n")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ecoffload-bench-host-", dir="/dev/shm") as tmp:
        if torch.cuda.is_available():  # first: gpu_check.sh gives the whole run 40 s
            print("| CUDA, through OffloadCache | call | host us |\n|---|---|---|")
            for r in launch_rows(args.repeat, tmp, "cuda"):
                print(f"| {r['step']} | {r['direction']} | {r['now_us']:.1f} |", flush=True)
            print()
        real = real_path_rows(args.repeat, tmp) + scheduler_rows(args.repeat, tmp, args.before)
        real += worker_rows(args.repeat, tmp, args.before)
    print("Real paths (the entry points users call; tables as the catalogs hand them out):\n")
    print(
        "The anchor: the frozen pre-issue-10 host path (planning rows), or the checkout given "
        "as --before (connector rows).\n"
    )
    print("| rows | step | catalog | direction | extents | anchor (us) | now (us) | anchor / now |")
    print("|---|---|---|---|---|---|---|---|")
    for r in real:
        anchor = f"{r['before_us']:.1f}" if "before_us" in r else ""
        ratio = f"{r['ratio']:.1f}x" if "ratio" in r else ""
        print(f"| {r['group']} | {r['step']} | {r['catalog']} | {r['direction']} | "
              f"{r['extents']:,} | {anchor} | {r['now_us']:.1f} | {ratio} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(real, f, indent=1)
    if args.real_only:
        return 0
    print("\nKernel-level rows (the planner alone, tables as lists of tuples):\n")
    print("| step | direction | extents | before issue 10 (us) | now (us) | before / now |")
    print("|---|---|---|---|---|---|")
    rows = host_rows(args.repeat)
    for r in rows:
        print(f"| {r['step']} | {r['direction']} | {r['extents']:,} | {r['before_us']:.1f} | "
              f"{r['now_us']:.1f} | {r['ratio']:.1f}x |")  # fmt: skip
    summary = ", ".join(f"{r['direction']} {r['extents']:,} ext {r['ratio']:.1f}x" for r in rows)
    print(f"\nsummary (before / now): {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
