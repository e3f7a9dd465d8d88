"""Two versions of the shared catalog in one process, operations interleaved: the
comparison a loaded machine still allows.

    python -m ecoffload.profiling.bench_catalog_ab BASE [--resident 50000] [--rounds 15]

``BASE`` is a folder holding another checkout's package as ``BASE/ecoffload/``
(e.g. ``git archive REV engine kernels connector profiling | tar -x -C
BASE/ecoffload``); it is imported as ``ecoffload_base`` beside this checkout's
``ecoffload``. Each catalog gets its own file with ``--resident`` one-block
items (a full arena); every round runs each operation on both, the order
swapped every round, and the table gives process CPU time per operation
(median of the rounds) and the new / base ratio per round: median [min, max].
Separate runs of one version differ by more than the changes this measures.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import random
import statistics
import sys
import tempfile
import time

from ..engine.catalog.shared import catalog as shared_catalog

BLOCK = 4096


def _import_base(base: str):
    """``BASE/ecoffload`` as the package ``ecoffload_base``; its shared_catalog module."""
    alias = tempfile.mkdtemp(prefix="ecoffload-ab-")
    os.symlink(os.path.join(os.path.abspath(base), "ecoffload"),
               os.path.join(alias, "ecoffload_base"))  # fmt: skip
    sys.path.insert(0, alias)
    try:  # where it lives since issue 28's move, or before it
        return importlib.import_module("ecoffload_base.engine.catalog.shared.catalog")
    except ModuleNotFoundError:
        return importlib.import_module("ecoffload_base.engine.shared_catalog")


def _filled(module, keys: list[str], resident: int, directory: str | None):
    f = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - closed by compare
    size = module.meta_bytes(resident, BLOCK, max_items=resident, max_key_bytes=128)
    os.ftruncate(f.fileno(), size)
    catalog = module.SharedCatalog(f.fileno(), 0, size, num_blocks=resident, block_bytes=BLOCK,
                                   max_items=resident, max_key_bytes=128)  # fmt: skip
    for key in keys[:resident]:
        catalog.reserve(key, BLOCK)
        catalog.commit(key)
    return f, catalog


def compare(base_module, resident: int, rounds: int) -> list[tuple[str, float, float, list[float]]]:
    """(operation, base us/op, new us/op, new/base ratio of each round)."""
    sample = max(16, min(10_000, resident // 5))
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(resident + 6 * sample)]
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    files, catalogs = zip(*(_filled(m, keys, resident, directory)
                            for m in (base_module, shared_catalog)), strict=True)  # fmt: skip
    hits = random.Random(0).sample(keys[:resident], sample)
    fresh = [iter(keys[resident:]), iter(keys[resident:])]

    def ops(i: int, c) -> dict:
        def reserve_commit(_):
            key = next(fresh[i])
            c.reserve(key, BLOCK)
            c.commit(key)

        return {
            "lookup (hit)": (c.lookup, hits),
            "lookup (miss)": (c.lookup, keys[-sample:]),
            "pin + unpin": (lambda k: (c.pin(k), c.unpin(k)), hits),
            "lookup(pin=True) + unpin": (lambda k: (c.lookup(k, pin=True), c.unpin(k)), hits),
            "reserve + commit (evicts)": (reserve_commit, hits[: sample // 10]),
            "pin_many + unpin_many, 16 keys": (
                lambda b: (c.pin_many(b), c.unpin_many(b)),
                [hits[j : j + 16] for j in range(0, min(1600, sample - 15), 16)],
            ),
        }

    table = [ops(0, catalogs[0]), ops(1, catalogs[1])]
    times: dict[str, tuple[list[float], list[float]]] = {op: ([], []) for op in table[0]}
    for r in range(rounds):
        for op in times:
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                fn, items = table[i][op]
                t0 = time.process_time()
                for item in items:
                    fn(item)
                times[op][i].append((time.process_time() - t0) * 1e6 / len(items))
    for c, f in zip(catalogs, files, strict=True):
        c.check()
        c.close()
        f.close()
    return [
        (op, statistics.median(b), statistics.median(n), [y / x for x, y in zip(b, n, strict=True)])
        for op, (b, n) in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("base", help="a folder holding the other checkout as ecoffload/")
    parser.add_argument("--resident", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    rows = compare(_import_base(args.base), args.resident, args.rounds)
    print(f"{args.resident} one-block items resident in each catalog, {args.rounds} rounds, "
          "process CPU time\n")  # fmt: skip
    print("| operation | base us/op | new us/op | new / base per round: median [min, max] |")
    print("|---|---|---|---|")
    for op, b, n, ratios in rows:
        print(f"| {op} | {b:.2f} | {n:.2f} | {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}] |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
