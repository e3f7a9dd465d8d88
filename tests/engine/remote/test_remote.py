"""engine/remote/peer.py: pulling items between arenas with NIXL.

The piece walk is checked against a byte-offset reference without NIXL. The
transfers (skipped without NIXL: `pip install ecoffload[nixl]`) move seeded
random items between two arenas of different block sizes, fragmented
differently on each side, into a poisoned destination, and compare the WHOLE
destination arena with the expected bytes (so neighbouring blocks and the tail
of each item's last block must still hold the poison): two agents in one
process, and a producer process over 127.0.0.1. A producer SIGKILLed mid-read
must give "error" within a bound and leave no arena file behind.
"""

import json
import os
import random
import re
import signal
import time

import numpy as np
import pytest
import torch
from producers import start_producer, stop_producer

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import (
    NixlNotInstalledError,
    RemoteExtentError,
    RemotePeerError,
)
from ecoffload.engine.remote import nixl_setup
from ecoffload.engine.remote.extent_pieces import pieces as extent_pieces
from ecoffload.engine.remote.nixl_setup import nixl_available
from ecoffload.engine.remote.peer import ArenaPeer
from ecoffload.engine.remote.records import PeerCard, Pull, check_extents
from ecoffload.testing.remote_producer import fill_arena

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install ecoffload[nixl]"
)
POISON = 0xA5


def stream(extents, block_bytes, nbytes):
    """Reference: the byte offsets of an item's stream, in order."""
    parts = [np.arange(s * block_bytes, (s + c) * block_bytes) for s, c in extents]
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64))[:nbytes]


def scatter(rng, free, need):
    """Take ``need`` blocks from the shuffled list ``free``; their extents (fragmented)."""
    taken, free[:] = sorted(free[:need]), free[need:]
    extents = []
    for b in taken:
        if extents and extents[-1][0] + extents[-1][1] == b:
            extents[-1][1] += 1
        else:
            extents.append([b, 1])
    rng.shuffle(extents)  # an item's stream need not follow block order
    return [tuple(e) for e in extents]


def plan(seed, sizes, rbb, rnb, lbb, lnb):
    """Pulls of items of ``sizes`` bytes, fragmented differently on each side."""
    rng = random.Random(seed)
    rfree, lfree = list(range(rnb)), list(range(lnb))
    rng.shuffle(rfree)
    rng.shuffle(lfree)
    return [
        Pull(scatter(rng, rfree, -(-n // rbb)), scatter(rng, lfree, -(-n // lbb)), n) for n in sizes
    ]


def expected_after(src: torch.Tensor, dst_bytes: int, pulls, rbb, lbb):
    out = torch.full((dst_bytes,), POISON, dtype=torch.uint8)
    for p in pulls:
        out[torch.from_numpy(stream(p.local, lbb, p.nbytes))] = src[
            torch.from_numpy(stream(p.remote, rbb, p.nbytes))
        ]
    return out


SIZES = {
    "one-byte": [1],
    "odd-63": [63],
    "block-minus-1": [4095],
    "one-block": [4096],
    "block-plus-1": [4097],
    "many-blocks-odd": [5 * 8192 + 17],
    "mixed-request": [1, 63, 4095, 4096, 4097, 3 * 8192 + 5, 20000, 65536],
}


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("rbb,lbb", [(4096, 8192), (8192, 4096), (4096, 4096)],
                         ids=["small-to-large", "large-to-small", "same"])  # fmt: skip
def test_pieces_map_every_byte_like_the_reference(sizes, rbb, lbb):
    for seed in range(3):
        for p in plan(seed, sizes, rbb, 64, lbb, 64):
            r = check_extents(p.remote, rbb, 64, p.nbytes, "remote")
            loc = check_extents(p.local, lbb, 64, p.nbytes, "local")
            pieces = list(extent_pieces(r, rbb, loc, lbb, p.nbytes))
            got_r = np.concatenate([np.arange(ro, ro + n) for ro, _, n in pieces])
            got_l = np.concatenate([np.arange(lo, lo + n) for _, lo, n in pieces])
            assert np.array_equal(got_r, stream(p.remote, rbb, p.nbytes))
            assert np.array_equal(got_l, stream(p.local, lbb, p.nbytes))
            for (r0, l0, n0), (r1, l1, _) in zip(pieces, pieces[1:], strict=False):
                assert (r0 + n0, l0 + n0) != (r1, l1), "adjacent pieces were not merged"


def test_pieces_of_contiguous_items_are_one_descriptor():
    pieces = list(extent_pieces([(3, 4)], 4096, [(1, 2)], 8192, 4 * 4096 - 1))
    assert pieces == [(3 * 4096, 8192, 4 * 4096 - 1)]
    assert list(extent_pieces([], 4096, [], 8192, 0)) == []


def test_missing_nixl_says_what_to_install(monkeypatch):
    monkeypatch.setattr(nixl_setup, "_NIXL_MODULES", ("ecoffload_no_such_nixl._api",))
    assert not nixl_available()
    with pytest.raises(NixlNotInstalledError, match=r"pip install ecoffload\[nixl\]"):
        ArenaPeer(None, "x")


def test_card_round_trips_through_json_and_refuses_garbage():
    card = PeerCard("p", 1 << 40, 4096, 16)
    assert PeerCard.from_dict(json.loads(json.dumps(card.to_dict()))) == card
    with pytest.raises(RemotePeerError, match="malformed"):
        PeerCard.from_dict({"name": "p"})
    with pytest.raises(RemotePeerError, match="positive"):
        PeerCard.from_dict({**card.to_dict(), "block_bytes": 0})


@pytest.fixture
def arenas(arena_dir):
    """A producer arena (4 KiB blocks, seeded bytes), a poisoned consumer arena (8 KiB)."""
    src = Arena.create("src", block_bytes=4096, num_blocks=64, directory=arena_dir,
                       register_cuda="never")  # fmt: skip
    dst = Arena.create("dst", block_bytes=8192, num_blocks=48, directory=arena_dir,
                       register_cuda="never")  # fmt: skip
    fill_arena(src.host, 7)
    dst.host.fill_(POISON)
    yield src, dst
    src.close()
    dst.close()


def exporting(src, name="prod", **kw):
    """A producer peer whose export window holds a copy of all of ``src`` (window
    block i = arena block i, so pulls name arena blocks); the arena is not registered."""
    peer = ArenaPeer(src, name, host="127.0.0.1", export_bytes=src.nbytes,
                     register_arena=False, **kw)  # fmt: skip
    slot = peer.window.put(src.host.numpy(), [(0, src.num_blocks)], src.block_bytes, src.nbytes)
    assert slot == [(0, src.num_blocks)]
    return peer


def wait_notif(peer, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = peer.notifications()
        if got:
            return got
        time.sleep(0.005)
    return []


@needs_nixl
def test_one_read_moves_a_fragmented_request_bit_exactly(arenas):
    src, dst = arenas
    with exporting(src) as prod, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
        name = cons.connect(prod.metadata())
        assert name == "prod" and cons.connect(prod.metadata()) == "prod"  # same card: no-op
        pulls = plan(1, SIZES["mixed-request"], 4096, 64, 8192, 48)
        h = cons.read(name, pulls, notify=b"req-1")
        assert cons.wait(h, timeout_s=30) == "done", h.error
        assert h.settled and h.nbytes == sum(p.nbytes for p in pulls) and not cons.unsettled
        want = expected_after(src.host, dst.nbytes, pulls, 4096, 8192)
        assert torch.equal(dst.host, want)  # items bit-exact, every other byte still poison
        assert wait_notif(prod) == [("cons", b"req-1")]
        assert cons.poll(h) == "done"  # settled handles answer from memory


@needs_nixl
def test_reads_of_odd_sizes_one_by_one(arenas):
    src, dst = arenas
    with exporting(src) as prod, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
        cons.connect(prod.metadata())
        done = []
        for i, n in enumerate(SIZES["mixed-request"]):
            (p,) = plan(10 + i, [n], 4096, 64, 8192, 48)
            h = cons.read("prod", [p], notify=f"item-{i}".encode())
            assert cons.wait(h, 30) == "done", h.error
            done.append(p)
            assert torch.equal(dst.host, expected_after(src.host, dst.nbytes, [p], 4096, 8192))
            dst.host.fill_(POISON)
        got = []
        deadline = time.monotonic() + 10
        while len(got) < len(done) and time.monotonic() < deadline:
            got += prod.notifications()
        assert sorted(got) == sorted(("cons", f"item-{i}".encode()) for i in range(len(done)))


@needs_nixl
def test_empty_read_only_notifies(arenas):
    src, dst = arenas
    with exporting(src) as prod, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
        cons.connect(prod.metadata())
        h = cons.read("prod", [], notify=b"nothing")
        assert (h.state, h.settled, h.descriptors) == ("done", True, 0)
        assert wait_notif(prod) == [("cons", b"nothing")]
        assert torch.all(dst.host == POISON)


@needs_nixl
def test_bad_reads_are_refused_before_anything_moves(arenas):
    src, dst = arenas
    with exporting(src) as prod, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
        with pytest.raises(RemotePeerError, match="not connected"):
            cons.read("prod", [Pull([(0, 1)], [(0, 1)], 10)])
        with pytest.raises(RemotePeerError, match="not ArenaPeer.metadata"):
            cons.connect(b"garbage")
        with pytest.raises(RemotePeerError, match="no export window"):
            cons.metadata()  # a consumer publishes nothing
        cons.connect(prod.metadata())
        cases = [
            (Pull([(63, 2)], [(0, 1)], 4096), "outside the arena's 64 blocks"),
            (Pull([(0, 1)], [(0, 1)], 4097), "takes 2 blocks of 4096 bytes, its extents hold 1"),
            (Pull([(0, 3)], [(0, 1)], 4097), "takes 2 blocks of 4096 bytes, its extents hold 3"),
            (Pull([(0, 1)], [(0, 2)], 4096), "takes 1 blocks of 8192 bytes, its extents hold 2"),
            (Pull([(0, 0), (1, 1)], [(0, 1)], 10), "or empty"),
            (Pull([], [], -1), "nbytes must be an int >= 0"),
            (Pull([(0, 4)], [(3, 2)], 16384), None),  # valid, but shares local block 4:
        ]
        for pull, match in cases[:-1]:
            with pytest.raises(RemoteExtentError, match=re.escape(match)):
                cons.read("prod", [pull])
        with pytest.raises(RemoteExtentError, match="overlap"):
            cons.read("prod", [cases[-1][0], Pull([(2, 1)], [(4, 1)], 10)])
        assert not cons.unsettled and torch.all(dst.host == POISON)
        assert prod.notifications() == []


@needs_nixl
@pytest.mark.slow
def test_cross_process_read_over_loopback(arena_dir):
    proc, card = start_producer(arena_dir, 4096, 256, seed=3)
    try:
        with Arena.create("dst", block_bytes=8192, num_blocks=96, directory=arena_dir,
                          register_cuda="never") as dst:  # fmt: skip
            dst.host.fill_(POISON)
            with ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
                name = cons.connect(card)
                pulls = plan(2, SIZES["mixed-request"] + [300_000], 4096, 256, 8192, 96)
                h = cons.read(name, pulls, notify=b"req-x")
                assert cons.wait(h, 30) == "done", h.error
                ref = torch.empty(256 * 4096, dtype=torch.uint8)
                fill_arena(ref, 3)
                assert torch.equal(dst.host, expected_after(ref, dst.nbytes, pulls, 4096, 8192))
                time.sleep(0.2)  # the notification reaches the producer's loop
    finally:
        notifs = stop_producer(proc)
    assert notifs == [("cons", b"req-x".hex())]
    assert os.listdir(arena_dir) == []


@needs_nixl
@pytest.mark.slow
@pytest.mark.parametrize("when", ["mid-read", "before-read"])
def test_killed_producer_gives_error_within_a_bound(arena_dir, monkeypatch, when):
    # TCP: a 256 MiB read is still in flight when the kill lands (CMA may finish it in the post)
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc, card = start_producer(arena_dir, 1 << 20, 256, seed=-1)
    try:
        dst = Arena.create("dst", block_bytes=1 << 20, num_blocks=256, directory=arena_dir,
                           register_cuda="never", populate="lazy")  # fmt: skip
        with dst, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
            name = cons.connect(card)
            pulls = [Pull([(0, 256)], [(0, 256)], 256 << 20)]
            if when == "before-read":
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            t0 = time.monotonic()
            h = cons.read(name, pulls, notify=b"never", timeout_s=60)
            if when == "mid-read":
                assert h.state == "pending"
                os.kill(proc.pid, signal.SIGKILL)
            state = cons.wait(h, timeout_s=30)
            took = time.monotonic() - t0
            assert state == "error" and h.settled, (state, h.error, took)
            assert took < 30
            assert not cons.unsettled
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert os.listdir(arena_dir) == []  # the producer's name was unlinked when it created it


@needs_nixl
@pytest.mark.slow
def test_deadline_gives_error_and_settles_when_the_transfer_ends(arena_dir, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc, card = start_producer(arena_dir, 1 << 20, 256, seed=-1)
    try:
        dst = Arena.create("dst", block_bytes=1 << 20, num_blocks=256, directory=arena_dir,
                           register_cuda="never", populate="lazy")  # fmt: skip
        with dst, ArenaPeer(dst, "cons", host="127.0.0.1") as cons:
            name = cons.connect(card)
            h = cons.read(name, [Pull([(0, 256)], [(0, 256)], 256 << 20)], timeout_s=0.0)
            time.sleep(0.05)
            assert cons.poll(h) == "error", h.error
            # what a starved poller and a transfer that stood still tell apart
            assert h.error.startswith(
                "timed out after 0 s: NIXL still had the read in "
                "progress at poll 1 (longest wait between polls "
            ), h.error
            assert h.error.endswith(" s; the first read from this peer)"), h.error
            assert h.polls == 1 and 0.05 <= h.longest_gap < 30 and h.first
            gap = float(h.error.split("between polls ")[1].split()[0])
            assert gap == round(h.longest_gap, 2), h.error
            assert not h.settled and cons.unsettled == [h]  # bytes may still land
            deadline = time.monotonic() + 60
            while not h.settled and time.monotonic() < deadline:
                assert cons.poll(h) == "error"  # stays error even if it completes
                time.sleep(0.01)
            assert h.settled and not cons.unsettled
            assert not cons.read(name, []).first  # a second read: the connection is made
            cons.disconnect(name)
            assert cons.read(cons.connect(card), []).first  # connected anew: first again
    finally:
        notifs = stop_producer(proc)
    assert set(notifs) <= {("cons",)}  # no message was asked for (none, or empty ones)
