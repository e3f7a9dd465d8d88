"""Cross-arena pulls through NIXL beside a same-host arena copy and a plain memcpy.

    python -m ecoffload.profiling.bench_remote [--repeat 10]

A producer process (:mod:`..testing.remote_producer`) serves a 128 MiB arena of 64 KiB
blocks filled with seeded bytes (copied once into its export window, which is
what NIXL reads); this process pulls items into its own arena
with :meth:`ArenaPeer.read` (one READ per request, polled to completion, the
notification included) over 127.0.0.1, once with UCX's default transports
(CMA between processes of one host) and once with ``UCX_TLS=tcp`` (what a
host without RDMA NICs would use between hosts). Anchors, same bytes, same
extents, same process: a torch copy of every piece between two arenas, and
one memcpy of the request's total bytes. Every path's result is checked
bit-exact against the producer's bytes. The producer's own per-request cost,
also measured here on the same requests: copying the items from the arena into
an export window when it announces them, and zeroing the slots when the lease
ends (:class:`~ecoffload.engine.remote.export_window.ExportWindow` ``put`` + ``release``).

Requests: 16 items x 1 MiB (each one extent on both sides; and the same with
the consumer's blocks scattered, 256 single-block extents) and 1 item x 64 MiB.
The last line is a one-line summary (GB/s).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..engine.arena.arena import Arena
from ..engine.remote.export_window import ExportWindow
from ..engine.remote.extent_pieces import pieces as _pieces
from ..engine.remote.nixl_setup import load_nixl
from ..engine.remote.peer import ArenaPeer
from ..engine.remote.records import Pull
from ..testing.remote_producer import fill_arena

BLOCK = 64 << 10
BLOCKS = 2048  # 128 MiB per arena
SEED = 11


def requests() -> dict[str, list[Pull]]:
    per = (1 << 20) // BLOCK
    scattered = list(range(16 * per))
    random.Random(0).shuffle(scattered)
    return {
        "16 x 1 MiB": [Pull([(i * per, per)], [(i * per, per)], 1 << 20) for i in range(16)],
        "16 x 1 MiB, scattered": [
            Pull([(i * per, per)], [(b, 1) for b in scattered[i * per : (i + 1) * per]], 1 << 20)
            for i in range(16)
        ],
        "1 x 64 MiB": [Pull([(0, 1024)], [(0, 1024)], 64 << 20)],
    }


def expected(src: torch.Tensor, nbytes: int, pulls: list[Pull]) -> torch.Tensor:
    out = torch.zeros(nbytes, dtype=torch.uint8)
    for p in pulls:
        for ro, lo, n in _pieces(p.remote, BLOCK, p.local, BLOCK, p.nbytes):
            out[lo : lo + n] = src[ro : ro + n]
    return out


def median_s(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@contextlib.contextmanager
def producer(directory: str, env: dict[str, str]):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecoffload.testing.remote_producer", directory, "bench-src",
         str(BLOCK), str(BLOCKS), str(SEED)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None, "started with pipes"
    try:
        for line in proc.stdout:
            if line.startswith("META "):
                yield base64.b64decode(line[5:])
                break
        else:
            raise RuntimeError(f"the producer exited ({proc.wait()}) before serving")
    finally:
        proc.stdin.close()
        proc.stdout.read()
        proc.wait(timeout=60)


def nixl_rows(label, env, dst, src_ref, reqs, repeat, directory) -> tuple[list[dict], float]:
    """The rows of NIXL reads into ``dst`` and the seconds its connect took."""
    saved = {k: os.environ.get(k) for k in env}
    host = dst.host_tensor()
    os.environ.update(env)  # UCX reads its configuration when the agent's backend starts
    try:
        with (
            producer(directory, env) as card,
            ArenaPeer(dst, f"bench-dst-{label}", host="127.0.0.1") as me,
        ):
            t0 = time.perf_counter()
            name = me.connect(card)
            connect_s = time.perf_counter() - t0
            rows = []
            for case, pulls in reqs.items():

                def pull(pulls=pulls, case=case):
                    h = me.read(name, pulls, notify=b"bench")
                    if me.wait(h, timeout_s=60) != "done":
                        raise RuntimeError(f"{label} {case}: {h.error}")
                    return h

                host.zero_()
                s = median_s(pull, repeat)
                ok = torch.equal(host, expected(src_ref, dst.nbytes, pulls))
                rows.append(row(case, f"NIXL READ, {label}", pull().descriptors, pulls, s, ok))
            return rows, connect_s
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def row(case, path, descriptors, pulls, s, ok) -> dict:
    nbytes = sum(p.nbytes for p in pulls)
    return {
        "case": case, "path": path, "descriptors": descriptors, "bytes": nbytes,
        "ms": s * 1e3, "items_s": len(pulls) / s, "gbs": nbytes / s / 1e9, "ok": ok,
    }  # fmt: skip


def anchor_rows(src: torch.Tensor, dst: Arena, reqs, repeat) -> list[dict]:
    host = dst.host_tensor()
    rows = []
    for case, pulls in reqs.items():
        pieces = [pc for p in pulls for pc in _pieces(p.remote, BLOCK, p.local, BLOCK, p.nbytes)]

        def arena_copy(pieces=pieces):
            for ro, lo, n in pieces:
                host[lo : lo + n].copy_(src[ro : ro + n])

        host.zero_()
        s = median_s(arena_copy, repeat)
        ok = torch.equal(host, expected(src, dst.nbytes, pulls))
        rows.append(row(case, "torch copy, arena to arena", len(pieces), pulls, s, ok))
        total = sum(p.nbytes for p in pulls)
        s = median_s(lambda n=total: ctypes.memmove(host.data_ptr(), src.data_ptr(), n),
                     repeat)  # fmt: skip
        rows.append(row(case, "memcpy of the same bytes", 1, pulls, s, True))
    return rows


def window_rows(src: torch.Tensor, reqs, repeat) -> list[dict]:
    """The producer's announce-side cost: arena -> export window, then zero the slots."""
    window = ExportWindow(BLOCKS * BLOCK, BLOCK)
    arena = src.numpy()
    rows = []
    try:
        for case, pulls in reqs.items():

            def put(p):
                slot = window.put(arena, p.remote, BLOCK, p.nbytes)
                assert slot is not None, "the window holds one step's items"
                return slot

            def announce_and_end(pulls=pulls):
                slots = [put(p) for p in pulls]
                for slot in slots:
                    window.release(slot)

            s = median_s(announce_and_end, repeat)
            slots = [put(p) for p in pulls]
            ok = all(
                torch.equal(torch.from_numpy(window.data[sl[0][0] * BLOCK :][: p.nbytes]),
                            src[p.remote[0][0] * BLOCK :][: p.nbytes])
                for p, sl in zip(pulls, slots, strict=True)
            )  # fmt: skip
            for slot in slots:
                window.release(slot)
            rows.append(row(case, "producer: copy into window + zero at lease end", len(pulls),
                            pulls, s, ok and not window.data.any()))  # fmt: skip
    finally:
        window.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    nixl = load_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent
    reqs = requests()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        src = Arena.create("bench-local-src", block_bytes=BLOCK, num_blocks=BLOCKS, directory=d,
                           register_cuda="never")  # fmt: skip
        dst = Arena.create("bench-dst", block_bytes=BLOCK, num_blocks=BLOCKS, directory=d,
                           register_cuda="never")  # fmt: skip
        with src, dst:
            src_host = src.host_tensor()
            fill_arena(src_host, SEED)  # the producer's bytes, for the anchors and the checks
            rows, connects = [], {}
            for label, env in (("UCX default (CMA)", {}), ("UCX_TLS=tcp", {"UCX_TLS": "tcp"})):
                r, connects[label] = nixl_rows(label, env, dst, src_host, reqs, args.repeat, d)
                rows += r
            rows += anchor_rows(src_host, dst, reqs, args.repeat)
            rows += window_rows(src_host, reqs, args.repeat)
    version = getattr(nixl, "__name__", "nixl").split(".")[0]
    print(f"torch {torch.__version__}, {version}, {os.cpu_count()} CPUs; median of "
          f"{args.repeat} requests; producer in another process over 127.0.0.1\n")  # fmt: skip
    print("| request | path | descriptors | bytes | ms | items/s | GB/s | bit-exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['path']} | {r['descriptors']} | {r['bytes']:,} | "
              f"{r['ms']:.2f} | {r['items_s']:,.0f} | {r['gbs']:.2f} | {r['ok']} |")  # fmt: skip
    print("\nconnect (metadata from the params, local): "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in connects.items()))  # fmt: skip
    gbs = {(r["case"], r["path"]): r["gbs"] for r in rows}
    parts = []
    for case in reqs:
        cma = gbs[(case, "NIXL READ, UCX default (CMA)")]
        tcp = gbs[(case, "NIXL READ, UCX_TLS=tcp")]
        cp = gbs[(case, "torch copy, arena to arena")]
        mc = gbs[(case, "memcpy of the same bytes")]
        win = gbs[(case, "producer: copy into window + zero at lease end")]
        parts.append(f"{case}: NIXL {cma:.2f} (CMA) / {tcp:.2f} (tcp), copy {cp:.2f}, "
                     f"memcpy {mc:.2f}, window {win:.2f}")  # fmt: skip
    print("\nsummary GB/s: " + "; ".join(parts)
          + ("" if all(r["ok"] for r in rows) else "; NOT BIT-EXACT"))  # fmt: skip
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
