import pytest
import torch
from planners import PLANNERS, use_planner

from ecoffload.kernels import PlanError, plan_copy

B = 4096


@pytest.fixture(autouse=True, params=PLANNERS)
def planner(request, monkeypatch):
    """Every test here holds for each pass plan_copy can take: the same plans, the same
    errors (the C pass and the Python passes hand every fault to the loop)."""
    use_planner(monkeypatch, request.param)
    return request.param


def plan(offsets, nbytes, tables, **kw):
    kw.setdefault("block_bytes", B)
    kw.setdefault("arena_bytes", 16 * B)
    kw.setdefault("items_bytes", 1 << 20)
    return plan_copy(offsets, nbytes, tables, **kw)


def test_segments_follow_extents_and_clip_the_last_one():
    p = plan([0, 20000], [10000, 5000], [[(4, 2), (9, 1)], [(0, 2)]], tile_bytes=4096)
    assert p.segments[:, :3].tolist() == [
        [0, 4 * B, 2 * B],
        [2 * B, 9 * B, 10000 - 2 * B],
        [20000, 0, 5000],
    ]
    assert p.nbytes == 15000 and p.vec_bytes == 16
    # tiles: 8192 B -> 2, 1808 B -> 1, 5000 B = 4992 vector bytes (2 tiles) + 8-byte tail (1)
    assert p.segments[:, 3].tolist() == [0, 2, 3]
    assert p.num_tiles == 6


@pytest.mark.parametrize("offset,vec", [(0, 16), (8, 8), (4, 4), (6, 2), (3, 1)])
def test_access_width_follows_the_worst_alignment(offset, vec):
    assert plan([offset], [100], [[(0, 1)]]).vec_bytes == vec


@pytest.mark.parametrize(
    "items_base,arena_base,vec",
    [(0x7F00, 0x1000, 16), (0x7F04, 0x1000, 4), (0x7F00, 0x1002, 2), (0x7F08, 0x1004, 4)],
)
def test_base_addresses_limit_access_width(items_base, arena_base, vec):
    p = plan([0, 256], [100, 100], [[(0, 1)], [(3, 1)]], items_base=items_base,
             arena_base=arena_base)  # fmt: skip
    assert p.vec_bytes == vec


def test_empty_plan():
    p = plan([], [], [])
    assert p.num_segments == 0 and p.num_tiles == 0 and p.segments.dtype == torch.int64


def test_item_outside_items_buffer_is_refused():
    with pytest.raises(PlanError, match="not inside the items buffer"):
        plan([900], [200], [[(0, 1)]], items_bytes=1000)


def test_mismatched_lengths_are_refused():
    with pytest.raises(PlanError, match="one offset and one block table per item"):
        plan([0, 1], [1], [[(0, 1)]])


def test_large_offsets_stay_int64():
    big = 3 << 40  # a 3 TiB items buffer offset: no int32 anywhere
    p = plan([big], [B], [[(1, 1)]], items_bytes=big + B)
    assert p.segments[0, 0] == big and p.segments.dtype == torch.int64


@pytest.mark.parametrize(
    "nbytes,table",
    [
        (100, [(0, 2)]),  # 1 block needed, the only extent has 2
        (B + 1, [(0, 1), (3, 2)]),  # 2 needed, the last extent brings a third
        (2 * B, [(4, 3)]),  # exactly 2 blocks of bytes, 3 given
    ],
    ids=["one-block-item", "multi-extent", "whole-blocks"],
)
def test_last_extent_longer_than_the_item_is_refused(nbytes, table):
    with pytest.raises(PlanError, match="past its end"):
        plan([0], [nbytes], [table])


@pytest.mark.parametrize(
    "nbytes,table",
    [(0, []), (1, [(2, 1)]), (B, [(0, 1)]), (B + 1, [(0, 1), (5, 1)]), (3 * B - 1, [(1, 3)])],
)
def test_exact_coverage_is_accepted(nbytes, table):
    assert plan([0], [nbytes], [table]).nbytes == nbytes


def test_zero_byte_item_with_a_block_is_refused():
    with pytest.raises(PlanError, match="lists more blocks"):
        plan([0], [0], [[(0, 1)]])


@pytest.mark.parametrize("programs", [0, -1])
def test_a_launch_without_programs_is_refused(programs):
    with pytest.raises(PlanError) as caught:  # zero programs would copy nothing, silently
        plan([0], [B], [[(0, 1)]], num_programs=programs)
    assert str(caught.value) == f"num_programs must be positive, got {programs}"


@pytest.mark.parametrize(
    "block_bytes,arena_bytes", [(0, 16 * B), (-B, 16 * B), (B, 16 * B + 1)],
    ids=["zero-blocks", "negative-blocks", "arena-not-whole-blocks"],
)  # fmt: skip
def test_the_block_size_must_be_positive_and_divide_the_arena(block_bytes, arena_bytes):
    with pytest.raises(PlanError) as caught:
        plan([0], [B], [[(0, 1)]], block_bytes=block_bytes, arena_bytes=arena_bytes)
    assert str(caught.value) == (
        f"arena of {arena_bytes} bytes is not a whole number of {block_bytes}-byte blocks"
    )


def test_any_positive_block_size_is_planned_one_byte_blocks_included():
    p = plan([0], [3], [[(5, 3)]], block_bytes=1, arena_bytes=8)
    assert p.segments[:, :3].tolist() == [[0, 5, 3]] and p.nbytes == 3


@pytest.mark.parametrize(
    "offset,nbytes", [(900, 200), (-1, 10), (0, -1)], ids=["past-end", "negative-offset",
                                                          "negative-size"],
)  # fmt: skip
def test_an_item_outside_the_items_buffer_is_refused_by_name(offset, nbytes):
    table = [(0, 1)] if nbytes > 0 else []
    with pytest.raises(PlanError) as caught:
        plan([offset], [nbytes], [table], items_bytes=1000)
    assert str(caught.value) == (
        f"item 0: bytes [{offset}, {offset + nbytes}) are not inside the items buffer of 1000 bytes"
    )


# The loop planner's messages, whole: each says what was expected and what was given.
@pytest.mark.parametrize(
    "nbytes,table,message",
    [
        (B, [(15, 2)], "item 0: extent (15, 2) is not inside the arena's blocks [0, 16); "
                       "block tables must come from this arena's allocator"),
        (0, [(0, 1)], "item 0 has 0 bytes but its block table lists more blocks: a whole "
                      "extent would stay unwritten; give each item exactly its blocks"),
        (B + 1, [(0, 4)], "item 0 has 4097 bytes (2 blocks of 4096) but its extent (0, 4) "
                          "runs 2 block(s) past its end: give each item exactly its blocks"),
        (3 * B, [(0, 2)], "item 0 has 12288 bytes but its block table covers only 8192 "
                          "(2 blocks of 4096)"),
    ],
    ids=["outside-the-arena", "more-blocks-than-bytes", "past-its-end", "covers-only"],
)  # fmt: skip
def test_refusals_name_the_item_the_extent_and_the_numbers(nbytes, table, message):
    with pytest.raises(PlanError) as caught:
        plan([0], [nbytes], [table])
    assert str(caught.value) == message
