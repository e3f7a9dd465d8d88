"""Side-by-side transfer benchmark: ecoffload against the anchors, same process, same data.

    python -m ecoffload.profiling.bench [--out DIR] [--quick]

One step is 16 encoder outputs of 256-2048 rows (19,041 rows) x hidden 4096 bf16,
156 MB, moved between GPU tensors and the arena. Rows of the table:

* limit: one pinned contiguous copy of 512 MB each way (the PCIe ceiling).
* seed-style: save = one ``copy_`` per token-row block; load = CPU
  advanced-index gather, then a pageable ``.to(cuda)``.
* batched copy engine: one ``cuMemcpyBatchAsync`` per step (vLLM's current
  CPU offload), token-row (8 KiB) blocks and 64 KiB blocks.
* DMA per item: one ``copy_`` per item into a contiguous arena slice.
* ecoffload: one Triton launch per step (``BlockMover``), contiguous and
  shuffled tables, 64 KiB and token-row blocks; sources as separate tensors
  (staged) and as views of one step buffer.
* one item of 256 rows: call to completion, Python included.
* CPU time to launch a 16-item step.
* interference: three concurrent 8192^3 bf16 matmuls, slowdown vs alone.
* program-count sweep of the kernel (what the defaults rest on).

Without CUDA the same table runs at small sizes through the CPU paths and is
labelled CPU: those figures say nothing about PCIe. Writes ``bench.json``
and ``bench.png`` (if matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..engine.arena.arena import Arena
from ..engine.base.sizes import format_bytes
from ..engine.transfer import BlockMover
from ..kernels import PACK_CONFIG, UNPACK_CONFIG, LaunchConfig, plan_batch
from ..kernels.block_copy import launch_block_copy
from ..kernels.step_table import StepTable

STEP_ROWS = [
    256,
    2048,
    1024,
    512,
    1536,
    768,
    2048,
    1280,
    640,
    1792,
    896,
    1152,
    2048,
    1024,
    1201,
    816,
]
HIDDEN, DTYPE = 4096, torch.bfloat16
TOKEN_BLOCK = HIDDEN * 2  # one token row of bf16: the seed's block
BIG_BLOCK = 64 << 10


@dataclass
class Row:
    group: str
    name: str
    direction: str  # save (GPU -> arena), load (arena -> GPU), or "-"
    nbytes: int
    ms: float | None = None
    gbps: float | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None


class Bench:
    def __init__(self, device: torch.device, quick: bool, arena_dir: str | None) -> None:
        self.device, self.quick = device, quick
        self.cuda = device.type == "cuda"
        self.rows: list[Row] = []
        scale = 1 if self.cuda else 16
        self.hidden = HIDDEN if self.cuda else HIDDEN // 8
        self.row_bytes = self.hidden * 2
        self.step_rows = [max(1, r // scale) for r in STEP_ROWS]
        self.step_bytes = sum(self.step_rows) * self.row_bytes
        self.limit_bytes = (512 << 20) if self.cuda else (32 << 20)
        arena_bytes = max(self.limit_bytes, 2 * self.step_bytes) + (64 << 20)
        # Arena in 8 KiB units: a 64 KiB block is 8 consecutive units, so every
        # table layout below runs on the same arena.
        self.unit = 8192
        self.arena = _make_arena(arena_bytes // self.unit, self.unit, arena_dir)
        self.mover = BlockMover(self.arena, device)
        self.host = self.arena.host_tensor()
        gen = torch.Generator().manual_seed(0)
        self.items = [
            torch.randn(r, self.hidden, generator=gen).to(DTYPE).to(device) for r in self.step_rows
        ]
        self.item_bytes = [t.numel() * 2 for t in self.items]
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.reps = 3 if quick else 7

    # timing ------------------------------------------------------------------

    def close(self) -> None:
        self.items = []
        del self.mover, self.host  # no view of the arena outlives it
        self.arena.close()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object], reps: int | None = None, warmup: int = 1) -> float:
        """Median wall time in ms from call to completion (synchronized)."""
        for _ in range(warmup):
            fn()
            self.sync()
        times = []
        for _ in range(reps or self.reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def add(self, group, name, direction, nbytes, fn=None, *, make=None, reps=None, check=None,
            **extra) -> Row:  # fmt: skip
        """Time ``fn`` (or the callable ``make()`` builds, built inside the guard) into a row."""
        row = Row(group, name, direction, nbytes, extra=extra)
        try:
            if make is not None:
                fn = make()
            assert fn is not None, "add() times fn, or what make() builds"
            row.ms = self.timed(fn, reps)
            row.gbps = nbytes / row.ms / 1e6
            if check is not None:
                check()
        except Exception as exc:  # one broken anchor must not hide the others
            row.error = f"{type(exc).__name__}: {exc}"[:300]
        self.rows.append(row)
        status = row.error or f"{row.ms:9.3f} ms {row.gbps:7.2f} GB/s"
        print(f"  {group:<22} {name:<46} {direction:<5} {status}", flush=True)
        return row

    # table layouts -------------------------------------------------------------

    def tables(self, block: int, shuffle: bool, seed: int = 0) -> list[list[tuple[int, int]]]:
        """Block tables in arena units: each item cut into ``block``-byte blocks.

        A table covers exactly the item's units (the planner refuses more): the
        last block of an item keeps only the units its bytes reach.
        """
        per = block // self.unit
        needs = [-(-n // block) for n in self.item_bytes]
        blocks = list(range(sum(needs)))
        if shuffle:
            random.Random(seed).shuffle(blocks)
        tables, at = [], 0
        for need, n in zip(needs, self.item_bytes, strict=True):
            mine, at = blocks[at : at + need], at + need
            table: list[tuple[int, int]] = []
            for b in mine:
                if table and table[-1][0] + table[-1][1] == b * per:
                    table[-1] = (table[-1][0], table[-1][1] + per)
                else:
                    table.append((b * per, per))
            if table:
                surplus = need * per - -(-n // self.unit)
                table[-1] = (table[-1][0], table[-1][1] - surplus)
            tables.append(table)
        return tables

    def host_rows(self, block: int) -> torch.Tensor:
        return self.host[: (self.arena.nbytes // block) * block].view(-1, block)

    # the suites -----------------------------------------------------------------

    def run(self) -> None:
        print(f"\n{'CUDA' if self.cuda else 'CPU (small sizes; says nothing about PCIe)'} "
              f"step: {len(self.items)} items, {sum(self.step_rows)} rows x {self.hidden} bf16, "
              f"{format_bytes(self.step_bytes)}; arena {self.arena}\n")  # fmt: skip
        suites = [self.limits, self.seed_style]
        if self.cuda:
            suites.append(self.batched_copy_engine)
        suites += [self.dma_per_item, self.ecoffload, self.small_item, self.integrity_cost,
                   self.launch_cpu_time]  # fmt: skip
        if self.cuda:
            suites.append(self.interference)
            if not self.quick:
                suites.append(self.program_sweep)
        for suite in suites:
            try:
                suite()
            except Exception as exc:  # one broken suite must not hide the others
                error = f"{type(exc).__name__}: {exc}"[:300]
                self.rows.append(Row(suite.__name__, "(suite failed)", "-", 0, error=error))
                print(f"  {suite.__name__:<22} suite failed: {error}", flush=True)

    def paths(self) -> dict:
        """Which copy path the ecoffload rows measured, and why."""
        return {
            "arena_registered": self.arena.registered,
            "mover_path": self.mover.path if self.mover is not None else None,
            "arena": repr(self.arena),
        }

    def limits(self) -> None:
        n = self.limit_bytes
        host = self.host[:n]
        if self.cuda:
            gpu = torch.empty(n, dtype=torch.uint8, device=self.device)
            self.add("limit", "pinned, one 512 MB copy", "save", n,
                     lambda: host.copy_(gpu, non_blocking=True))  # fmt: skip
            self.add("limit", "pinned, one 512 MB copy", "load", n,
                     lambda: gpu.copy_(host, non_blocking=True))  # fmt: skip
        else:
            other = torch.empty(n, dtype=torch.uint8)
            self.add("limit", f"memcpy, one {format_bytes(n)} copy", "save", n,
                     lambda: host.copy_(other))  # fmt: skip

    def seed_style(self) -> None:
        rows = self.host_rows(self.row_bytes)
        ids = list(range(sum(self.step_rows)))
        random.Random(1).shuffle(ids)  # a per-row free list after some churn
        per_item, at = [], 0
        for t in self.items:
            per_item.append(ids[at : at + t.shape[0]])
            at += t.shape[0]
        item_rows = [t.view(torch.uint8).view(t.shape[0], -1) for t in self.items]

        def save():
            ctx = torch.cuda.stream(self.side) if self.cuda else _null()
            with ctx:
                for src, blocks in zip(item_rows, per_item, strict=True):
                    for r, b in enumerate(blocks):
                        rows[b].copy_(src[r], non_blocking=True)

        index = torch.tensor(ids[: sum(self.step_rows)])

        def load():
            gathered = rows[index]  # CPU advanced-index gather into pageable memory
            return gathered.to(self.device)

        self.add("seed-style", "one copy_ per token-row block", "save", self.step_bytes, save,
                 reps=3)  # fmt: skip
        self.add("seed-style", "CPU gather + pageable .to(device)", "load", self.step_bytes, load,
                 reps=3)  # fmt: skip

    def batched_copy_engine(self) -> None:
        from .batched_copy import BatchedCopy

        try:
            copier = BatchedCopy(self.device)
        except Exception as exc:
            for name in ("token-row blocks", "64 KiB blocks"):
                for d in ("save", "load"):
                    self.rows.append(Row("batched copy engine", name, d, self.step_bytes,
                                         error=f"unavailable: {exc}"))  # fmt: skip
            print(f"  batched copy engine unavailable: {exc}")
            return
        base = self.host.data_ptr()
        for label, block in (("token-row blocks", self.row_bytes), ("64 KiB blocks", BIG_BLOCK)):
            if block < self.unit:
                continue
            tables = self.tables(block, shuffle=True, seed=2)
            gpu, host, sizes = block_copies([t.data_ptr() for t in self.items], self.item_bytes,
                                            tables, self.unit, block, base)  # fmt: skip
            # Descriptors (CUdeviceptr lists, attributes) built here: the timed call
            # is the driver call alone.
            batches = {"save": copier.prepare(host, gpu, sizes, to_host=True),
                       "load": copier.prepare(gpu, host, sizes, to_host=False)}  # fmt: skip
            for direction, batch in batches.items():
                cpu_ms: list[float] = []

                def call(batch=batch, cpu_ms=cpu_ms):
                    t0 = time.perf_counter()
                    copier(batch, self.side)
                    cpu_ms.append((time.perf_counter() - t0) * 1e3)

                self.add("batched copy engine", label, direction, self.step_bytes, call,
                         copies=len(sizes))  # fmt: skip
                self.rows[-1].extra["cpu_ms_of_call"] = (
                    statistics.median(cpu_ms) if cpu_ms else None
                )

    def dma_per_item(self) -> None:
        offsets = [0]
        for n in self.item_bytes[:-1]:
            offsets.append(offsets[-1] + -(-n // self.unit) * self.unit)
        flat = [t.view(-1).view(torch.uint8) for t in self.items]
        host = self.host

        def save():
            with torch.cuda.stream(self.side) if self.cuda else _null():
                for f, o in zip(flat, offsets, strict=True):
                    host[o : o + f.numel()].copy_(f, non_blocking=True)

        def load():
            with torch.cuda.stream(self.side) if self.cuda else _null():
                for f, o in zip(flat, offsets, strict=True):
                    f.copy_(host[o : o + f.numel()], non_blocking=True)

        self.add(
            "DMA per item", "one copy_ per item, contiguous slices", "save", self.step_bytes, save
        )
        self.add(
            "DMA per item", "one copy_ per item, contiguous slices", "load", self.step_bytes, load
        )

    @property
    def ecoffload_group(self) -> str:
        """Rows of the engine's own calls, labelled with the path they really took."""
        if self.mover.path == "kernel":
            return "ecoffload"
        return "ecoffload [reference path: arena not registered]"

    def ecoffload(self) -> None:
        specs = [(t.dtype, tuple(t.shape)) for t in self.items]
        layouts = [
            ("contiguous", BIG_BLOCK, False),
            ("shuffled 64 KiB blocks", BIG_BLOCK, True),
            ("shuffled token-row blocks", self.row_bytes, True),
        ]
        group = self.ecoffload_group
        for label, block, shuffle in layouts:
            if block % self.unit:
                continue
            tables = StepTable.of_pairs(self.tables(block, shuffle, seed=3))
            extents = tables.num_extents
            self.add(group, f"{label}, engine call", "save", self.step_bytes,
                     lambda tb=tables: self.mover.save(self.items, tb),
                     check=lambda tb=tables: self.check_round_trip(tb), extents=extents,
                     programs=PACK_CONFIG.num_programs, path=self.mover.path)  # fmt: skip
            self.add(group, f"{label}, engine call", "load", self.step_bytes,
                     lambda tb=tables: self.mover.load(tb, specs), extents=extents,
                     programs=UNPACK_CONFIG.num_programs, path=self.mover.path)  # fmt: skip
            if self.cuda:
                for direction, config in (("save", PACK_CONFIG), ("load", UNPACK_CONFIG)):
                    self.add("ecoffload", f"{label}, kernel only (plan prebuilt)", direction,
                             self.step_bytes, extents=extents,
                             make=lambda tb=tables, c=config, d=direction: self.kernel_only(
                                 self.items, tb, c, d == "save"))  # fmt: skip

    def kernel_only(self, sources, tables, config: LaunchConfig, to_arena: bool):
        """A launch with its plan built beforehand: the kernel's own time, on the side stream.

        Needs the kernel path (a registered arena on CUDA); raises otherwise, so
        the row records why instead of timing something else.
        """
        if self.mover.path != "kernel":
            raise RuntimeError(
                f"no kernel to time: the arena is not registered with CUDA ({self.arena}); "
                "the engine runs the reference path"
            )
        return prebuilt_launch(sources, tables, self.arena.device_view(self.device), self.unit,
                               config, to_arena=to_arena, stream=self.side)  # fmt: skip

    def check_round_trip(self, tables: StepTable) -> None:
        outputs, done = self.mover.load(tables, [(t.dtype, tuple(t.shape)) for t in self.items])
        done.wait()
        self.sync()
        for out, src in zip(outputs, self.items, strict=True):
            if not torch.equal(out.view(torch.uint8), src.view(torch.uint8)):
                raise AssertionError("round trip is not bit-exact")

    def small_item(self) -> None:
        rows = 256 if self.cuda else 16
        item = self.items[0][:rows].contiguous()
        n = item.numel() * 2
        table = StepTable.of_pairs([[(0, -(-n // self.unit))]])
        spec = [(item.dtype, tuple(item.shape))]
        path = self.mover.path
        self.add("one item", f"{rows} rows, ecoffload save ({path} path)", "save", n,
                 lambda: self.mover.save([item], table).wait(), reps=30, path=path)  # fmt: skip
        self.add("one item", f"{rows} rows, ecoffload load ({path} path)", "load", n,
                 lambda: self.mover.load(table, spec)[1].wait(), reps=30, path=path)  # fmt: skip
        host = self.host[:n]
        self.add("one item", f"{rows} rows, one copy_ (DMA)", "save", n,
                 lambda: host.copy_(item.view(-1).view(torch.uint8), non_blocking=True),
                 reps=30)  # fmt: skip

    def integrity_cost(self) -> None:
        """Save + load of the step through OffloadCache, integrity mode off and on."""
        from ..engine.cache import OffloadCache

        keys = {f"item-{i}": t for i, t in enumerate(self.items)}
        for integrity in (False, True):
            with OffloadCache.create(
                f"ecoffload-bench-integrity-{os.getpid()}",
                arena_bytes=2 * self.step_bytes + BIG_BLOCK * 32,
                directory=os.path.dirname(self.arena.path),
                device=self.device,
                integrity=integrity,
            ) as cache:

                def round_trip(cache=cache):
                    for key in keys:  # start empty each time: the save really copies
                        if cache.catalog.state(key) is not None:
                            cache.catalog.evict(key)
                    cache.save(keys)
                    cache.flush()
                    got = cache.load(list(keys))
                    cache.flush()
                    assert len(got) == len(keys)

                name = f"engine save + load, integrity {'on' if integrity else 'off'}"
                self.add("integrity", name, "both", 2 * self.step_bytes, round_trip)

    def launch_cpu_time(self) -> None:
        """Host time of one 16-item save call (plan, table upload, launch), not waited for."""
        for label, block, shuffle in (("contiguous", BIG_BLOCK, False),
                                      ("shuffled 64 KiB blocks", BIG_BLOCK, True)):  # fmt: skip
            tables = StepTable.of_pairs(self.tables(block, shuffle, seed=4))
            times = []
            for i in range(5 + (50 if self.cuda else 10)):
                self.sync()
                t0 = time.perf_counter()
                self.mover.save(self.items, tables)
                if i >= 5:
                    times.append((time.perf_counter() - t0) * 1e6)
            self.sync()
            us = statistics.median(times)
            name = f"CPU time of a 16-item save call, {label}"
            extents = sum(len(t) for t in tables)
            self.rows.append(Row("launch", name, "-", 0, ms=us / 1e3,
                                 extra={"cpu_us": us, "extents": extents}))  # fmt: skip
            print(f"  {'launch':<22} {name:<46} {'-':<5} {us:9.1f} us ({extents} extents)")

    def interference(self) -> None:
        n = 8192
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        outs = [torch.empty(n, n, device=self.device, dtype=torch.bfloat16) for _ in range(3)]

        def matmuls():
            for o in outs:
                torch.matmul(a, b, out=o)

        # 16,384 rows x 8 KiB in shuffled token-row blocks, as in the baseline.
        rows = 16384 * TOKEN_BLOCK // self.row_bytes
        src = torch.randn(rows, self.hidden, device=self.device).to(DTYPE)
        nblocks = src.numel() * 2 // self.unit
        order = list(range(nblocks))
        random.Random(5).shuffle(order)
        table = [[(b, 1) for b in order]]
        host = self.host[: src.numel() * 2]
        matmul_ms = self.timed(matmuls)
        kernel = self.kernel_only
        variants = [
            ("ecoffload save, 8 programs x 8 warps (default)",
             lambda: kernel([src], table, PACK_CONFIG, True)),
            ("ecoffload save, 16 programs x 4 warps",
             lambda: kernel([src], table, LaunchConfig(16, 4), True)),
            ("ecoffload load, 16 programs x 4 warps (default)",
             lambda: kernel([src], table, UNPACK_CONFIG, False)),
            ("ecoffload save, 132 programs (one per SM)",
             lambda: kernel([src], table, LaunchConfig(132, 8), True)),
            ("DMA, one contiguous copy_", lambda: lambda: _on(self.side, lambda: host.copy_(
                src.view(-1).view(torch.uint8), non_blocking=True))),
        ]  # fmt: skip
        for name, make in variants:
            direction = "load" if " load" in name else "save"
            row = Row("interference", name, direction, src.numel() * 2)
            try:
                save = make()
                alone = self.timed(save)
                both = self.timed(lambda save=save: (save(), matmuls()))
                row.ms, row.gbps = alone, row.nbytes / alone / 1e6
                row.extra = {"matmul_ms": matmul_ms, "both_ms": both,
                             "slowdown": both / max(alone, matmul_ms)}  # fmt: skip
                status = (f"{alone:9.3f} ms {row.gbps:7.2f} GB/s  matmuls {matmul_ms:.3f} ms, "
                          f"both {both:.3f} ms, slowdown {row.extra['slowdown']:.3f}")  # fmt: skip
            except Exception as exc:
                row.error = f"{type(exc).__name__}: {exc}"[:300]
                status = row.error
            self.rows.append(row)
            print(f"  {'interference':<22} {name:<46} {direction:<5} {status}", flush=True)

    def program_sweep(self) -> None:
        tables = self.tables(self.row_bytes, shuffle=True, seed=6)
        for programs in (4, 8, 16, 32, 132):
            for warps in (4, 8):
                config = LaunchConfig(programs, warps)
                for direction in ("save", "load"):
                    self.add("sweep", f"{programs} programs x {warps} warps", direction,
                             self.step_bytes, reps=3,
                             make=lambda c=config, d=direction: self.kernel_only(
                                 self.items, tables, c, d == "save"))  # fmt: skip


def _null():
    import contextlib

    return contextlib.nullcontext()


def _on(stream, fn):
    with torch.cuda.stream(stream):
        fn()


def prebuilt_launch(
    sources: Sequence[torch.Tensor],
    tables,
    arena: torch.Tensor,
    block_bytes: int,
    config: LaunchConfig,
    *,
    to_arena: bool,
    stream: torch.cuda.Stream | None = None,
) -> Callable[[], None]:
    """One launch whose plan (and, on CUDA, segment upload) is done now, not when called.

    Planned by :func:`ecoffload.kernels.plan_batch`, exactly as the engine plans:
    the same access width for the same tensors.
    """
    base, plan = plan_batch(sources, tables, arena, block_bytes, config=config)
    if base is None:
        return lambda: None
    plan = plan._replace(table=plan.table.to(arena.device))

    def launch() -> None:
        with torch.cuda.stream(stream) if stream is not None else _null():
            launch_block_copy(base, arena, plan, to_arena=to_arena, num_warps=config.num_warps,
                              items_bytes=plan.items_bytes)  # fmt: skip

    return launch


def block_copies(
    item_ptrs: Sequence[int],
    item_bytes: Sequence[int],
    tables: Sequence[Sequence[tuple[int, int]]],
    unit: int,
    block: int,
    arena_base: int,
) -> tuple[list[int], list[int], list[int]]:
    """(GPU addresses, arena addresses, sizes): one copy per ``block``-byte block of each
    item, as a per-block copy engine does; tables count ``unit``-byte arena units."""
    gpu, host, sizes = [], [], []
    for ptr, n, table in zip(item_ptrs, item_bytes, tables, strict=True):
        pos = 0
        for start, count in table:
            for k in range(-(-count * unit // block)):
                size = min(block, count * unit - k * block, n - pos)
                if size <= 0:
                    break
                gpu.append(ptr + pos)
                host.append(arena_base + start * unit + k * block)
                sizes.append(size)
                pos += size
        if pos != n:
            raise ValueError(f"block table covers {pos} of the item's {n} bytes")
    return gpu, host, sizes


def _make_arena(num_blocks: int, block: int, arena_dir: str | None) -> Arena:
    name = f"ecoffload-bench-{os.getpid()}"
    dirs = [arena_dir] if arena_dir else ["/dev/shm", tempfile.gettempdir()]
    last: Exception | None = None
    for d in dirs:
        try:
            return Arena.create(name, block_bytes=block, num_blocks=num_blocks, directory=d,
                                processes=1)  # fmt: skip
        except Exception as exc:  # e.g. a small /dev/shm in a container
            print(f"arena in {d} failed ({exc}); trying the next directory")
            last = exc
    raise SystemExit(f"could not create the benchmark arena: {last}")


def summarize(rows: list[Row], cuda: bool) -> str:
    """The results table with ratios to the limit and to the seed-style path."""
    limit = {r.direction: r.gbps for r in rows if r.group == "limit" and r.gbps}
    if "save" in limit:
        limit.setdefault("load", limit["save"])
    seed = {r.direction: r.gbps for r in rows if r.group == "seed-style" and r.gbps}
    head = "CUDA" if cuda else "CPU figures (small sizes; not PCIe)"
    lines = [f"## {head}", "",
             "| group | variant | dir | MB | ms | GB/s | x limit | x seed | notes |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r.error:
            lines.append(f"| {r.group} | {r.name} | {r.direction} | | | | | | {r.error} |")
            continue
        if r.group == "launch":
            lines.append(f"| {r.group} | {r.name} | - | | | | | | {r.extra['cpu_us']:.1f} us |")
            continue
        lim, sd = limit.get(r.direction), seed.get(r.direction)
        notes = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.extra.items()
        )
        lines.append(
            f"| {r.group} | {r.name} | {r.direction} | {r.nbytes / 1e6:.1f} | {r.ms:.3f} | "
            f"{r.gbps:.2f} | {r.gbps / lim:.2f} | {r.gbps / sd:.1f} | {notes} |"
            if lim and sd and r.gbps is not None  # (a row without an error has its figures)
            else f"| {r.group} | {r.name} | {r.direction} | {r.nbytes / 1e6:.1f} | {r.ms:.3f} | "
            f"{r.gbps:.2f} | | | {notes} |"
        )
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
        "interpreter": os.environ.get("TRITON_INTERPRET", "0"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            import cupy  # pyright: ignore[reportMissingImports]  (extras cuda12 / cuda13)

            env["cupy"] = cupy.__version__
            env["driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception:
            pass
    return env


def plot(rows: list[Row], path: str, cuda: bool) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [r for r in rows if r.gbps and r.group not in ("launch", "sweep")]
    widths = [r.gbps or 0.0 for r in shown]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(shown) + 1.5))
    labels = [f"{r.group}: {r.name} [{r.direction}]" for r in shown]
    colors = ["tab:green" if r.group == "ecoffload" else "tab:gray" for r in shown]
    ax.barh(range(len(shown)), widths, color=colors)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    where = "CUDA" if cuda else "CPU figures, small sizes: not PCIe"
    ax.set_title(f"ecoffload transfer benchmark, same process and data ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", default="bench-out", help="folder for bench.json / bench.png / bench.md"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no program sweep")
    parser.add_argument(
        "--arena-dir", default=None, help="arena directory (default /dev/shm, else tmp)"
    )
    parser.add_argument(
        "--device", default=None, help="cuda[:N] or cpu (default: cuda if available)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    os.makedirs(args.out, exist_ok=True)
    bench, rows, paths, error = None, [], {}, None
    try:
        bench = Bench(device, args.quick, args.arena_dir)
        paths = bench.paths()
        print(f"arena registered with CUDA: {paths['arena_registered']}; "
              f"ecoffload rows take the {paths['mover_path']} path")  # fmt: skip
        bench.run()
    except BaseException as exc:  # recorded in bench.json, then re-raised
        error = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        if bench is not None:
            rows = bench.rows
            try:
                bench.close()
            except Exception as exc:
                error = error or f"close failed: {type(exc).__name__}: {exc}"
        write_results(args.out, device, rows, paths, error)
    return 0


def write_results(out: str, device: torch.device, rows: list[Row], paths: dict,
                  error: str | None) -> None:  # fmt: skip
    """bench.json (always), bench.md and bench.png (when matplotlib is installed)."""
    cuda = device.type == "cuda"
    try:
        env = environment(device)
    except Exception as exc:
        env = {"device": str(device), "environment_error": f"{type(exc).__name__}: {exc}"}
    env.update(paths)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"environment": env, "error": error, "rows": [asdict(r) for r in rows]}, f,
                  indent=1)  # fmt: skip
    table = summarize(rows, cuda)
    print("\n" + table)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(f"{json.dumps(env)}\n\n{table}\n")
    if plot(rows, os.path.join(out, "bench.png"), cuda):
        print(f"\nwrote {out}/bench.json, bench.md, bench.png")
    else:
        print(f"\nwrote {out}/bench.json, bench.md")


if __name__ == "__main__":
    # `timeout` sends SIGTERM: unwind through main's finally, so bench.json is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
