"""A producer process for tests/engine/remote/test_remote.py and :mod:`..profiling.bench_remote`.

Creates an arena (its name unlinked at once: a SIGKILL leaves no file), fills
its data area with seeded bytes (``fill_arena``), copies the whole data area
into an ArenaPeer's export window (one slot: window blocks = arena blocks; the
arena itself is not registered), prints ``META <base64 of peer.metadata()>``
and then one ``NOTIF <agent> <hex message>`` line per notification, until stdin
closes.
NIXL logs to stdout too: readers look for the prefixes.

    python -m ecoffload.testing.remote_producer DIR NAME BLOCK_BYTES NUM_BLOCKS SEED

A negative SEED leaves the arena zeroed.
"""

import base64
import os
import select
import sys
import time

import torch

from ..engine.arena.arena import Arena
from ..engine.remote.peer import ArenaPeer


def fill_arena(host: torch.Tensor, seed: int) -> None:
    """Seeded random bytes (in 64 MiB chunks, so large arenas fill fast enough)."""
    gen = torch.Generator().manual_seed(seed)
    chunk = 64 << 20
    for off in range(0, host.numel(), chunk):
        n = min(chunk, host.numel() - off)
        host[off : off + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def serve(directory: str, name: str, block_bytes: int, num_blocks: int, seed: int) -> None:
    arena = Arena.create(name, block_bytes=block_bytes, num_blocks=num_blocks,
                         directory=directory, processes=1, register_cuda="never")  # fmt: skip
    host = arena.host_tensor()
    if seed >= 0:  # else leave the zeros (benchmarks and kill tests need no contents)
        fill_arena(host, seed)
    peer = ArenaPeer(arena, f"producer-{os.getpid()}", host="127.0.0.1",
                     export_bytes=arena.nbytes, register_arena=False)  # fmt: skip
    window = peer.window
    assert window is not None, "an ArenaPeer with export_bytes has an export window"
    slot = window.put(host.numpy(), [(0, num_blocks)], block_bytes, arena.nbytes)
    assert slot == [(0, num_blocks)], slot  # an empty window: the one slot is all of it
    print("META " + base64.b64encode(peer.metadata()).decode(), flush=True)
    while True:
        for agent, msg in peer.notifications():
            print(f"NOTIF {agent} {msg.hex()}", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if ready and not sys.stdin.readline():
            break
        time.sleep(0.001)
    peer.close()
    arena.close()


if __name__ == "__main__":
    d, n, bb, nb, seed = sys.argv[1:6]
    serve(d, n, int(bb), int(nb), int(seed))
