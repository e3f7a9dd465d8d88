"""The vectorised planner (fragmented steps) against the loop planner (the reference):
the same launch table for valid steps, the loop's precise error for faulty ones."""

import random

import pytest
import torch

from ecoffload.kernels import PlanError, native, plan, planner
from ecoffload.kernels.planner import plan_copy

B = 4096


@pytest.fixture(autouse=True)
def python_passes(monkeypatch):
    """These tests are about the Python passes: no C pass (tests/kernels/test_plan_native.py)."""
    monkeypatch.setattr(native, "planner", lambda: None)


def step(seed, items=40, max_extents=12, zero_items=True):
    rng = random.Random(seed)
    blocks = list(range(2000))
    rng.shuffle(blocks)
    offsets, sizes, tables, off = [], [], [], 0
    for _ in range(items):
        n = 0 if zero_items and rng.random() < 0.1 else rng.randint(1, max_extents * B)
        need = -(-n // B)
        mine, blocks = sorted(blocks[:need]), blocks[need:]
        table = []
        for b in mine:  # coalesce neighbours into longer extents, like the allocator
            if table and table[-1][0] + table[-1][1] == b:
                table[-1] = (table[-1][0], table[-1][1] + 1)
            else:
                table.append((b, 1))
        rng.shuffle(table)  # stream order need not follow block order
        offsets.append(off + rng.choice([0, 2, 6]))
        off = offsets[-1] + n
        sizes.append(n)
        tables.append(table)
    return offsets, sizes, tables, off


def loop_only(monkeypatch):
    """Plan every step with the loop: no vectorised pass, no small-step pass."""
    monkeypatch.setattr(planner, "VECTORISE_FROM", 10**9)
    monkeypatch.setattr(planner, "segments_small", lambda *args: None)


def both(offsets, sizes, tables, items_bytes, monkeypatch):
    kw = dict(block_bytes=B, arena_bytes=2000 * B, items_bytes=items_bytes, tile_bytes=2048,
              num_programs=8, items_base=0x7F0000001000, arena_base=0x7E0000000000)  # fmt: skip
    fast = plan_copy(offsets, sizes, tables, **kw)
    with monkeypatch.context() as m:
        loop_only(m)
        slow = plan_copy(offsets, sizes, tables, **kw)
    return fast, slow


@pytest.mark.parametrize("seed", range(12))
def test_vectorised_plan_equals_the_loop_plan(seed, monkeypatch):
    offsets, sizes, tables, total = step(seed)
    assert sum(map(len, tables)) >= planner.VECTORISE_FROM
    fast, slow = both(offsets, sizes, tables, total, monkeypatch)
    assert torch.equal(fast.table, slow.table)
    assert (fast.vec_bytes, fast.num_tiles, fast.nbytes, fast.num_segments) == (
        slow.vec_bytes, slow.num_tiles, slow.nbytes, slow.num_segments)  # fmt: skip


def corrupt(tables, sizes, kind, rng):
    tables = [list(t) for t in tables]
    i = max(range(len(tables)), key=lambda k: len(tables[k]))
    start, count = tables[i][-1]
    if kind == "overlap":
        j = next(k for k in range(len(tables)) if k != i and tables[k])
        tables[j][0] = (start, 1)
    elif kind == "too-long":
        tables[i][-1] = (start, count + 1) if start + count < 2000 else (start - 1, count + 1)
    elif kind == "too-short":
        tables[i].pop()
    elif kind == "outside":
        tables[i][-1] = (1999, 2)
    return tables


@pytest.mark.parametrize("kind", ["overlap", "too-long", "too-short", "outside"])
@pytest.mark.parametrize("seed", range(3))
def test_faulty_steps_get_the_loop_planner_s_error(kind, seed, monkeypatch):
    offsets, sizes, tables, total = step(seed, zero_items=False)
    bad = corrupt(tables, sizes, kind, random.Random(seed))
    errors = []
    for only_the_loop in (False, True):  # vectorised first, then the loop alone
        with monkeypatch.context() as m:
            if only_the_loop:
                loop_only(m)
            else:
                m.setattr(planner, "VECTORISE_FROM", 0)
            with pytest.raises(PlanError) as caught:
                plan_copy(offsets, sizes, bad, block_bytes=B, arena_bytes=2000 * B,
                          items_bytes=total)  # fmt: skip
            errors.append(str(caught.value))
    assert errors[0] == errors[1]


def args_of(offsets, sizes, tables, total):
    return (offsets, sizes, tables, B, 2000, total, 2048, 0x7F0000001000, 0x7E0000000000)


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_pass_itself_agrees_with_the_loop_on_valid_steps(seed):
    """Not only the final plan: the pass must not quietly hand valid steps to the loop."""
    args = args_of(*step(seed))
    fast = plan.segments_vectorised(*args)
    assert fast is not None, "a valid step was handed to the loop"
    rows, first_tiles, tiles, vec, total = plan.segments_loop(*args)
    assert fast[0] == rows and list(fast[1]) == list(first_tiles)
    assert fast[2:] == (tiles, vec, total)


@pytest.mark.parametrize("kind", ["overlap", "too-long", "too-short", "outside"])
@pytest.mark.parametrize("seed", range(3))
def test_the_vectorised_pass_hands_every_faulty_step_to_the_loop(kind, seed):
    offsets, sizes, tables, total = step(seed, zero_items=False)
    bad = corrupt(tables, sizes, kind, random.Random(seed))
    assert plan.segments_vectorised(*args_of(offsets, sizes, bad, total)) is None
    item_fault = [list(t) for t in tables]
    assert plan.segments_vectorised(*args_of(offsets, sizes, item_fault, total)) is not None
    shifted = [o + 1 for o in offsets]  # an item past the end of the items buffer
    assert plan.segments_vectorised(*args_of(shifted, sizes, tables, total)) is None


def edge_step():
    """A valid step at the pass's edges: blocks 0 and 1999 (the arena's first and last),
    an item whose last extent carries 1 byte, one of exactly 2 whole blocks next to a
    free block, a zero-byte item last, 16-byte aligned offsets with odd sizes (16-byte
    accesses, so segments end in byte-wise tails)."""
    offsets, sizes, tables, off = [], [], [], 0
    free = iter(range(2, 1000))
    for i in range(70):
        if i == 0:
            n, table = B + 1, [(1999, 1), (0, 1)]
        elif i == 1:
            n, table = 2 * B, [(1000, 2)]  # block 1002 stays free
        elif i == 69:
            n, table = 0, []
        else:
            n = (i * 7919) % (3 * B) + 1
            table = [(next(free), 1) for _ in range(-(-n // B))]
        offsets.append(off)
        sizes.append(n)
        tables.append(table)
        off = -(-(off + n) // 16) * 16
    return offsets, sizes, tables, off


def test_the_vectorised_pass_agrees_with_the_loop_at_the_edges_of_a_valid_step():
    offsets, sizes, tables, total = edge_step()
    args = args_of(offsets, sizes, tables, total)
    fast = plan.segments_vectorised(*args)
    assert fast is not None, "a valid step was handed to the loop"
    rows, first_tiles, tiles, vec, nbytes = plan.segments_loop(*args)
    assert vec == 16 and any(n % 16 for n in sizes)  # tails to count
    assert fast[0] == rows and list(fast[1]) == list(first_tiles)
    assert fast[2:] == (tiles, vec, nbytes)


def one_fault(kind):
    offsets, sizes, tables, total = edge_step()
    tables = [list(t) for t in tables]
    if kind == "negative-offset":  # nothing else wrong: the sizes still fit the buffer
        offsets[5] = -16
    elif kind == "negative-start":  # block 0's extent moved to block -1: no overlap
        tables[0][1] = (-1, 1)
    elif kind == "past-the-end":  # block 1999's extent moved to block 2000: no overlap
        tables[0][0] = (2000, 1)
    elif kind == "one-whole-block-too-many":  # 2 blocks of bytes, 3 blocks given
        tables[1] = [(1000, 3)]
    elif kind == "runs-past-the-arena":  # starts inside, its second block is block 2000
        tables[0][0] = (1000, 1)
        tables[1] = [(1999, 2)]
    elif kind == "zero-count":  # an empty extent after the item's last one
        tables[5].append((1500, 0))
    return args_of(offsets, sizes, tables, total)


@pytest.mark.parametrize(
    "kind", ["negative-offset", "negative-start", "past-the-end", "one-whole-block-too-many",
             "runs-past-the-arena", "zero-count"],
)  # fmt: skip
def test_the_vectorised_pass_hands_a_step_with_one_fault_alone_to_the_loop(kind):
    args = one_fault(kind)
    with pytest.raises(PlanError):
        plan.segments_loop(*args)
    assert plan.segments_vectorised(*args) is None


def test_a_step_of_vectorise_from_extents_is_planned_by_the_vectorised_pass(monkeypatch):
    n = planner.VECTORISE_FROM
    step_args = ([i * B for i in range(n)], [B] * n, [[(n - 1 - i, 1)] for i in range(n)])
    kw = dict(block_bytes=B, arena_bytes=n * B, items_bytes=n * B, tile_bytes=2048)
    with monkeypatch.context() as m:
        loop_only(m)
        want = plan_copy(*step_args, **kw)  # the loop's plan

    def loop(*args):
        raise AssertionError("a fragmented step was planned one extent at a time")

    monkeypatch.setattr(planner, "segments_loop", loop)
    monkeypatch.setattr(planner, "segments_small", loop)
    got = plan_copy(*step_args, **kw)
    assert torch.equal(got.table, want.table)


@pytest.mark.parametrize(
    "extent",
    [(2**62, 2**62), (0, 2**62), (2**62, 1), (1, 2**63 - 1), (-(2**63), 1), (2**63, 1)],
    ids=["both-huge", "huge-count", "huge-start", "count-at-int64-max", "start-at-int64-min",
         "start-past-int64"],
)  # fmt: skip
def test_huge_extents_are_refused_never_wrapped(extent):
    """An extent whose blocks times block size, or start plus count, passes int64 must
    be refused, not wrapped into a small or negative number that passes the checks."""
    offsets, sizes, tables, total = edge_step()
    tables = [list(t) for t in tables]
    tables[0].append(extent)
    args = args_of(offsets, sizes, tables, total)
    assert plan.segments_vectorised(*args) is None
    with pytest.raises(PlanError):
        plan.segments_loop(*args)


@pytest.mark.parametrize("entry", [(5, 1, 0), (5,), (5.0, 1), ("5", 1)])
def test_entries_that_are_not_pairs_of_ints_go_to_the_loop(entry):
    offsets, sizes, tables, total = edge_step()
    tables = [list(t) for t in tables]
    tables[3] = [entry]
    assert plan.segments_vectorised(*args_of(offsets, sizes, tables, total)) is None


def test_a_count_whose_end_and_bytes_wrap_int64_is_refused():
    """(1990, 2**63 - 1): start + count wraps to a negative end (sorted first, so the
    disjointness test passes) and count * 4096 wraps to -4096 bytes, which an extra
    whole block in the same item makes up for: every check on wrapped values passes,
    and a segment of -4096 bytes would reach the kernel. Counts are bounded first."""
    n = planner.VECTORISE_FROM + 6
    tables = [[(i, 1)] for i in range(n)]
    tables[0] = [(0, 1), (100, 1), (1990, 2**63 - 1)]
    args = ([i * B for i in range(n)], [B] * n, tables, B, 2000, n * B, 2048, 0, 0)
    assert plan.segments_vectorised(*args) is None
    with pytest.raises(PlanError, match="lists more blocks"):
        plan.segments_loop(*args)


def test_a_start_whose_end_wraps_int64_is_refused():
    """(2**63 - 1, 1) as the highest start: its end wraps to the lowest (so the sorted
    ends still pass) and its arena offset to -4096; starts are bounded first."""
    n = planner.VECTORISE_FROM + 6
    tables = [[(i, 1)] for i in range(n)]
    tables[-1] = [(2**63 - 1, 1)]
    args = ([i * B for i in range(n)], [B] * n, tables, B, 2000, n * B, 2048, 0, 0)
    assert plan.segments_vectorised(*args) is None
    with pytest.raises(PlanError, match="is not inside the arena's blocks"):
        plan.segments_loop(*args)


def test_one_extent_of_the_whole_arena_is_planned_by_the_pass():
    args = ([0], [2000 * B - 1], [[(0, 2000)]], B, 2000, 2000 * B, 2048, 0, 0)
    fast = plan.segments_vectorised(*args)
    assert fast is not None, "a valid step was handed to the loop"
    rows, first_tiles, tiles, vec, total = plan.segments_loop(*args)
    assert fast[0] == rows and list(fast[1]) == list(first_tiles)
    assert fast[2:] == (tiles, vec, total)
