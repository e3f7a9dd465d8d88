"""engine/cluster/: the cluster tier against a real ``mooncake_master`` on 127.0.0.1.

Two shared arenas (each an OffloadCache with its catalog in the arena file)
stand for two hosts; each has its own Mooncake client. Items are written by the
engine (``OffloadCache.save``), published by one tier, found, fetched into the
other arena's reserved blocks and loaded back through the engine, bit for bit.
Faults: a stranger's bytes under a real key, the master absent at start, the
master SIGKILLed mid-run and restarted, a key removed between lookup and fetch,
a stranger writing into this client's memory. Skipped where Mooncake cannot be
loaded (``pip install ecoffload[cluster]``; ``apt-get install libibverbs1``).
"""

import logging
import signal
import subprocess
import sys
import time

import pytest
import torch

from ecoffload.engine.cache import OffloadCache
from ecoffload.engine.cluster import value
from ecoffload.engine.cluster.master import MasterProcess
from ecoffload.engine.cluster.store import StoreClient, StoreSettings, store_missing
from ecoffload.engine.cluster.tier import ClusterTier, Expected

pytestmark = pytest.mark.skipif(bool(store_missing()), reason=str(store_missing()))

NS = "layout-abc123"


def items(seed: int) -> dict[str, torch.Tensor]:
    """An image (bf16 2-D), video frames (fp16 3-D), audio (fp32 1-D, odd size), bytes."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"img-{seed}": torch.randn(97, 64, generator=g).to(torch.bfloat16),
        f"video-{seed}": torch.randn(3, 31, 40, generator=g).to(torch.float16),
        f"audio-{seed}": torch.randn(1001, generator=g),
        f"raw-{seed}": torch.randint(0, 256, (4096 * 2 + 1,), generator=g, dtype=torch.uint8),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture
def master(tmp_path):
    m = MasterProcess(log_path=str(tmp_path / "master.log")).start()
    yield m
    m.kill()


@pytest.fixture
def host(arena_dir):
    """``host(name, master, key=None, ...)``: an OffloadCache and its tier; closed after."""
    made = []

    def build(name, master, *, key=None, connect_s=30.0, **tier_kw):
        cache = OffloadCache.create(name, arena_bytes="4MiB", block_bytes="4KiB",
                                    directory=arena_dir, device="cpu", register_cuda="never",
                                    shared=True)  # fmt: skip
        client = StoreClient(StoreSettings(master.address, master.metadata, segment_bytes=32 << 20,
                                           retry_s=0.3))  # fmt: skip
        tier = ClusterTier(cache.arena, cache.catalog, client, namespace=NS, key=key,
                           fetch_timeout_s=5.0, **tier_kw)  # fmt: skip
        made.append((cache, tier))
        if connect_s:
            assert client.wait_connected(connect_s), "the client did not connect to the master"
        return cache, tier

    yield build
    for cache, tier in reversed(made):
        tier.close(timeout_s=15)
        for e in cache.catalog.entries():
            assert e.pins == 0 and e.state.name == "READY", f"left behind: {e}"
        cache.close()


def save(cache, tensors):
    result = cache.save(tensors)
    cache.flush()
    assert sorted(result.saved) == sorted(tensors)


def published(tier, n, timeout_s=20.0):
    """Step the tier until ``n`` publishes (or skips) are counted and nothing is pinned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tier.step()
        c = tier.counts
        done = c["cluster_publishes"] + c["cluster_publish_skipped"] + c["cluster_publish_failures"]
        if done >= n and tier.idle():
            tier.step()
            return
        time.sleep(0.01)
    raise AssertionError(f"publishing did not finish: {dict(tier.counts)}")


def fetched(tier, sizes, timeout_s=20.0, expected=None):
    f = tier.fetch(sizes, expected)
    deadline = time.monotonic() + timeout_s
    while tier.poll(f) == "pending":
        assert time.monotonic() < deadline, "a fetch stayed pending past its bound"
        time.sleep(0.005)
    tier.step()
    return f


def saved_and_published(cache, tier, seed):
    """``items(seed)`` saved in ``cache`` and published by ``tier`` (all of them)."""
    tensors = items(seed)
    save(cache, tensors)
    tier.publish(tensors)
    published(tier, len(tensors))
    return tensors


def gate_gets(tier, monkeypatch):
    """Hold every get of ``tier``'s fetch lane until the returned event is set."""
    import threading

    gate, original = threading.Event(), tier._get_and_check
    monkeypatch.setattr(tier, "_get_and_check", lambda *args: gate.wait(10) and original(*args))
    return gate


def test_items_saved_on_one_host_load_bit_exactly_on_another(master, host, tmp_path):
    key = value.load_key(value.random_key_file(str(tmp_path / "cluster.key")))
    (a, ta), (b, tb) = host("host-a", master, key=key), host("host-b", master, key=key)
    tensors = items(1)
    save(a, tensors)
    ta.publish(tensors)
    published(ta, len(tensors))
    assert ta.counts["cluster_publishes"] == len(tensors)

    sizes = tb.lookup([*tensors, "never-saved"])
    assert sizes == {k: t.nbytes for k, t in tensors.items()}
    assert tb.counts["cluster_lookups"] == 1 and tb.counts["cluster_misses"] == 1
    f = fetched(tb, sizes)
    assert f.state == "done" and f.fetched == set(tensors) and not f.failed
    loaded = b.load(list(tensors))
    for k, t in tensors.items():
        assert same_bits(loaded[k], t), k
        entry = b.catalog.entry(k)
        assert (entry.dtype, tuple(entry.shape)) == (str(t.dtype).removeprefix("torch."), t.shape)
    assert tb.counts["cluster_bytes_fetched"] == sum(t.nbytes for t in tensors.values())
    assert tb.counts["cluster_mac_failures"] == 0

    ta.publish(tensors)  # at most once: present keys are skipped
    published(ta, 2 * len(tensors))
    assert ta.counts["cluster_publish_skipped"] == len(tensors)
    assert ta.counts["cluster_publishes"] == len(tensors)


def test_other_layouts_never_meet(master, host):
    (a, ta), (_, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 2)
    tb.namespace = "layout-other"
    assert tb.lookup(list(tensors)) == {}


def stranger(master):
    """A raw Mooncake client of the same cluster that is not ecoffload (it hosts no
    values: none are lost when it closes)."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.address) == 0
    return s


def test_a_stranger_s_bytes_under_a_real_key_are_never_served(master, host, tmp_path):
    key = value.load_key(value.random_key_file(str(tmp_path / "cluster.key")))
    (a, ta), (b, tb) = host("host-a", master, key=key), host("host-b", master, key=key)
    tensors = items(3)
    forged = {"img-3": torch.zeros(97, 64, dtype=torch.bfloat16)}
    # A header that parses, the right size, no MAC; and a real value copied under
    # another real key (its MAC names the key it was made for).
    header = value.pack_header(forged["img-3"].nbytes, "bfloat16", (97, 64))
    evil = stranger(master)
    try:
        raw = bytes(header) + forged["img-3"].view(torch.uint8).numpy().tobytes()
        assert evil.put(tb.store_key("img-3"), raw) == 0
        save(a, {k: v for k, v in tensors.items() if k != "img-3"})
        ta.publish(["video-3"])
        published(ta, 1)
        copied = evil.get(ta.store_key("video-3"))
        assert evil.put(tb.store_key("audio-3"), copied) == 0
    finally:
        evil.close()
    free = b.catalog.stats().free_blocks
    sizes = tb.lookup(["img-3", "audio-3", "video-3"])
    assert set(sizes) == {"img-3", "audio-3", "video-3"}
    f = fetched(tb, sizes)
    assert f.fetched == {"video-3"} and f.failed == {"img-3", "audio-3"}
    assert tb.counts["cluster_mac_failures"] == 2
    assert "img-3" not in b.catalog and "audio-3" not in b.catalog
    assert b.catalog.stats().free_blocks == free - b.catalog.entry("video-3").blocks
    assert same_bits(b.load(["video-3"])["video-3"], tensors["video-3"])


def test_master_absent_at_start_serves_nothing_warns_once_and_connects_later(
    host, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="ecoffload.cluster")
    m = MasterProcess(log_path=str(tmp_path / "master.log"))  # ports chosen, not started
    (a, ta) = host("host-a", m, connect_s=0)
    tensors = items(4)
    save(a, tensors)
    time.sleep(1.0)  # several retries
    t = time.monotonic()
    assert ta.lookup(list(tensors)) == {}
    assert time.monotonic() - t < 0.1
    assert not ta.available and ta.stats()["cluster_available"] == 0
    ta.publish(tensors)
    published(ta, len(tensors))  # refused at once: counted, unpinned
    assert ta.counts["cluster_publish_failures"] == len(tensors)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert ta.client.connect_attempts >= 2
    try:
        m.start()
        assert ta.client.wait_connected(30) and ta.available
        (b, tb) = host("host-b", m)
        ta.publish(tensors)
        published(ta, 2 * len(tensors))
        assert ta.counts["cluster_publishes"] == len(tensors)
        f = fetched(tb, tb.lookup(list(tensors)))
        assert f.fetched == set(tensors)
    finally:
        m.kill()


def test_master_killed_mid_run_misses_within_bounds_then_hits_after_restart(master, host):
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 5)
    sizes = tb.lookup(list(tensors))
    assert len(sizes) == len(tensors)
    free = b.catalog.stats().free_blocks

    master.kill()
    t = time.monotonic()
    f = fetched(tb, sizes)  # looked up before the kill, fetched after it
    assert f.failed == set(tensors) and not f.fetched
    assert tb.lookup(list(tensors)) == {}
    assert time.monotonic() - t < tb.fetch_timeout_s + tb.lookup_timeout_s
    assert not tb.available
    assert b.catalog.stats().free_blocks == free and len(b.catalog) == 0

    master.start()  # same ports; its objects are gone: publish again
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ta.publish(tensors)
        published(ta, 0)
        if len(tb.lookup(list(tensors))) == len(tensors):
            break
        time.sleep(0.3)
    assert tb.available
    f = fetched(tb, tb.lookup(list(tensors)))
    assert f.fetched == set(tensors)
    loaded = b.load(list(tensors))
    assert all(same_bits(loaded[k], t) for k, t in tensors.items())


def test_a_key_removed_between_lookup_and_fetch_is_a_plain_miss(master, host):
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 6)
    sizes = tb.lookup(list(tensors))
    gone = tb.store_key("img-6")
    assert ta.client.call("fetch", lambda s: s.remove(gone, True), 5.0) == 0
    f = fetched(tb, sizes)
    assert f.failed == {"img-6"} and f.fetched == set(tensors) - {"img-6"}
    assert tb.counts["cluster_fetch_failures"] == 0 and "img-6" not in b.catalog


def test_the_arena_is_not_writable_through_the_store_s_transport(master, host, tmp_path):
    # Mooncake's TCP transport writes a peer's bytes into any buffer a client
    # registered (no authentication): the tier registers nothing, so a stranger's
    # write aimed at the arena is refused and the arena keeps its bytes.
    (b, tb) = host("host-b", master)
    tensors = items(7)
    save(b, tensors)
    before = b.load(["img-7"])["img-7"].clone()
    target = tb._base + b.catalog.entry("img-7").extents[0][0] * b.arena.block_bytes
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", master.metadata, "tcp", "") == 0
    buf = torch.full((4096,), 0xEE, dtype=torch.uint8)
    assert engine.register_memory(buf.data_ptr(), buf.nbytes) == 0
    segment = tb.client._store.get_hostname()
    assert engine.transfer_sync_write(segment, buf.data_ptr(), target, 64) != 0
    assert same_bits(b.load(["img-7"])["img-7"], before)
    engine.unregister_memory(buf.data_ptr())


def test_a_full_publish_queue_drops_and_counts(master, host):
    (a, ta) = host("host-a", master, queue_items=0)
    tensors = items(8)
    save(a, tensors)
    ta.publish(tensors)
    assert ta.counts["cluster_publish_drops"] == len(tensors)
    assert all(a.catalog.entry(k).pins == 0 for k in tensors)


PEER = """
import sys, time
from ecoffload.engine.cluster import value
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, metadata, name = sys.argv[1:4]
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master) == 0
payload = bytes(range(256)) * 1024
header = value.pack_header(len(payload), "uint8", (len(payload),))
here = ReplicateConfig()
here.preferred_segment = s.get_hostname()  # the value lives in this process only
assert s.put(name, bytes(header) + payload, here) == 0
print("ready", flush=True)
time.sleep(600)
"""


def test_a_peer_holding_the_values_killed_mid_run_gives_misses_within_the_bound(master, host):
    (b, tb) = host("host-b", master)
    name = tb.store_key("img-peer")
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, master.address, master.metadata, name],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert peer.stdout.readline().strip() == "ready"
        sizes = tb.lookup(["img-peer"])
        assert sizes == {"img-peer": 256 * 1024}
        free = b.catalog.stats().free_blocks
        peer.send_signal(signal.SIGKILL)
        peer.wait(10)
        t = time.monotonic()
        f = fetched(tb, sizes)
        assert f.failed == {"img-peer"} and not f.fetched
        assert time.monotonic() - t < tb.fetch_timeout_s + 1
        assert "img-peer" not in b.catalog and b.catalog.stats().free_blocks == free
    finally:
        peer.kill()
        peer.wait(10)


# What a stranger who puts bytes in the store can make of a fetch; leaks at close.


def test_a_fetch_still_posted_at_close_leaves_no_reservation(master, host):
    # vLLM shuts down while a request waits on a cluster fetch: close() must not
    # leave that fetch's reservations WRITING in the shared arena (other instances
    # of the host keep it; only this process's exit would reap them).
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 11)
    sizes = tb.lookup(list(tensors))
    assert len(sizes) == len(tensors)
    f = tb.fetch(sizes)  # posted, never polled: its requests were aborted
    assert f.state == "pending"
    tb.close(timeout_s=15)
    left = [(e.key, e.state.name) for e in b.catalog.entries() if e.state.name != "READY"]
    assert not left, f"reservations left after close: {left}"


def test_a_value_larger_than_its_looked_up_size_writes_nothing_outside_its_extents(master, host):
    # The size a lookup reports and the size of the value the get finds can differ
    # (a stranger replaces the value in between): the get must fail, and write no
    # byte of the arena outside the item's own bytes.
    (b, tb) = host("host-b", master)
    save(b, {"before": torch.full((4096 * 3,), 0x11, dtype=torch.uint8)})
    payload = bytes(range(256)) * 64  # 16 KiB: 4 blocks
    header = value.pack_header(len(payload), "uint8", (len(payload),))
    evil = stranger(master)
    try:
        assert evil.put(tb.store_key("swapped"), bytes(header) + payload) == 0
    finally:
        evil.close()
    arena = tb._data.copy()
    small = 4096 + 5  # what the lookup said before the swap
    f = tb.fetch({"swapped": small})
    _, extents, _ = f.reserved["swapped"]
    start = extents[0][0] * b.arena.block_bytes
    deadline = time.monotonic() + 20
    while tb.poll(f) == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    tb.step()
    assert f.failed == {"swapped"} and "swapped" not in b.catalog
    now = tb._data
    outside = (arena[:start] != now[:start]).sum() + (
        arena[start + small :] != now[start + small :]
    ).sum()
    assert outside == 0, f"{outside} arena bytes outside the item changed"
    assert same_bits(b.load(["before"])["before"], torch.full((4096 * 3,), 0x11, dtype=torch.uint8))


def test_a_forged_huge_value_does_not_empty_the_arena_before_its_mac_fails(
    master, host, tmp_path, caplog
):
    # With a cluster key, a stranger's value is never served, but its size (which
    # the store reports, unauthenticated) would decide the reservation: one value the
    # size of the arena would evict every READY item of every instance on the host
    # before its MAC is checked. The requester's expected size refuses it first.
    key = value.load_key(value.random_key_file(str(tmp_path / "cluster.key")))
    (b, tb) = host("host-b", master, key=key)
    local = items(12)
    save(b, local)
    total = b.arena.num_blocks * b.arena.block_bytes
    payload = bytes(total - 4096)
    header = value.pack_header(len(payload), "uint8", (len(payload),))
    evil = stranger(master)
    try:
        assert evil.put(tb.store_key("huge"), bytes(header) + payload) == 0
    finally:
        evil.close()
    sizes = tb.lookup(["huge"])
    assert sizes == {"huge": len(payload)}
    caplog.set_level(logging.WARNING, logger="ecoffload.cluster")
    f = fetched(tb, sizes, expected={"huge": Expected(rows=97, nbytes=97 * 64 * 2)})
    assert f.failed == {"huge"} and not f.fetched and tb.counts["cluster_fetch_failures"] == 1
    assert "huge" not in b.catalog and all(k in b.catalog for k in local)  # nothing evicted
    (said,) = [r.getMessage() for r in caplog.records if "huge" in r.getMessage()]
    assert f"holds {len(payload)} bytes, its request expects 12416 (97 rows)" in said, said
    # Without the expectation the same value evicts the arena: what the check is for.
    f = fetched(tb, sizes)
    assert f.failed == {"huge"} and tb.counts["cluster_mac_failures"] == 1
    assert [k for k in local if k not in b.catalog], "the forged size evicted nothing"


def test_a_value_with_the_right_size_and_the_wrong_rows_is_not_committed(master, host, caplog):
    # Without a key a stranger's bytes are served (README), but not as an item of
    # another shape than its request's: vLLM's step would get an item it cannot use.
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    image = {"img": torch.randn(96, 64).to(torch.bfloat16)}
    save(a, {"img": image["img"].reshape(48, 128)})  # the same bytes, other rows
    ta.publish(["img"])
    published(ta, 1)
    sizes = tb.lookup(["img"])
    caplog.set_level(logging.WARNING, logger="ecoffload.cluster")
    f = fetched(tb, sizes, expected={"img": Expected(rows=96, nbytes=96 * 64 * 2)})
    assert f.failed == {"img"} and "img" not in b.catalog
    assert any("expects 96 rows" in r.getMessage() for r in caplog.records)
    f = fetched(tb, sizes, expected={"img": Expected(rows=48)})  # rows right, size unknown
    assert f.fetched == {"img"} and tuple(b.catalog.entry("img").shape) == (48, 128)


def test_without_a_key_a_value_of_a_dtype_no_tensor_can_hold_is_not_committed(master, host):
    # Without a key a stranger's bytes are served (README), but a header naming a
    # quantized dtype must not be committed: loading it raises in the worker (vLLM's
    # step), a crash rather than a wrong answer.
    (b, tb) = host("host-b", master)
    payload = bytes(4096 + 7)
    header = value.pack_header(len(payload), "qint8", (len(payload),))
    evil = stranger(master)
    try:
        assert evil.put(tb.store_key("quantized"), bytes(header) + payload) == 0
    finally:
        evil.close()
    f = fetched(tb, tb.lookup(["quantized"]))
    assert f.failed == {"quantized"} and "quantized" not in b.catalog


def test_a_put_past_its_bound_keeps_its_items_pinned_until_it_returns(arena_dir):
    # The publisher gives up waiting on a put after fetch_timeout_s, but Mooncake's put
    # still reads the item's blocks (and its header buffer): unpinning then lets the
    # blocks be evicted and reused while they are read (another item's bytes published
    # under this key: served as such where no cluster key is set).
    import ctypes
    import threading

    cache = OffloadCache.create("host-slow", arena_bytes="4MiB", block_bytes="4KiB",
                                directory=arena_dir, device="cpu", register_cuda="never",
                                shared=True)  # fmt: skip
    save(cache, {"img": torch.arange(4096, dtype=torch.int32)})
    release, seen = threading.Event(), []

    class SlowStore:
        def batch_is_exist(self, names):
            return [0] * len(names)

        def batch_put_from_multi_buffers(self, names, ptrs, lens):
            release.wait(20)
            seen.append(ctypes.string_at(ptrs[0][0], lens[0][0]))
            return [0] * len(names)

        def close(self):
            pass

    client = StoreClient(StoreSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata"),
                         connect=False)  # fmt: skip
    client._store, client._available = SlowStore(), True
    tier = ClusterTier(cache.arena, cache.catalog, client, namespace=NS, fetch_timeout_s=0.2)
    try:
        tier.publish(["img"])
        deadline = time.monotonic() + 10
        while tier.counts["cluster_publish_failures"] == 0:
            assert time.monotonic() < deadline, dict(tier.counts)
            time.sleep(0.01)
        time.sleep(0.1)
        tier.step()
        assert cache.catalog.entry("img").pins == 1, "unpinned while its put still reads it"
        release.set()
        deadline = time.monotonic() + 10
        while cache.catalog.entry("img").pins:
            assert time.monotonic() < deadline, "never unpinned after the put returned"
            tier.step()
            time.sleep(0.01)
        assert value.parse_header(seen[0]).shape == (4096,)
    finally:
        release.set()
        tier.close(timeout_s=5)
        cache.close()


def test_a_fetch_past_its_bound_counts_each_of_its_items(master, host, monkeypatch):
    """cluster_fetch_failures counts items, whether a get fails for one of them or the
    whole batch passes its bound."""
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 13)
    sizes = tb.lookup(list(tensors))
    gate = gate_gets(tb, monkeypatch)
    tb.fetch_timeout_s = 0.3
    try:
        f = fetched(tb, sizes)
        assert f.state == "error" and f.failed == set(tensors)
        assert tb.counts["cluster_fetch_failures"] == len(tensors)
    finally:
        gate.set()
    assert not [k for k in tensors if k in b.catalog and b.catalog.state(k).name == "READY"]


def test_a_fetch_nobody_polls_is_committed_by_the_tier_s_step(master, host):
    """Its requests went (aborted, finished): the fetch still ends, its items committed
    and nothing left reserved, by the step alone."""
    (a, ta), (b, tb) = host("host-a", master), host("host-b", master)
    tensors = saved_and_published(a, ta, 14)
    f = tb.fetch(tb.lookup(list(tensors)))
    deadline = time.monotonic() + 20
    while f.state == "pending":
        assert time.monotonic() < deadline, "the step never ended the fetch"
        tb.step()
        time.sleep(0.005)
    assert f.state == "done" and f.fetched == set(tensors) and not tb._posted
    assert all(b.catalog.state(k).name == "READY" for k in tensors)
