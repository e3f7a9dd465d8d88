"""The access width against absolute addresses: every segment's source and destination
address (item base + offset, arena base + offset) must be a multiple of the width the
planner picks. The Triton interpreter never faults on a misaligned access; a GPU does,
fatally, so these checks run on addresses, not on copied bytes."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from planners import PLANNERS, use_planner  # noqa: E402

from ecoffload.kernels import api, pack, plan_batch, plan_copy, triton_available, unpack  # noqa: E402

B = 4096
MAX_VEC = 16


def widest(address: int) -> int:
    return min(address & -address, MAX_VEC) if address else MAX_VEC


def check_addresses(plan, items_base: int, arena_base: int) -> None:
    """Every segment address is a multiple of the width, and the width is the widest allowed."""
    allowed, vec = MAX_VEC, plan.vec_bytes
    for item_off, arena_off, _nbytes, _tile in plan.segments.tolist():
        src, dst = items_base + item_off, arena_base + arena_off
        assert src % vec == 0, f"item address {src:#x} is not a multiple of {vec}"
        assert dst % vec == 0, f"arena address {dst:#x} is not a multiple of {vec}"
        allowed = min(allowed, widest(src), widest(dst))
    if plan.num_segments:
        assert plan.vec_bytes == allowed, f"width {plan.vec_bytes}, addresses allow {allowed}"


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 5))
    sizes = [draw(st.integers(0, 3 * B + 7)) for _ in range(n)]
    gaps = [draw(st.integers(0, 40)) for _ in range(n)]
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        at += gap
        offsets.append(at)
        at += size
    tables, block = [], 0
    for size in sizes:
        need = -(-size // B)
        tables.append([(block, need)] if need else [])
        block += need
    return offsets, sizes, tables, at, block


@settings(max_examples=300, deadline=None)
@given(
    layout=layouts(),
    items_base=st.integers(0, 1 << 48),
    arena_base=st.integers(0, 1 << 48),
)
def test_width_divides_every_absolute_address(layout, items_base, arena_base):
    offsets, sizes, tables, span, blocks = layout
    plan = plan_copy(
        offsets, sizes, tables, block_bytes=B, arena_bytes=max(blocks, 1) * B, items_bytes=span,
        items_base=items_base, arena_base=arena_base,
    )  # fmt: skip
    check_addresses(plan, items_base, arena_base)


DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32]


def contiguous_tables(items):
    tables, block = [], 0
    for t in items:
        need = -(-t.nbytes // B)
        tables.append([(block, need)] if need else [])
        block += need
    return tables, block


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    item_elems=st.lists(st.integers(0, 700), min_size=1, max_size=4),
    item_starts=st.lists(st.integers(0, 64), min_size=4, max_size=4),
    arena_start=st.integers(0, 64),
)
def test_views_with_storage_offsets_get_a_width_their_addresses_allow(
    dtype, item_elems, item_starts, arena_start
):
    """Items and the arena as views with storage offsets, planned as pack/unpack plan."""
    storage = torch.zeros(8 * B, dtype=dtype)
    items, at = [], 0
    for elems, start in zip(item_elems, item_starts, strict=False):
        at += start
        items.append(storage[at : at + elems])
        at += elems
    tables, blocks = contiguous_tables(items)
    arena = torch.zeros((blocks + 1) * B + arena_start, dtype=torch.uint8)[arena_start:]
    base, plan = plan_batch(items, tables, arena, B)
    check_addresses(plan, base.data_ptr() if base is not None else 0, arena.data_ptr())


def test_bf16_view_one_element_in_gets_at_most_2_byte_accesses():
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    item = buf[1:]  # 2 bytes past a 64-byte-aligned allocation
    arena = torch.zeros(4 * B, dtype=torch.uint8)
    base, plan = plan_batch([item], [[(0, 2)]], arena, B)
    assert plan.vec_bytes <= 2
    check_addresses(plan, base.data_ptr(), arena.data_ptr())


def test_arena_view_with_storage_offset_limits_the_width():
    item = torch.zeros(1000, dtype=torch.float32)  # 16-byte aligned allocation
    arena = torch.zeros(4 * B + 4, dtype=torch.uint8)[4:]  # a 4-byte-aligned arena view
    base, plan = plan_batch([item], [[(0, 1)]], arena, B)
    assert plan.vec_bytes <= 4
    check_addresses(plan, base.data_ptr(), arena.data_ptr())


class Recorder:
    """Stands in for the launcher: records what a real launch would have been given."""

    def __init__(self):
        self.calls = []

    def __call__(self, items, arena, plan, **kw):
        self.calls.append((items.data_ptr(), arena.data_ptr(), plan))


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("to_arena", [True, False], ids=["pack", "unpack"])
def test_the_launch_gets_the_width_of_its_own_addresses(to_arena):
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    items = [buf[1:1001], buf[1003:2000]]
    arena = torch.zeros(4 * B + 8, dtype=torch.uint8)[8:]
    tables, _ = contiguous_tables(items)
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "launch_block_copy", recorder)
        if to_arena:
            pack(items, tables, arena, B, backend="triton")
        else:
            unpack(arena, tables, B, items, backend="triton")
    ((items_base, arena_base, plan),) = recorder.calls
    assert items_base == items[0].data_ptr() and plan.vec_bytes == 2
    check_addresses(plan, items_base, arena_base)


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("side", ["items", "arena"])
def test_the_width_comes_from_base_plus_offset_not_each_alone(side, planner, monkeypatch):
    """base 4 + offsets 16k+4 are addresses 16k+8: 8-byte accesses, not 16 (the width
    comes from base + offset, never from base and offset separately)."""
    n = 128  # one-extent items
    use_planner(monkeypatch, planner)
    if side == "items":  # items at 16k+4 of a buffer at 4
        kw = dict(block_bytes=B, arena_bytes=n * B, items_base=4, arena_base=0)
        offsets, tables = [16 * k + 4 for k in range(n)], [[(k, 1)] for k in range(n)]
    else:  # 4-byte blocks 4k+1 of an arena at 4
        kw = dict(block_bytes=4, arena_bytes=4 * 4 * n, items_base=0, arena_base=4)
        offsets, tables = [16 * k for k in range(n)], [[(4 * k + 1, 1)] for k in range(n)]
    p = plan_copy(offsets, [4] * n, tables, items_bytes=16 * n + 8, **kw)
    assert p.vec_bytes == 8
    check_addresses(p, kw["items_base"], kw["arena_base"])
