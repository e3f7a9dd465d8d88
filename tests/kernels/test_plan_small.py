"""The small-step planner (a few extents: a typical step) against the loop planner (the
reference): the same segment rows for valid steps, None for every faulty one, so the
loop names the fault."""

import random

import pytest

from ecoffload.kernels import PlanError, native, plan, planner
from ecoffload.kernels.planner import plan_copy

B = 4096
BLOCKS = 200
ITEMS_BASE, ARENA_BASE = 0x7F0000001000, 0x7E0000000000


@pytest.fixture(autouse=True)
def python_passes(monkeypatch):
    """These tests are about the Python passes: no C pass (tests/kernels/test_plan_native.py)."""
    monkeypatch.setattr(native, "planner", lambda: None)


def step(seed, items=6, max_blocks=5):
    """(offsets, sizes, tables, items_bytes): sizes at the edges of blocks (0, 1, B - 1,
    B, B + 1, ...), shuffled blocks coalesced into extents in shuffled stream order,
    offsets at assorted alignments."""
    rng = random.Random(seed)
    blocks = list(range(BLOCKS))
    rng.shuffle(blocks)
    align = rng.choice([16, 16, 16, 8, 4, 2, 1])  # of every item's offset: the access width
    offsets, sizes, tables, off = [], [], [], 0
    for _ in range(items):
        k = rng.randint(0, max_blocks)
        n = max(0, k * B + rng.choice([0, 0, 1, -1, -(B // 2), -(B - 1)])) if k else 0
        need = -(-n // B)
        mine, blocks = sorted(blocks[:need]), blocks[need:]
        table = []
        for b in mine:
            if table and table[-1][0] + table[-1][1] == b:
                table[-1] = (table[-1][0], table[-1][1] + 1)
            else:
                table.append((b, 1))
        rng.shuffle(table)
        offsets.append(-(-off // align) * align + rng.choice([0, 16]))
        off = offsets[-1] + n
        sizes.append(n)
        tables.append(table)
    return offsets, sizes, tables, off


def args_of(offsets, sizes, tables, items_bytes, items_base=ITEMS_BASE, arena_base=ARENA_BASE,
            tile_bytes=1024):  # fmt: skip
    return (offsets, sizes, tables, B, BLOCKS, items_bytes, tile_bytes, items_base, arena_base)


def agree(args):
    small = plan.segments_small(*args)
    assert small is not None, "a valid step was handed to the loop"
    rows, first_tiles, tiles, vec, total = plan.segments_loop(*args)
    assert list(small[0]) == list(rows) and list(small[1]) == list(first_tiles)
    assert small[2:] == (tiles, vec, total)
    return vec


@pytest.mark.parametrize("tile_bytes", [1024, B - 1], ids=["tile-1024", "tile-4095"])
@pytest.mark.parametrize("seed", range(40))
def test_the_small_pass_agrees_with_the_loop_on_valid_steps(seed, tile_bytes):
    """A tile one byte short of a block too: a whole block is two tiles, one byte in the
    second (the pass's ceiling division must be the loop's for any tile size)."""
    offsets, sizes, tables, total = step(seed)
    assert sum(map(len, tables)) < planner.VECTORISE_FROM
    agree(args_of(offsets, sizes, tables, total, tile_bytes=tile_bytes))


@pytest.mark.parametrize(
    "items_base,arena_base,vec",
    [(0x1000, 0x2000, 16), (0x1008, 0x2000, 8), (0x1000, 0x2004, 4), (0x1001, 0x2000, 1)],
)
def test_narrower_accesses_recount_every_tile(items_base, arena_base, vec):
    """Tiles are counted at 16 bytes in the pass and recounted when an address allows
    fewer: sizes that are not multiples of the width get a tail tile each."""
    sizes = [1024 + 3, 2048 + 8, 5, 4 * B]
    offsets = [0, 1040, 3104, 3120]
    tables = [[(7, 1)], [(3, 1)], [(0, 1)], [(10, 2), (20, 2)]]
    got = agree(args_of(offsets, sizes, tables, 3120 + 4 * B, items_base, arena_base))
    assert got == vec


def test_the_edges_of_a_valid_step():
    """Blocks 0 and BLOCKS - 1, a 1-byte last extent, whole blocks exactly, an item that
    ends at the end of the items buffer, zero-byte items first and last."""
    sizes = [0, B + 1, 2 * B, 1, 0]
    offsets = [0, 0, B + 1, 3 * B + 1, 3 * B + 2]
    tables = [[], [(BLOCKS - 1, 1), (0, 1)], [(5, 2)], [(8, 1)], []]
    agree(args_of(offsets, sizes, tables, 3 * B + 2))


def test_an_empty_step():
    assert plan.segments_small([], [], [], B, BLOCKS, 0, 1024, 0, 0) == ([], [], 0, 16, 0)


def one_fault(kind):
    sizes = [B + 1, 2 * B, 100]
    offsets = [0, B + 1, 3 * B + 1]
    tables = [[(10, 1), (0, 1)], [(BLOCKS - 2, 2)], [(5, 1)]]
    items_bytes = 3 * B + 101
    if kind == "overlap":
        tables[2] = [(BLOCKS - 1, 1)]
    elif kind == "same-start":
        tables[2] = [(10, 1)]
    elif kind == "negative-start":  # block 0 moved to -1: no overlap
        tables[0][1] = (-1, 1)
    elif kind == "past-the-end":  # the last two blocks moved one on
        tables[1] = [(BLOCKS - 1, 2)]
    elif kind == "zero-count":
        tables[0].append((50, 0))
    elif kind == "negative-count":
        tables[0][1] = (0, -1)
    elif kind == "one-whole-block-too-many":
        tables[1] = [(BLOCKS - 3, 3)]
    elif kind == "extent-after-the-last-byte":
        tables[2].append((6, 1))
    elif kind == "too-short":
        tables[0].pop()
    elif kind == "bytes-but-no-blocks":
        tables[2] = []
    elif kind == "block-but-no-bytes":
        sizes[2] = 0
    elif kind == "item-past-the-buffer":
        offsets[2] += 1
    elif kind == "negative-offset":
        offsets[0] = -1
    elif kind == "negative-size":
        sizes[2], tables[2] = -1, []
    return args_of(offsets, sizes, tables, items_bytes)


FAULTS = [
    "overlap", "same-start", "negative-start", "past-the-end", "zero-count", "negative-count",
    "one-whole-block-too-many", "extent-after-the-last-byte", "too-short",
    "bytes-but-no-blocks", "block-but-no-bytes", "item-past-the-buffer", "negative-offset",
    "negative-size",
]  # fmt: skip


def test_the_fault_free_step_is_valid():
    agree(one_fault("none"))


def assert_plan_copy_raises_the_loop_s_error(args):
    with pytest.raises(PlanError) as loop:
        plan.segments_loop(*args)
    offsets, sizes, tables, block, blocks, items_bytes, tile, _, _ = args
    with pytest.raises(PlanError) as planned:
        plan_copy(offsets, sizes, tables, block_bytes=block, arena_bytes=blocks * block,
                  items_bytes=items_bytes, tile_bytes=tile)  # fmt: skip
    assert str(planned.value) == str(loop.value)


@pytest.mark.parametrize("kind", FAULTS)
def test_every_faulty_step_goes_to_the_loop_which_names_it(kind):
    args = one_fault(kind)
    assert plan.segments_small(*args) is None
    assert_plan_copy_raises_the_loop_s_error(args)


def test_a_step_below_vectorise_from_is_planned_by_the_small_pass(monkeypatch):
    n = planner.VECTORISE_FROM - 1
    step_args = ([i * B for i in range(n)], [B] * n, [[(n - 1 - i, 1)] for i in range(n)])
    kw = dict(block_bytes=B, arena_bytes=n * B, items_bytes=n * B, tile_bytes=2048)
    monkeypatch.setattr(planner, "segments_small", lambda *args: None)
    want = plan_copy(*step_args, **kw)  # the loop's plan
    monkeypatch.undo()

    def loop(*args):
        raise AssertionError("a valid small step was planned by the loop")

    monkeypatch.setattr(planner, "segments_loop", loop)
    got = plan_copy(*step_args, **kw)
    assert got.table.tolist() == want.table.tolist() and got.num_segments == n


@pytest.mark.parametrize("entry", [(5, 1, 0), (5,), None, ("5", 1)])
def test_entries_that_are_not_pairs_of_ints_go_to_the_loop(entry):
    """Even after a fault the loop finds first: the loop's error is the one raised."""
    args = one_fault("negative-start")
    args[2][2] = [entry]
    assert plan.segments_small(*args) is None
    offsets, sizes, tables, block, blocks, items_bytes, tile, _, _ = args
    with pytest.raises(PlanError, match=r"extent \(-1, 1\) is not inside"):
        plan_copy(offsets, sizes, tables, block_bytes=block, arena_bytes=blocks * block,
                  items_bytes=items_bytes, tile_bytes=tile)  # fmt: skip
