"""empty_items: one allocation, per-item views at 256-byte boundaries, and a layout
unpack uses without asking each tensor for its address."""

import pytest
import torch

from ecoffload.kernels import (
    ItemViews,
    PlanError,
    empty_items,
    items,
    native,
    pack,
    planner,
    unpack,
)

B = 4096
SAME = [(torch.bfloat16, (3, 64)), (torch.bfloat16, (0, 64)), (torch.bfloat16, (1, 63)),
        (torch.bfloat16, (7,)), (torch.bfloat16, ())]  # fmt: skip
MIXED = [(torch.float32, (5, 7)), (torch.uint8, (3,)), (torch.float16, (2, 2, 2))]
# One dtype and one row shape: every view from one split_with_sizes of the buffer.
ROWS = [(torch.bfloat16, (2, 128)), (torch.bfloat16, (0, 128)), (torch.bfloat16, (5, 128))]
ROWS_GAPS = [(torch.bfloat16, (3, 64)), (torch.bfloat16, (1, 64)), (torch.bfloat16, (2, 64))]
FLAT = [(torch.bfloat16, (7,)), (torch.bfloat16, (300,)), (torch.bfloat16, (0,)),
        (torch.bfloat16, (128,))]  # fmt: skip
ODD_ROWS = [(torch.float16, (3, 5)), (torch.float16, (2, 5))]  # 256-byte gaps: not whole rows
OTHER_ROWS = [(torch.float32, (3, 4)), (torch.float32, (2, 5))]  # rows of two widths
EMPTY_ROWS = [(torch.float32, (3, 0)), (torch.float32, (2, 0)), (torch.float32, (4, 0))]
STRIDED = [(torch.float32, (2, 3, 4)), (torch.float32, (3, 1)), (torch.float32, (5,))]  # views
CASES = {"one-dtype": SAME, "mixed-dtypes": MIXED, "rows": ROWS, "rows-and-gaps": ROWS_GAPS,
         "one-dim": FLAT, "odd-rows": ODD_ROWS, "other-rows": OTHER_ROWS,
         "empty-rows": EMPTY_ROWS, "three-dims-and-unit-rows": STRIDED}  # fmt: skip


@pytest.fixture(autouse=True)
def no_cached_layouts():
    """Each test lays its specs out afresh (layouts are cached per process)."""
    items._cached_layout.cache_clear()


@pytest.mark.parametrize("specs", CASES.values(), ids=CASES.keys())
def test_views_of_one_buffer_at_aligned_offsets(specs):
    views = empty_items(specs, "cpu")
    assert isinstance(views, ItemViews) and len(views) == len(specs)
    base = views.buffer.data_ptr()
    for view, (dtype, shape), offset, nbytes in zip(
        views, specs, views.offsets, views.nbytes, strict=True
    ):
        assert view.dtype == dtype and tuple(view.shape) == tuple(shape)
        assert view.is_contiguous() and view.nbytes == nbytes
        assert offset % 256 == 0 and (nbytes == 0 or view.data_ptr() == base + offset)
        assert offset + nbytes <= views.buffer.numel()
    ends = [o + n for o, n in zip(views.offsets, views.nbytes, strict=True)]
    assert all(e <= o for e, o in zip(ends, views.offsets[1:], strict=False))  # disjoint


@pytest.mark.parametrize("specs", CASES.values(), ids=CASES.keys())
def test_unpack_into_item_views_is_bit_exact_without_per_tensor_layout(specs, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (torch.Size(s).numel() * d.itemsize,), dtype=torch.uint8,
                             generator=gen).view(d).view(s) for d, s in specs]  # fmt: skip
    tables, block = [], 0
    for t in sources:
        need = -(-t.nbytes // B)
        tables.append([(block, need)] if need else [])
        block += need
    arena = torch.zeros(16 * B, dtype=torch.uint8)
    pack(sources, tables, arena, B)
    outputs = empty_items(specs, "cpu")

    def no_layout(_):
        raise AssertionError("the layout of ItemViews is known: no per-tensor pass")

    monkeypatch.setattr(native, "planner", lambda: None)  # a list: laid out in Python
    monkeypatch.setattr(planner, "python_item_layout", no_layout)
    unpack(arena, tables, B, outputs)
    for got, want in zip(outputs, sources, strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    "specs,split",
    [(ROWS, (2, 0, 5)), (ROWS_GAPS, (3, 1, 1, 1, 2)), (FLAT, (7, 121, 300, 84, 0, 128)),
     (SAME, None), (ODD_ROWS, None), (MIXED, None)],
    ids=["rows", "rows-and-gaps", "one-dim", "scalar-and-mixed-rows", "odd-rows", "mixed-dtypes"],
)  # fmt: skip
def test_one_split_makes_the_views_when_the_rows_allow_it(specs, split):
    """Pieces along dim 0, in rows: each item's rows and the gaps that put the next item
    on a 256-byte boundary; no split when a gap is not whole rows, or shapes differ."""
    layout = items._layout(tuple(specs))
    assert layout.split == split
    if split is not None:
        views = empty_items(specs, "cpu")
        assert [tuple(v.shape) for v in views] == [tuple(s) for _, s in specs]


def test_each_call_gets_its_own_buffer_from_the_cached_layout():
    first, second = empty_items(ROWS, "cpu"), empty_items(ROWS, "cpu")
    assert first.offsets == second.offsets
    assert first.buffer.data_ptr() != second.buffer.data_ptr()
    first[0].fill_(1)
    second[0].fill_(2)
    assert first[0].eq(1).all() and second[0].eq(2).all()


def test_shapes_given_as_lists_are_laid_out_like_tuples():
    as_lists = [(dt, list(shape)) for dt, shape in ROWS_GAPS]
    views, want = empty_items(as_lists, "cpu"), empty_items(ROWS_GAPS, "cpu")
    assert views.offsets == want.offsets and views.nbytes == want.nbytes
    assert [v.shape for v in views] == [w.shape for w in want]


@pytest.mark.parametrize("specs", CASES.values(), ids=CASES.keys())
def test_the_buffer_and_every_view_are_on_the_device_asked_for(specs):
    views = empty_items(specs, "meta")
    assert views.buffer.device.type == "meta"
    assert all(v.device.type == "meta" for v in views)


def test_item_views_on_another_device_are_refused_by_their_buffer():
    """One buffer, one device: its first view stands for all of them."""
    outputs = empty_items(ROWS, "meta")
    arena = torch.zeros(16 * B, dtype=torch.uint8)
    with pytest.raises(PlanError, match="tensor 0 is on meta, expected the arena's device cpu"):
        unpack(arena, [[(0, 1)], [], [(1, 1)]], B, outputs, backend="triton")
    assert not arena.any()
