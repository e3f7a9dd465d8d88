"""empty_items: one allocation, per-item views at 256-byte boundaries, and a layout
unpack uses without asking each tensor for its address."""

import pytest
import torch

from ecoffload.kernels import ItemViews, empty_items, pack, unpack
from ecoffload.kernels import api as kernels_api

B = 4096
SAME = [(torch.bfloat16, (3, 64)), (torch.bfloat16, (0, 64)), (torch.bfloat16, (1, 63)),
        (torch.bfloat16, (7,)), (torch.bfloat16, ())]  # fmt: skip
MIXED = [(torch.float32, (5, 7)), (torch.uint8, (3,)), (torch.float16, (2, 2, 2))]


@pytest.mark.parametrize("specs", [SAME, MIXED], ids=["one-dtype", "mixed-dtypes"])
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


@pytest.mark.parametrize("specs", [SAME, MIXED], ids=["one-dtype", "mixed-dtypes"])
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

    monkeypatch.setattr(kernels_api, "_item_layout", no_layout)
    unpack(arena, tables, B, outputs)
    for got, want in zip(outputs, sources, strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
