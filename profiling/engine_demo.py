"""Engine demo: an encoder-cache workload through OffloadCache alone (no vLLM).

    python -m ecoffload.profiling.engine_demo [--items 96] [--arena-bytes 32MiB] [--device cpu]

Simulates a multimodal server: each "request" brings 2-4 images whose encoder
outputs (``rows x hidden`` bf16) are saved to the arena; the arena holds only
part of them, so old ones are evicted. Then the first images come back: those
still in the arena are loaded (one launch per step) instead of being
recomputed, and each is checked bit for bit against what was saved.

Runs anywhere: on CUDA through the registered arena and the Triton kernels;
on a CPU-only host through the CPU path (the reference copies, or the Triton
interpreter when ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from ..engine.base.sizes import format_bytes
from ..engine.cache import OffloadCache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--items", type=int, default=96, help="distinct images")
    parser.add_argument("--rows", type=int, default=256, help="encoder rows per image")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--arena-bytes", default="32MiB")
    parser.add_argument("--block-bytes", default="64KiB")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arena_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    gen = torch.Generator().manual_seed(0)
    images = {
        f"image-{i:03d}": torch.randn(args.rows, args.hidden, generator=gen).to(torch.bfloat16)
        for i in range(args.items)
    }
    images = {k: v.to(device) for k, v in images.items()}
    item_bytes = args.rows * args.hidden * 2

    with OffloadCache.create(
        f"ecoffload-demo-{os.getpid()}",
        arena_bytes=args.arena_bytes,
        block_bytes=args.block_bytes,
        layout_key={"demo": 1, "hidden": args.hidden, "dtype": "bfloat16"},
        directory=arena_dir,
        device=device,
    ) as cache:
        print(f"arena: {format_bytes(cache.arena.nbytes)} in {arena_dir} "
              f"({cache.arena.num_blocks} blocks of {format_bytes(cache.arena.block_bytes)}), "
              f"device {cache.device}, copy path: {cache.mover.path}")  # fmt: skip
        print(f"workload: {args.items} images of {args.rows} x {args.hidden} bf16 "
              f"({format_bytes(item_bytes)} each, {format_bytes(item_bytes * args.items)} "
              "in all)\n")  # fmt: skip
        keys = list(images)
        steps = [keys[i : i + 3] for i in range(0, len(keys), 3)]
        t0 = time.perf_counter()
        for step in steps:
            cache.save({k: images[k] for k in step})
        cache.flush()
        save_s = time.perf_counter() - t0

        served = wrong = 0
        t0 = time.perf_counter()
        for step in steps:
            got = cache.load(step)
            cache.flush()
            for key, tensor in got.items():
                served += 1
                wrong += not torch.equal(tensor, images[key])
        load_s = time.perf_counter() - t0
        stats = cache.stats()

    recomputed = args.items - served
    rows = [
        ("images requested twice", args.items),
        ("saved to the arena", stats.items_stored),
        ("evicted under pressure", stats.evictions),
        ("served from the arena on 2nd request", served),
        ("to recompute (evicted)", recomputed),
        ("hit rate", f"{served / args.items:.0%}"),
        ("bit-exact loads", f"{served - wrong}/{served}"),
        ("bytes saved", format_bytes(stats.bytes_stored)),
        ("bytes loaded", format_bytes(served * item_bytes)),
        ("save time per step", f"{save_s / len(steps) * 1e3:.2f} ms"),
        ("load time per step", f"{load_s / len(steps) * 1e3:.2f} ms"),
    ]
    width = max(len(r[0]) for r in rows)
    print("| what | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    if wrong:
        print(f"\nERROR: {wrong} loaded items differ from what was saved")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
