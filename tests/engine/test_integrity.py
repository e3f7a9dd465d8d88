"""Integrity mode over multi-extent block tables whose last block is partly used:
the checksum covers exactly the item's bytes, never the padding of its last block."""

import pytest
import torch

from ecoffload.engine import OffloadCache
from ecoffload.kernels import triton_available

B = 4096


def cpu_cache(arena_dir):
    """A 5-block integrity-mode cache on CPU (the check is the engine's, not the kernel's)."""
    return OffloadCache.create("integrity", arena_bytes=5 * B, block_bytes=B, directory=arena_dir,
                               device="cpu", register_cuda="never", integrity=True)  # fmt: skip


def fragmented(cache):
    """Free blocks 0 and 3 only (1-2 and 4 held), so a 2-block item gets [(0, 1), (3, 1)]."""
    cache.save({"a": torch.ones(B, dtype=torch.uint8)})  # block 0
    cache.save({"b": torch.ones(2 * B, dtype=torch.uint8)})  # blocks 1-2
    cache.save({"c": torch.ones(B, dtype=torch.uint8)})  # block 3
    cache.save({"d": torch.ones(B, dtype=torch.uint8)})  # block 4
    cache.flush()
    cache.catalog.evict("a")
    cache.catalog.evict("c")


@pytest.mark.parametrize("nbytes", [B + 1, B + 2000, 2 * B - 1, 2 * B])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_partly_used_last_block_of_a_multi_extent_item_is_served(arena_dir, monkeypatch, nbytes,
                                                                 path):  # fmt: skip
    if path == "kernel" and not triton_available(torch.device("cpu")):
        pytest.skip("the kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    if path == "reference":
        monkeypatch.setattr("ecoffload.engine.transfer.triton_available", lambda device: False)
    with cpu_cache(arena_dir) as cache:
        assert cache.mover.path == path
        cache.arena.host.fill_(0xA5)  # padding differs from the item's bytes
        fragmented(cache)
        item = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(nbytes))  # fmt: skip
        cache.save({"e": item})
        cache.flush()
        assert cache.catalog.entry("e").extents == [(0, 1), (3, 1)]
        got = cache.load(["e"])
        assert cache.integrity_failures == 0
        assert set(got) == {"e"} and torch.equal(got["e"], item)


def test_corruption_inside_the_last_extent_is_still_caught(arena_dir):
    with cpu_cache(arena_dir) as cache:
        fragmented(cache)
        cache.save({"e": torch.full((B + 100,), 7, dtype=torch.uint8)})
        cache.flush()
        cache.arena.host[3 * B + 99] ^= 0xFF  # the item's last byte, in block 3
        assert cache.load(["e"]) == {} and cache.integrity_failures == 1


def test_padding_after_the_item_is_not_checked(arena_dir):
    with cpu_cache(arena_dir) as cache:
        fragmented(cache)
        item = torch.full((B + 100,), 7, dtype=torch.uint8)
        cache.save({"e": item})
        cache.flush()
        cache.arena.host[3 * B + 100] ^= 0xFF  # first padding byte: not the item's
        got = cache.load(["e"])
        assert cache.integrity_failures == 0 and torch.equal(got["e"], item)
