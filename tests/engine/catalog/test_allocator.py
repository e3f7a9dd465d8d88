import random

import pytest

from ecoffload.engine.base.errors import InvalidSizeError, ItemTooLargeError
from ecoffload.engine.catalog.allocator import BlockAllocator, Extent

B = 4096


def test_fresh_allocator_gives_one_extent():
    a = BlockAllocator(100, B)
    assert a.alloc(10 * B) == [Extent(0, 10)]
    assert a.alloc(1) == [Extent(10, 1)]
    assert a.free_blocks == 89
    a.check()


@pytest.mark.parametrize("nbytes,blocks", [(1, 1), (B - 1, 1), (B, 1), (B + 1, 2), (7 * B, 7)])
def test_rounds_up_to_blocks(nbytes, blocks):
    a = BlockAllocator(10, B)
    (ext,) = a.alloc(nbytes)
    assert ext.count == blocks


def test_best_fit_picks_smallest_hole_that_fits():
    a = BlockAllocator(100, B)
    x = a.alloc(10 * B)
    a.alloc(1 * B)
    y = a.alloc(3 * B)
    a.alloc(1 * B)
    a.free(x)
    a.free(y)  # holes of 10 and 3 blocks, plus the 85-block tail
    assert a.alloc(3 * B) == [Extent(y[0].start, 3)]
    assert a.alloc(9 * B) == [Extent(x[0].start, 9)]
    a.check()


def test_fragmented_alloc_takes_longest_extents_first():
    a = BlockAllocator(20, B)
    held = [a.alloc(B) for _ in range(20)]
    for i in (0, 1, 2, 5, 6, 10, 11, 12, 13, 19):  # free holes of 3, 2, 4, 1
        a.free(held[i])
    got = a.alloc(7 * B)
    assert got == [Extent(0, 3), Extent(10, 4)]
    assert a.free_blocks == 3
    a.check()


def test_all_or_nothing():
    a = BlockAllocator(10, B)
    a.alloc(8 * B)
    before = (a.free_blocks, list(a._by_size))
    assert a.alloc(3 * B) is None
    assert (a.free_blocks, list(a._by_size)) == before


def test_free_coalesces_both_sides():
    a = BlockAllocator(30, B)
    x, y, z = a.alloc(10 * B), a.alloc(10 * B), a.alloc(10 * B)
    a.free(x)
    a.free(z)
    assert a.num_free_extents == 2
    a.free(y)
    assert a.num_free_extents == 1 and a.largest_free_extent == 30
    a.check()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", True])
def test_rejects_bad_sizes(bad):
    with pytest.raises(InvalidSizeError, match="positive int"):
        BlockAllocator(10, B).alloc(bad)


def test_rejects_item_larger_than_arena():
    with pytest.raises(ItemTooLargeError, match="11 blocks .* has 10 in all: give the arena more "
                       "bytes or do not offload items this large"):  # fmt: skip
        BlockAllocator(10, B).alloc(10 * B + 1)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_num_blocks_must_be_positive(num_blocks):
    with pytest.raises(InvalidSizeError, match=f"num_blocks must be positive, got {num_blocks}"):
        BlockAllocator(num_blocks, B)


def test_a_one_block_arena_works():
    a = BlockAllocator(1, B)
    assert a.alloc(B) == [Extent(0, 1)] and a.alloc(1) is None
    a.check()


def test_best_fit_takes_an_exact_hole_at_block_0():
    a = BlockAllocator(10, B)
    first, _ = a.alloc(3 * B), a.alloc(B)
    a.free(first)  # holes: (0, 3) and the 6-block tail
    assert a.alloc(3 * B) == [Extent(0, 3)]
    a.check()


@pytest.mark.parametrize("block_bytes", [0, 1000, 4097])
def test_block_size_must_be_4k_multiple(block_bytes):
    with pytest.raises(InvalidSizeError, match="multiple of 4096"):
        BlockAllocator(10, block_bytes)


@pytest.mark.parametrize("extent", [(8, 5), (3, 0), (-1, 2), (2, -1)])
def test_free_rejects_out_of_range_extent(extent):
    a = BlockAllocator(10, B)
    a.alloc(10 * B)
    with pytest.raises(InvalidSizeError, match="outside"):
        a.free([Extent(*extent)])
    assert a.free_blocks == 0


@pytest.mark.parametrize(
    "free_extents",
    [{0: 2, 2: 2}, {1: 2, 2: 3}, {4: 0, 6: 1}],
    ids=["touching", "overlapping", "empty-extent"],
)
def test_check_catches_corrupt_free_lists(free_extents):
    a = BlockAllocator(10, B)
    a._by_start = dict(free_extents)
    a._by_end = {s + c: s for s, c in free_extents.items()}
    a._by_size = sorted((c, s) for s, c in free_extents.items())
    a.free_blocks = sum(free_extents.values())
    with pytest.raises(AssertionError, match="free extents overlap or touch"):
        a.check()


@pytest.mark.parametrize("ready", [4, 11], ids=["free-past-the-ready", "ready-past-the-end"])
def test_check_catches_free_blocks_beyond_the_ready_ones(ready):
    a = BlockAllocator(10, B, ready_blocks=4)  # the arena still populating: [0, 4) free
    a.check()
    if ready == 4:  # a free extent the populate has not reached
        a._insert(6, 2)
        a.free_blocks += 2
    else:
        a.ready_blocks = ready
    with pytest.raises(AssertionError, match="^free blocks beyond the ready ones$"):
        a.check()


def test_random_churn_keeps_invariants():
    rng = random.Random(0)
    a = BlockAllocator(500, B)
    live = []
    for _ in range(3000):
        if live and (rng.random() < 0.45 or a.free_blocks < 20):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            ext = a.alloc(rng.randint(1, 40) * B - rng.randint(0, B - 1))
            if ext is not None:
                live.append(ext)
        owned = sorted(b for exts in live for s, c in exts for b in range(s, s + c))
        assert len(owned) == len(set(owned))
        assert len(owned) + a.free_blocks == 500
    a.check()


def test_cost_grows_with_extents_not_blocks():
    # A 1024-row item of 4096 bf16 is 8 MiB: one extent, whatever the block count.
    a = BlockAllocator(1 << 20, B)
    ext = a.alloc(1024 * 4096 * 2)
    assert len(ext) == 1 and ext[0].count == 2048
