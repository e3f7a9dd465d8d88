"""The real Triton kernel (interpreted on CPU, compiled with `-m gpu`) against the
torch reference, bit for bit, with poisoned destinations and untouched-block checks."""

import random

import pytest
import torch

from ecoffload.kernels import (
    LaunchConfig,
    PlanError,
    empty_items,
    items,
    pack,
    plan_batch,
    planner,
    reference_pack,
    triton_available,
    unpack,
)
from ecoffload.kernels.block_copy import launch_block_copy

B = 4096
POISON = 0xA5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(
        not triton_available(DEVICE), reason="Triton cannot run here (no CUDA, no TRITON_INTERPRET)"
    ),
]


def random_item(gen, rows, hidden, dtype):
    data = torch.randint(
        0, 256, (rows * hidden * dtype.itemsize,), dtype=torch.uint8, generator=gen
    )
    return data.view(dtype).view(rows, hidden).to(DEVICE)


def allocate(items, num_blocks, *, shuffle, seed=0):
    """Block tables for items, blocks taken in order or shuffled (one extent per block)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    if shuffle:
        rng.shuffle(free)
    tables = []
    for t in items:
        need = -(-t.numel() * t.element_size() // B)
        mine, free = free[:need], free[need:]
        tables.append(coalesce(mine))
    return tables


def coalesce(blocks):
    extents = []
    for b in blocks:
        if extents and extents[-1][0] + extents[-1][1] == b:
            extents[-1] = (extents[-1][0], extents[-1][1] + 1)
        else:
            extents.append((b, 1))
    return extents


def same_bytes(a, b):
    """Bitwise equality (random bytes viewed as floats include NaNs)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def used_blocks(tables):
    return {b for t in tables for s, c in t for b in range(s, s + c)}


SHAPES = {
    "zero-rows": (0, 64, torch.bfloat16),
    "one-row": (1, 64, torch.bfloat16),
    "odd-hidden-bf16": (3, 63, torch.bfloat16),  # 126-byte rows: not a multiple of 16
    "odd-hidden-fp32": (5, 7, torch.float32),  # 28-byte rows
    "bytes-1x1": (1, 1, torch.uint8),
    "many-blocks": (40, 1000, torch.float16),  # 80 000 bytes: 20 blocks
    "exact-block": (2, 1024, torch.float16),  # exactly one block
}


@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
@pytest.mark.parametrize("case", list(SHAPES), ids=list(SHAPES))
def test_round_trip_single_item_shape(case, shuffle):
    rows, hidden, dtype = SHAPES[case]
    gen = torch.Generator().manual_seed(1)
    items = [random_item(gen, rows, hidden, dtype), random_item(gen, 3, 100, torch.bfloat16)]
    check_round_trip(items, num_blocks=64, shuffle=shuffle)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
def test_round_trip_random_batches(seed, shuffle):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
    items = [
        random_item(
            gen, rng.choice([0, 1, 2, 17, 64]), rng.choice([1, 7, 63, 256]), rng.choice(dtypes)
        )
        for _ in range(rng.randint(1, 9))
    ]
    check_round_trip(items, num_blocks=96, shuffle=shuffle, seed=seed)


def check_round_trip(items, *, num_blocks, shuffle, seed=0):
    tables = allocate(items, num_blocks, shuffle=shuffle, seed=seed)
    arena = torch.full((num_blocks * B,), POISON, dtype=torch.uint8, device=DEVICE)
    expected = arena.clone()
    reference_pack(items, tables, expected, B)
    pack(items, tables, arena, B, config=LaunchConfig(num_programs=3, num_warps=4))
    assert torch.equal(arena, expected)
    untouched = sorted(set(range(num_blocks)) - used_blocks(tables))
    for b in untouched:
        assert (arena[b * B : (b + 1) * B] == POISON).all(), f"block {b} outside the tables changed"

    outputs = empty_items([(t.dtype, t.shape) for t in items], DEVICE)
    for out in outputs:
        out.view(torch.uint8).fill_(POISON) if out.numel() else None
    unpack(arena, tables, B, outputs, config=LaunchConfig(num_programs=5, num_warps=4))
    for i, (out, src) in enumerate(zip(outputs, items, strict=True)):
        assert same_bytes(out, src), f"item {i} differs"


def test_unpack_writes_only_the_outputs():
    gen = torch.Generator().manual_seed(3)
    item = random_item(gen, 5, 100, torch.bfloat16)
    arena = torch.zeros(8 * B, dtype=torch.uint8, device=DEVICE)
    pack([item], [[(2, 1)]], arena, B)
    buffer = torch.full((4096,), POISON, dtype=torch.uint8, device=DEVICE)
    out = buffer[512 : 512 + 1000].view(torch.bfloat16).view(5, 100)
    unpack(arena, [[(2, 1)]], B, [out])
    assert same_bytes(out, item)
    assert (buffer[:512] == POISON).all() and (buffer[1512:] == POISON).all()


def test_items_in_separate_allocations_are_addressed_in_place():
    gen = torch.Generator().manual_seed(4)
    items = [random_item(gen, 3, 33, torch.float32), random_item(gen, 2, 9, torch.bfloat16)]
    tables = [[(0, 1)], [(5, 1)]]
    arena = torch.zeros(8 * B, dtype=torch.uint8, device=DEVICE)
    pack(items, tables, arena, B)
    outputs = [torch.full_like(t, 7) for t in items]  # two allocations
    unpack(arena, tables, B, outputs)
    assert all(same_bytes(o, t) for o, t in zip(outputs, items, strict=True))


def test_views_of_one_storage_at_odd_offsets():
    # Items that are views of one buffer at offsets not multiple of 16: narrow accesses.
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen).to(DEVICE)
    items = [base[3:1003], base[1003:4200], base[4200:4201]]
    tables = [[(1, 1)], [(2, 1)], [(0, 1)]]
    arena = torch.full((4 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    expected = arena.clone()
    reference_pack(items, tables, expected, B)
    pack(items, tables, arena, B)
    assert torch.equal(arena, expected)


def test_empty_batch_is_a_no_op():
    arena = torch.full((4 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    pack([], [], arena, B)
    unpack(arena, [], B, [])
    assert (arena == POISON).all()


def test_extents_spanning_several_blocks_and_items_larger_than_a_block():
    gen = torch.Generator().manual_seed(6)
    items = [random_item(gen, 100, 1000, torch.bfloat16)]  # 200 000 bytes: 49 blocks
    tables = [[(50, 20), (3, 29)]]
    check_tables(items, tables, 80)


def check_tables(items, tables, num_blocks):
    arena = torch.full((num_blocks * B,), POISON, dtype=torch.uint8, device=DEVICE)
    expected = arena.clone()
    reference_pack(items, tables, expected, B)
    pack(items, tables, arena, B)
    assert torch.equal(arena, expected)
    outputs = empty_items([(t.dtype, t.shape) for t in items], DEVICE)
    unpack(arena, tables, B, outputs)
    assert all(same_bytes(o, t) for o, t in zip(outputs, items, strict=True))


@pytest.mark.parametrize(
    "sizes,tables,match",
    [
        ([100], [[(7, 2)]], "not inside the arena"),
        ([100], [[(-1, 1)]], "not inside the arena"),
        ([100], [[(0, 0)]], "not inside the arena"),
        ([100, 100], [[(0, 1)], [(0, 1)]], "blocks given twice"),
        ([B + 1, 100], [[(0, 2)], [(1, 1)]], "blocks given twice"),
        ([100], [[]], "covers only 0"),
        ([100], [[(0, 1), (3, 1)]], "a whole extent would stay unwritten"),
        ([100], [[(0, 2)]], "past its end"),
        ([B + 1], [[(0, 1), (3, 2)]], "past its end"),
    ],
    ids=[
        "past-end",
        "negative",
        "empty-extent",
        "duplicate",
        "overlap",
        "too-short",
        "too-long",
        "last-extent-too-long",
        "multi-extent-too-long",
    ],  # fmt: skip
)
def test_bad_tables_are_refused_before_launch(sizes, tables, match):
    items = [torch.ones(n, dtype=torch.uint8, device=DEVICE) for n in sizes]
    arena = torch.full((8 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    for backend in ("triton", "reference"):
        with pytest.raises(PlanError, match=match):
            pack(items, tables, arena, B, backend=backend)
    assert (arena == POISON).all()


def test_non_contiguous_source_is_refused():
    src = torch.zeros(8, 8, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous"):
        pack([src], [[(0, 1)]], torch.zeros(B, dtype=torch.uint8, device=DEVICE), B)


def test_the_first_non_contiguous_tensor_is_named():
    items = [torch.zeros(64, device=DEVICE), torch.zeros(8, 4, device=DEVICE).t(),
             torch.zeros(4, 4, device=DEVICE).t()]  # fmt: skip
    arena = torch.full((4 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(PlanError) as caught:
        pack(items, [[(0, 1)], [(1, 1)], [(2, 1)]], arena, B)
    assert str(caught.value) == (
        "tensor 1 is not contiguous (shape (4, 8), strides (1, 4)): call .contiguous() first"
    )
    assert (arena == POISON).all()


@pytest.mark.parametrize("empty_first", [True, False])
def test_offsets_count_from_the_lowest_non_empty_tensor(empty_first):
    """An empty tensor's address is meaningless (here: below every item's): it is never
    the base, and its offset is 0."""
    buffer = torch.zeros(1000, dtype=torch.uint8, device=DEVICE)
    high, empty, low = buffer[600:700], buffer[0:0], buffer[200:300].view(torch.int16)
    items = [empty, high, low] if empty_first else [high, low, empty]
    base, offsets, sizes, span = planner.item_layout(items)
    assert base.data_ptr() == low.data_ptr() and base.dtype == torch.uint8
    assert base.numel() == low.nbytes and base.is_contiguous()
    want = {id(high): 400, id(empty): 0, id(low): 0}
    assert offsets == [want[id(t)] for t in items]
    assert sizes == [t.nbytes for t in items] and span == 500
    assert planner.item_layout([empty, empty])[0] is None


@pytest.mark.parametrize(
    "shape, strides, dtype",
    [
        ((196, 64), (64, 1), torch.bfloat16),
        ((), (), torch.float32),
        ((4, 1), (1, 7), torch.float32),
        ((3, 0), (1, 1), torch.float16),
        ((2, 3, 4), (12, 4, 1), torch.uint8),
    ],
    ids=["rows", "0-d", "last-dim-1-odd-stride", "empty", "uint8"],
)
def test_the_items_base_is_one_uint8_view_over_the_lowest_item_s_bytes(shape, strides, dtype):
    """The base the kernel counts offsets from is the item's own memory as uint8 (the
    launch reads its address and device only); a shape torch cannot view as bytes in
    place (0-d, a size-1 last dimension of another stride) is flattened first."""
    t = torch.empty_strided(shape, strides, dtype=dtype, device=DEVICE)
    base = items.byte_view_of(t)
    assert (base.dtype, base.data_ptr(), base.numel()) == (torch.uint8, t.data_ptr(), t.nbytes)
    assert base.is_contiguous()


def test_a_launch_takes_a_base_of_any_shape_and_refuses_one_it_cannot_address():
    """A 2-D uint8 base (the engine's view of a (rows, hidden) item) copies like a
    flat one; a base of another dtype or with gaps, or an arena not flat, is refused
    by name before anything runs."""
    item = torch.arange(3 * B // 8, dtype=torch.int32, device=DEVICE).view(-1, 256)
    arena = torch.full((4 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    base, plan = plan_batch([item], [[(1, 2)]], arena, B)
    assert base.dim() == 2
    launch_block_copy(base, arena, plan, to_arena=True, num_warps=4)
    assert torch.equal(arena[B : B + item.nbytes], item.reshape(-1).view(torch.uint8))
    assert (arena[:B] == POISON).all() and (arena[B + item.nbytes :] == POISON).all()
    refused = [
        (item, arena, "items must be a contiguous uint8 tensor, got torch.int32 (6, 256)"),
        (base.t(), arena, "items must be a contiguous uint8 tensor, got torch.uint8 (1024, 6)"),
        (base, arena.view(2, -1),
         f"arena must be a flat contiguous uint8 tensor, got torch.uint8 (2, {2 * B})"),
    ]  # fmt: skip
    for items_base, arena_view, message in refused:
        with pytest.raises(ValueError) as caught:
            launch_block_copy(items_base, arena_view, plan, to_arena=True, num_warps=4)
        assert str(caught.value) == message


def test_tensor_on_another_device_is_refused():
    src = torch.empty(64, dtype=torch.uint8, device="meta")
    arena = torch.full((2 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(PlanError, match="is on meta"):
        pack([src], [[(0, 1)]], arena, B, backend="triton")
    assert (arena == POISON).all()


def test_auto_launches_the_kernel_wherever_triton_runs(monkeypatch):
    """The decision of ``backend="auto"``: the Triton kernel where it can run (CUDA, or
    the interpreter for CPU tensors), never the reference copies."""
    from ecoffload.kernels import api

    launched = []
    real = api.launch_block_copy
    monkeypatch.setattr(
        api, "launch_block_copy", lambda *a, **k: launched.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(api, "reference_pack", lambda *a: pytest.fail("the reference ran"))
    monkeypatch.setattr(api, "reference_unpack", lambda *a: pytest.fail("the reference ran"))
    arena = torch.zeros(4 * B, dtype=torch.uint8, device=DEVICE)
    src = torch.arange(B // 4, dtype=torch.int32, device=DEVICE).view(torch.uint8)
    pack([src], [[(2, 1)]], arena, B, backend="auto")
    out = empty_items([(torch.uint8, (B,))], DEVICE)
    unpack(arena, [[(2, 1)]], B, out, backend="auto")
    assert launched == [1, 1] and torch.equal(out[0], src)
