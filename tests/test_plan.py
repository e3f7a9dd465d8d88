import pytest
import torch

from ecoffload.kernels.plan import PlanError, plan_copy

B = 4096


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


def test_base_alignment_limits_access_width():
    assert plan([0], [100], [[(0, 1)]], base_alignment=4).vec_bytes == 4


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
