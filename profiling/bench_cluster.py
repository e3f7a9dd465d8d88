"""The cluster tier's costs: the MAC per MiB, and a fetch straight into arena extents
beside a get into bytes followed by a copy.

    python -m ecoffload.profiling.bench_cluster [--repeat 20] [--scheduler-steps 400]

A ``mooncake_master`` on 127.0.0.1 (HTTP metadata server on), two store clients
in this process over ``tcp``: one holds the values (its segment), the other
fetches (no segment). Requests: 16 items x 245 KiB (an image's encoder output)
and 1 item x 8 MiB (a video), each item scattered over single 64 KiB blocks of
an arena (and the 16 items once more with each item one extent). Paths, same
values, same extents:

* ``into extents``: one ``batch_get_into_multi_buffers`` scattering each value's
  header into a small buffer and its bytes into the item's blocks (what
  :class:`~ecoffload.engine.cluster.tier.ClusterTier` does);
* ``get + copy``: ``get_batch`` (bytes objects), then a copy of each into its blocks;
* ``tier fetch``: the tier's whole fetch with a cluster key (reserve, get,
  header, MAC, CRC-32, commit), polled every 1 ms (a scheduler polls once a step).

The scheduler's cost per step with the tier on and 16 local hits beside the
tier off (:class:`~.real_path_steps.SchedulerSteps`: vLLM's factory, a real
``VllmConfig``; the step is ``ensure_cache_available`` of a new request for the
same 16 items, admitted afresh as each of vLLM's requests is, then the hooks of
16 hits and the workers' load report), the two connectors' steps interleaved.

A held request's fetch (one 245 KiB item, the tier's whole fetch) while the
polling thread spins as vLLM's engine does while a request is held (a loop of
``poll`` and ~a step of Python), beside the same loop that first waits on the
fetch at most :data:`~ecoffload.connector.cluster_tier.HOLD_YIELD_S` (what the
connector's step does), alternating.

The MAC (HMAC-SHA256, :mod:`~ecoffload.engine.cluster.value`) and, beside it,
keyed BLAKE2b-256 and CRC-32 are timed over 8 MiB in this process. Every fetched
item is checked bit-exact.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
import zlib

import numpy as np

from ..engine.cache import OffloadCache
from ..engine.cluster import value
from ..engine.cluster.master import MasterProcess
from ..engine.cluster.store import StoreClient, StoreSettings, load_store_class
from ..engine.cluster.tier import ClusterTier, _pieces

BLOCK = 64 << 10
# (item sizes, scattered over single blocks or each item one extent)
REQUESTS = {
    "16 x 245 KiB": ([245 << 10] * 16, True),
    "16 x 245 KiB, contiguous": ([245 << 10] * 16, False),
    "1 x 8 MiB": ([8 << 20], True),
}


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def mac_costs(repeat: int) -> dict[str, float]:
    """ms per MiB of each digest over an 8 MiB buffer."""
    data = os.urandom(8 << 20)
    key = os.urandom(32)
    mib = len(data) / (1 << 20)
    return {
        "HMAC-SHA256 (the MAC)": _median_ms(lambda: hmac.digest(key, data, "sha256"), repeat) / mib,
        "keyed BLAKE2b-256": _median_ms(
            lambda: hashlib.blake2b(data, key=key, digest_size=32).digest(), repeat
        )
        / mib,
        "CRC-32 (zlib)": _median_ms(lambda: zlib.crc32(data), repeat) / mib,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--scheduler-steps", type=int, default=400)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print("MAC and checksums, ms per MiB (median of", args.repeat, "over 8 MiB):")
    for name, ms in mac_costs(args.repeat).items():
        print(f"  {name:30s} {ms:7.3f} ms/MiB  {1 / ms:6.2f} GiB/s")

    store_cls = load_store_class()
    tmp = tempfile.mkdtemp(prefix="ecoffload-bench-cluster-")
    master = MasterProcess(log_path=os.path.join(tmp, "master.log")).start()
    holder = store_cls()
    assert holder.setup("127.0.0.1", master.metadata, 256 << 20, 16 << 20, "tcp", "",
                        master.address) == 0  # fmt: skip
    cache = OffloadCache.create(f"bench-cluster-{os.getpid()}", arena_bytes="64MiB",
                                block_bytes=BLOCK, directory="/dev/shm", device="cpu",
                                register_cuda="never", shared=True)  # fmt: skip
    client = StoreClient(StoreSettings(master.address, master.metadata, segment_bytes=0))
    assert client.wait_connected(30)
    key = value.load_key(value.random_key_file(os.path.join(tmp, "cluster.key")))
    tier = ClusterTier(cache.arena, cache.catalog, client, namespace="bench", publish=False,
                       fetch_timeout_s=30, key=key)  # fmt: skip
    try:
        run(args.repeat, holder, client, tier, cache, key)
        hold_cost(3 * args.repeat, holder, tier, cache, key)
        if args.scheduler_steps:
            scheduler_cost(args.scheduler_steps, master, tmp)
    finally:
        tier.close()
        cache.close()
        holder.close()
        master.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def scheduler_cost(steps: int, master: MasterProcess, tmp: str) -> None:
    """us per step of 16 local hits, tier off and on, interleaved."""
    from ..testing.real_path_steps import SchedulerSteps

    cluster = {"master": master.address, "metadata": master.metadata, "host": "127.0.0.1",
               "segment_bytes": "16MiB"}  # fmt: skip
    off = SchedulerSteps(os.path.join(tmp, "off"))
    on = SchedulerSteps(os.path.join(tmp, "on"), extra={"cluster": cluster})
    assert on.sched.side.cluster.tier.client.wait_connected(30)
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for i in range(steps):
            for name, s in (("off", off), ("on", on)) if i % 2 else (("on", on), ("off", off)):
                request = s.new_hit_request()  # each step a new request: admitted afresh
                t = time.perf_counter()
                assert s.sched.ensure_cache_available(request, 0)
                s.hits(request)
                times[name].append(time.perf_counter() - t)
                s.sched.request_finished(request)
        lookups = on.sched.side.stats()["cluster_lookups"]
    finally:
        on.close()
        off.close()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"\nscheduler per step, 16 local hits, median of {steps} (us):")
    print(f"  tier off {med['off']:7.1f}   tier on {med['on']:7.1f}   on / off "
          f"{med['on'] / med['off']:.3f}   store lookups {lookups}")  # fmt: skip


def run(repeat: int, holder, client: StoreClient, tier: ClusterTier, cache, key: bytes) -> None:
    rng = np.random.default_rng(5)
    base, data = tier._base, cache.arena.host.numpy()
    free = list(range(cache.arena.num_blocks))
    random.Random(0).shuffle(free)
    print(f"\nfetch over tcp on 127.0.0.1, ms (median of {repeat}), GB/s of item bytes:")
    print(f"  {'request':26s} {'into extents':>14s} {'get + copy':>14s} {'tier fetch':>14s}")

    def one(label: str, sizes: list[int], scattered: bool) -> None:
        keys = [f"r{len(sizes)}-{int(scattered)}-{i}" for i in range(len(sizes))]
        payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        names = [tier.store_key(k) for k in keys]
        for name, p in zip(names, payloads, strict=True):
            header = value.pack_header(p.nbytes, "uint8", (p.nbytes,))
            value.seal(header, key, name, [p])
            assert holder.remove(name, True) in (0, -704)
            assert holder.put(name, bytes(header) + p.tobytes()) == 0
        extents, taken = [], 0
        for n in sizes:
            count = -(-n // BLOCK)
            if scattered:
                extents.append([(b, 1) for b in free[taken : taken + count]])
            else:
                extents.append([(taken, count)])
            taken += count
        headers = np.zeros((len(keys), value.HEADER_BYTES), np.uint8)
        ptrs = [
            [int(headers[i].ctypes.data)] + [a for a, _ in _pieces(base, ext, BLOCK, n)]
            for i, (ext, n) in enumerate(zip(extents, sizes, strict=True))
        ]
        lens = [
            [value.HEADER_BYTES] + [m for _, m in _pieces(base, ext, BLOCK, n)]
            for ext, n in zip(extents, sizes, strict=True)
        ]
        store = client._store

        def check():
            for ext, n, p in zip(extents, sizes, payloads, strict=True):
                got = np.concatenate(
                    [data[a - base : a - base + m] for a, m in _pieces(base, ext, BLOCK, n)]
                )
                assert np.array_equal(got, p), "fetched bytes differ"
            data[:] = 0

        def into_extents():
            got = store.batch_get_into_multi_buffers(names, ptrs, lens)
            assert got == [sum(x) for x in lens], got

        def get_and_copy():
            blobs = store.get_batch(names)
            for blob, ext, n in zip(blobs, extents, sizes, strict=True):
                src = np.frombuffer(blob, np.uint8)[value.HEADER_BYTES :]
                at = 0
                for a, m in _pieces(base, ext, BLOCK, n):
                    data[a - base : a - base + m] = src[at : at + m]
                    at += m

        def tier_fetch():
            f = tier.fetch(dict(zip(keys, sizes, strict=True)))
            while tier.poll(f) == "pending":
                time.sleep(0.001)
            assert f.fetched == set(keys), f
            for k in keys:
                cache.catalog.evict(k)

        total = sum(sizes)
        row = []
        for fn in (into_extents, get_and_copy):
            ms = _median_ms(fn, repeat)
            check()
            row.append(ms)
        row.append(_median_ms(tier_fetch, repeat))
        cells = "".join(f" {ms:7.2f} {total / ms / 1e6:5.2f}" for ms in row)
        print(f"  {label:26s}{cells}")

    for label, (sizes, scattered) in REQUESTS.items():
        one(label, sizes, scattered)


def hold_cost(repeat: int, holder, tier: ClusterTier, cache, key: bytes) -> None:
    import concurrent.futures as cf

    from ..connector.cluster_tier import HOLD_YIELD_S

    item = np.random.default_rng(7).integers(0, 256, 245 << 10, dtype=np.uint8)
    name = tier.store_key("held")
    header = value.pack_header(item.nbytes, "uint8", (item.nbytes,))
    value.seal(header, key, name, [item])
    assert holder.remove(name, True) in (0, -704)
    assert holder.put(name, bytes(header) + item.tobytes()) == 0

    def step_work() -> int:  # ~a scheduler step of Python
        return sum(range(3000))

    def once(wait: bool) -> tuple[float, int]:
        t0, steps = time.perf_counter(), 0
        f = tier.fetch({"held": item.nbytes})
        while True:
            if wait and f.future is not None:
                cf.wait([f.future], timeout=HOLD_YIELD_S)
            if tier.poll(f) != "pending":
                break
            step_work()
            steps += 1
        seconds = time.perf_counter() - t0
        assert f.fetched == {"held"}, f
        cache.catalog.evict("held")
        return seconds, steps

    got: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for i in range(repeat):
        for wait in (False, True) if i % 2 else (True, False):
            got[wait].append(once(wait))
    print(f"\na held request's fetch of 1 x 245 KiB, ms (median / 90th pct / max of {repeat}):")
    for wait, label in ((False, "poller spins"), (True, f"waits <= {HOLD_YIELD_S * 1e3:g} ms")):
        ms = sorted(s * 1e3 for s, _ in got[wait])
        steps = statistics.median(n for _, n in got[wait])
        print(f"  {label:18s} {statistics.median(ms):7.2f} {ms[int(0.9 * len(ms))]:7.2f} "
              f"{ms[-1]:7.2f}   steps polled {steps:g}")  # fmt: skip


if __name__ == "__main__":
    main()
