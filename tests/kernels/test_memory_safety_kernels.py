"""No table, size or launch parameter makes pack/unpack address outside the buffers given.

Each test feeds one hostile input to a public entry point (pack, unpack,
plan_copy, StepTable's constructors and unpickling) and checks that it is
refused with a PlanError and, where a kernel could run, that poison around the
output is untouched. Both planner passes run each: the C pass where it is
built, and the Python passes (``native.planner`` answering None).
"""

import pickle
import re

import numpy as np
import pytest
import torch

from ecoffload.kernels import ItemViews, LaunchConfig, PlanError, native, pack, plan_copy, unpack
from ecoffload.kernels import api as kernels_api
from ecoffload.kernels.api import plan_batch, triton_available
from ecoffload.kernels.block_copy import launch_block_copy
from ecoffload.kernels.plan import CopyPlan
from ecoffload.kernels.step_table import StepTable

B = 4096
POISON = 0xA5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=["c-pass", "python"])
def passes(request, monkeypatch):
    """The planner's C pass (where built) or the Python passes alone."""
    if request.param == "python":
        monkeypatch.setattr(native, "planner", lambda: None)
    elif native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    return request.param


def poisoned(nbytes: int, pad: int = 2 * B) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, output): ``nbytes`` bytes inside a buffer poisoned ``pad`` bytes either side."""
    buf = torch.full((pad + nbytes + pad,), POISON, dtype=torch.uint8, device=DEVICE)
    return buf, buf[pad : pad + nbytes]


def assert_poison_intact(buf: torch.Tensor, nbytes: int, pad: int = 2 * B) -> None:
    outside = torch.cat([buf[:pad], buf[pad + nbytes :]]).cpu()
    written = int((outside != POISON).sum())
    assert written == 0, f"{written} bytes written outside the output"


def uncovering_step() -> StepTable:
    """One item of one block whose bounds start at 1: extent 0 belongs to no item (the
    table the issue's unpack wrote 4 KiB past its output with)."""
    extents = np.array([[0, 1], [1, 1]], np.int64)
    step = StepTable.from_tables([[(0, 1)], [(1, 1)]])  # a valid table, then its bounds
    step.bounds = np.array([1, 2], np.int64)  # the arrays are mutable: planned as found
    step.extents = extents
    return step


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("direction", ["unpack", "pack"])
def test_a_step_table_whose_bounds_do_not_cover_its_extents_writes_nothing(
    passes, backend, direction
):
    if backend == "triton" and not triton_available(DEVICE):
        pytest.skip("Triton cannot run here")
    arena = torch.arange(4 * B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    arena_before = arena.clone()
    buf, out = poisoned(B)
    with pytest.raises(PlanError, match="bounds must run from 0 to the 2 extents"):
        if direction == "unpack":
            unpack(arena, uncovering_step(), B, [out], backend=backend)
        else:
            pack([out], uncovering_step(), arena, B, backend=backend)
    assert_poison_intact(buf, B)
    assert (out == POISON).all() and torch.equal(arena, arena_before)


@pytest.mark.parametrize(
    "bounds", [[1, 2], [0, 1], [0, 3], [0, 2, 1, 2], [0, 1, 0, 2], []],
    ids=["not-from-0", "short", "past", "down", "down-to-0", "none"],
)  # fmt: skip
def test_every_way_to_make_a_step_table_checks_its_bounds(bounds):
    extents = np.array([[0, 1], [1, 1]], np.int64)
    bounds = np.array(bounds, np.int64)
    with pytest.raises(PlanError, match="bounds must"):
        StepTable(extents, bounds)
    with pytest.raises(PlanError, match="bounds must"):
        StepTable._made(extents, bounds)
    good = StepTable(extents, np.array([0, 2], np.int64))
    good.bounds = bounds
    wire = pickle.dumps(good)  # what a scheduler with a bug (or a stranger) would send
    with pytest.raises(PlanError, match="bounds must"):
        pickle.loads(wire)


@pytest.mark.parametrize(
    "extents", [np.zeros(4, np.int64), np.zeros((2, 3), np.int64), np.zeros((2, 2), np.int32),
                np.zeros((2, 2), ">i8"), np.zeros((4, 2), np.int64)[::2], [[0, 1], [1, 1]]],
    ids=["flat", "three-columns", "int32", "big-endian", "strided", "a-list"],
)  # fmt: skip
def test_step_arrays_the_c_pass_cannot_read_are_refused_by_both_passes(passes, extents):
    step = StepTable.from_tables([[(0, 1)], [(1, 1)]])
    step.extents = extents
    with pytest.raises(PlanError, match="a step table's extents must be a C-contiguous"):
        plan_copy([0, B], [B, B], step, block_bytes=B, arena_bytes=4 * B, items_bytes=2 * B)
    c_pass = native.load() if passes == "c-pass" else None
    if c_pass is not None:  # directly: what it would plan, were it asked
        got = c_pass.plan_step([0, B], [B, B], extents, step.bounds, B, 4 * B, 2 * B, 1024, 0,
                               0, 1)  # fmt: skip
        assert got is None


@pytest.mark.parametrize("tile_bytes", [0, -1, -16384])
@pytest.mark.parametrize("shape", ["few", "fragmented", "step-table"])
def test_tile_bytes_that_are_not_positive_are_refused_in_every_pass(passes, tile_bytes, shape):
    n = 1 if shape == "few" else 200  # >= VECTORISE_FROM extents: the numpy pass
    tables = [[(2 * k, 1) for k in range(n)]]
    if shape == "step-table":
        tables = StepTable.from_tables(tables)
    with pytest.raises(PlanError, match=f"tile_bytes must be positive, got {tile_bytes}"):
        plan_copy([0], [n * B], tables, block_bytes=B, arena_bytes=2 * n * B, items_bytes=n * B,
                  tile_bytes=tile_bytes)  # fmt: skip


def test_a_launch_config_with_no_tile_bytes_is_refused_before_any_copy(passes):
    arena = torch.zeros(4 * B, dtype=torch.uint8, device=DEVICE)
    buf, out = poisoned(B)
    with pytest.raises(PlanError, match="tile_bytes must be positive, got 0"):
        unpack(arena, [[(0, 1)]], B, [out], config=LaunchConfig(4, 4, tile_bytes=0))
    assert (buf == POISON).all()


def test_a_negative_arena_is_refused_by_both_passes(passes):
    with pytest.raises(PlanError, match="arena_bytes must not be negative"):
        plan_copy([0], [0], [[]], block_bytes=B, arena_bytes=-B, items_bytes=0)


class Boastful(torch.Tensor):
    """A tensor that says it holds twice its bytes (an ``nbytes`` property)."""

    @property
    def nbytes(self):
        return 2 * torch.Tensor.nbytes.__get__(self)


class Deceiving(torch.Tensor):
    """A tensor whose ``__torch_function__`` answers twice its bytes and an address a
    block past its own, through any accessor (torch.Tensor's own included)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        got = super().__torch_function__(func, types, args, kwargs or {})
        if getattr(func, "__self__", None) is torch.Tensor.nbytes or func is torch.Tensor.numel:
            return 2 * got  # the nbytes getter (a method-wrapper of its descriptor), numel
        if func is torch.Tensor.data_ptr:
            return got + B
        return got


@pytest.mark.parametrize("liar", [Boastful, Deceiving])
@pytest.mark.parametrize("direction", ["unpack", "pack"])
@pytest.mark.kernel
def test_a_tensor_that_lies_about_its_size_is_measured_by_torch_itself(passes, liar, direction):
    if not triton_available(DEVICE):
        pytest.skip("Triton cannot run here")
    backend = "triton"
    arena = torch.arange(4 * B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    arena_before = arena.clone()
    buf, out = poisoned(B)
    item = out.as_subclass(liar)  # the same memory: B bytes, claiming 2 B
    with pytest.raises(PlanError, match="runs 1 block"):
        if direction == "unpack":
            unpack(arena, [[(0, 2)]], B, [item], backend=backend)
        else:
            pack([item], [[(0, 2)]], arena, B, backend=backend)
    assert_poison_intact(buf, B)
    assert torch.equal(arena, arena_before)
    # The truth is planned as usual: a subclass is no error, its lie is.
    unpack(arena, [[(1, 1)]], B, [item], backend=backend)
    assert torch.equal(out, arena_before[B : 2 * B]) and (buf[: 2 * B] == POISON).all()
    assert_poison_intact(buf, B)


def test_the_c_layout_leaves_subclasses_and_modes_to_torch(passes):
    if passes != "c-pass":
        pytest.skip("the C item layout")
    c_pass = native.load()
    plain = torch.zeros(16, dtype=torch.uint8)
    assert c_pass.item_layout([plain]) is not None
    assert c_pass.item_layout([plain.as_subclass(Boastful)]) is None
    assert c_pass.item_layout([plain.as_subclass(Deceiving)]) is None

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert c_pass.item_layout([plain]) is None


def test_a_tile_as_large_as_int64_plans_alike_in_every_pass(passes):
    """The numpy pass counted tiles as ``(take + tile_bytes - 1) // tile_bytes``: int64
    wrapped and every segment got -1 tiles (the differential fuzzer's find)."""
    step = StepTable.from_tables([[(0, 1)], [(2, 1)]])
    got = plan_copy([0, B], [B, 100], step, block_bytes=B, arena_bytes=4 * B,
                    items_bytes=2 * B, tile_bytes=2**63 - 1, num_programs=4)  # fmt: skip
    assert got.num_tiles == 3 and got.segments[:, 3].tolist() == [0, 1]  # 100 = 96 + a tail


@pytest.mark.parametrize("name", ["items_bytes", "arena_bytes"])
def test_buffers_past_int64_are_refused_not_overflowed(passes, name):
    kw = {"block_bytes": B, "arena_bytes": 4 * B, "items_bytes": 2 * B, name: 2**63 + B}
    with pytest.raises(PlanError, match="past int64"):
        plan_copy([2**63 - 1], [B], [[(0, 1)]], **kw)


def test_tables_of_ints_past_int64_are_a_plan_error():
    with pytest.raises(PlanError, match=r"\(start, count\) pairs of int64s"):
        StepTable.from_tables([[(0, 2**63)]])


@pytest.mark.kernel
def test_an_item_views_buffer_that_lies_about_its_size_is_measured_by_torch(passes):
    if not triton_available(DEVICE):
        pytest.skip("Triton cannot run here")
    arena = torch.arange(4 * B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    buf, out = poisoned(B)
    views = ItemViews([out], out.as_subclass(Deceiving), [0], [2 * B])  # B bytes, claims 2 B
    with pytest.raises(PlanError, match=r"bytes \[0, 8192\) are not inside the items buffer"):
        unpack(arena, [[(0, 2)]], B, views, backend="triton")
    assert_poison_intact(buf, B)
    with pytest.raises(PlanError, match="the ItemViews' buffer must be a contiguous tensor"):
        unpack(arena, [[(0, 1)]], B, ItemViews([out], "not a tensor", [0], [B]))


# --- launch_block_copy: a plan it is handed, against the buffers it is given -----------


def _kernel_here() -> None:
    if not triton_available(DEVICE):
        pytest.skip("Triton cannot run here")


@pytest.mark.kernel
@pytest.mark.parametrize("direction", ["unpack", "pack"])
def test_a_launch_refuses_a_plan_made_for_a_larger_arena(direction):
    """A plan made for 4 blocks, launched on an arena of 2 (a view of a poisoned
    buffer): refused by name before anything runs (it wrote past the arena)."""
    _kernel_here()
    item = torch.full((B,), 7, dtype=torch.uint8, device=DEVICE)
    big = torch.zeros(4 * B, dtype=torch.uint8, device=DEVICE)
    base, plan = plan_batch([item], [[(3, 1)]], big, B)
    buf, arena = poisoned(2 * B)
    with pytest.raises(ValueError) as caught:
        launch_block_copy(base, arena, plan, to_arena=direction == "pack", num_warps=4)
    assert str(caught.value) == (
        f"the plan addresses the arena's bytes up to offset {4 * B}, the arena given holds "
        f"{2 * B}: plan the copy against this arena (plan_batch)"
    )
    assert_poison_intact(buf, 2 * B)
    assert (arena == POISON).all() and (item == 7).all()


@pytest.mark.kernel
@pytest.mark.parametrize("direction", ["unpack", "pack"])
def test_a_launch_refuses_a_plan_whose_items_reach_past_the_items_memory(direction):
    """A plan for two items' span launched with a base of one item (a view of a poisoned
    buffer; no ``items_bytes`` vouching for the rest): refused (unpack wrote past it)."""
    _kernel_here()
    arena = torch.arange(4 * B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    arena_before = arena.clone()
    items = torch.zeros(2 * B, dtype=torch.uint8, device=DEVICE)
    _, plan = plan_batch([items[:B], items[B:]], [[(0, 1)], [(1, 1)]], arena, B)
    buf, out = poisoned(B)
    with pytest.raises(ValueError) as caught:
        launch_block_copy(out, arena, plan, to_arena=direction == "pack", num_warps=4)
    assert str(caught.value) == (
        f"the plan addresses the items' bytes up to offset {2 * B} from the base, which "
        f"holds {B} from there: pass items_bytes= for a batch of several tensors "
        "(their span from the base), or plan the copy for these items (plan_batch)"
    )
    assert_poison_intact(buf, B)
    assert (out == POISON).all() and torch.equal(arena, arena_before)
    launch_block_copy(out, arena, plan._replace(num_programs=0), to_arena=False, num_warps=4)


def _hand_made(rows: list[int], programs: list[int], vec: int = 1, tile: int = 64) -> CopyPlan:
    """A CopyPlan built by hand (no planner's bounds recorded): its table is checked."""
    table = torch.tensor(rows + programs, dtype=torch.int64)
    segs = len(rows) // 4
    tiles = 0
    for k in range(segs):
        n = rows[4 * k + 2]
        tiles = rows[4 * k + 3] + -(-(n // vec * vec) // max(tile, 1)) + (n % vec != 0)
    return CopyPlan(table, segs, len(programs) // 3, vec, tile, tiles, sum(rows[2::4]))


HAND_MADE = {  # a hand-made plan, and what its check says
    "arena-offset-past": ([0, 2 * B - 8, 16, 0], [0, 0, 1], "arena's bytes up to offset 8200"),
    "negative-item-offset": ([-64, 0, 16, 0], [0, 0, 1], "a segment with a negative offset or"),
    "negative-size": ([0, 0, -1, 0], [0, 0, 1], "a segment with a negative offset or"),
    "program-past-the-tiles": ([0, 0, 16, 0], [0, 0, 5], "program 0 runs tiles [0, 5) of"),
    "program-first-segment-past": ([0, 0, 16, 0], [1, 0, 1], "program 0 starts at segment 1 of"),
    "first-tiles-out-of-order": ([0, 0, 16, 0, 16, 16, 16, 0], [0, 0, 2], "first tiles"),
    "table-short": ([0, 0, 16, 0], [0, 0], "table holds 6 numbers"),
}


@pytest.mark.kernel
@pytest.mark.parametrize("case", list(HAND_MADE))
def test_a_hand_made_plan_that_would_address_outside_the_buffers_is_refused(case):
    _kernel_here()
    rows, programs, message = HAND_MADE[case]
    plan = _hand_made(rows, programs)
    if case == "table-short":
        plan = plan._replace(num_programs=1)
    buf, arena = poisoned(2 * B)
    items = torch.full((B,), 7, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape(message)):
        launch_block_copy(items, arena, plan, to_arena=True, num_warps=4)
    assert_poison_intact(buf, 2 * B)
    assert (arena == POISON).all()


@pytest.mark.kernel
def test_a_hand_made_plan_within_the_buffers_copies():
    _kernel_here()
    plan = _hand_made([0, B, 100, 0, 200, 3 * B, 30, 2], [0, 0, 1, 0, 1, 3])
    items = torch.arange(B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    buf, arena = poisoned(4 * B)
    launch_block_copy(items, arena, plan, to_arena=True, num_warps=4)
    assert torch.equal(arena[B : B + 100], items[:100])
    assert torch.equal(arena[3 * B : 3 * B + 30], items[200:230])
    assert_poison_intact(buf, 4 * B)


# --- pack / unpack's own refusals and paths, whole (mutants of issue 30's api.py) ------


def test_pack_and_unpack_refusals_name_what_is_wrong(monkeypatch):
    item = torch.zeros(B, dtype=torch.uint8)
    arena = torch.zeros(4 * B, dtype=torch.uint8)
    cases = [
        (lambda: pack([item], [[(0, 1)], [(1, 1)]], arena, B),
         "expected one block table per tensor, got 2 for 1"),
        (lambda: pack([item], [[(0, 1)]], torch.zeros(4 * B // 8, dtype=torch.int64), B),
         f"arena must be a flat uint8 tensor, got torch.int64 ({4 * B // 8},)"),
        (lambda: pack([item], [[(0, 1)]], arena.view(4, B), B),
         f"arena must be a flat uint8 tensor, got torch.uint8 (4, {B})"),
        (lambda: pack([item], [[(0, 1)]], arena, B, backend="cuda"),
         "backend must be 'auto', 'triton' or 'reference', got 'cuda'"),
        (lambda: unpack(arena, [[(0, 1)]], B, ItemViews([item], "not a tensor", [0], [B])),
         "the ItemViews' buffer must be a contiguous tensor, got str"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(PlanError) as caught:
            call()
        assert str(caught.value) == message
    monkeypatch.setattr(kernels_api, "triton_available", lambda device: False)
    with pytest.raises(PlanError) as caught:
        pack([item], [[(0, 1)]], arena, B, backend="triton")
    assert str(caught.value) == (
        "the Triton kernel cannot run on cpu here (CUDA needed, or TRITON_INTERPRET=1 set "
        "before importing ecoffload for CPU tensors); use backend='reference'"
    )


@pytest.mark.parametrize("backend", ["reference", "auto-without-triton"])
def test_the_reference_backend_packs_and_unpacks_bit_for_bit(monkeypatch, backend):
    if backend != "reference":  # "auto" where Triton cannot run picks the reference copy
        monkeypatch.setattr(kernels_api, "triton_available", lambda device: False)
    chosen = "reference" if backend == "reference" else "auto"
    items = [torch.arange(n, dtype=torch.int64).to(torch.uint8) for n in (100, B + 7, 1)]
    tables = [[(3, 1)], [(0, 1), (5, 1)], [(7, 1)]]
    arena = torch.full((8 * B,), POISON, dtype=torch.uint8)
    pack(items, tables, arena, B, backend=chosen)
    assert torch.equal(arena[3 * B : 3 * B + 100], items[0])
    assert torch.equal(arena[:B], items[1][:B]) and torch.equal(
        arena[5 * B : 5 * B + 7], items[1][B:]
    )
    assert arena[7 * B] == items[2][0] and (arena[B : 3 * B] == POISON).all()
    outs = [torch.full_like(t, POISON) for t in items]
    unpack(arena, tables, B, outs, backend=chosen)
    assert all(torch.equal(o, t) for o, t in zip(outs, items, strict=True))


@pytest.mark.kernel
def test_every_tensor_of_a_batch_is_checked_for_the_arena_s_device():
    _kernel_here()
    arena = torch.zeros(4 * B, dtype=torch.uint8, device=DEVICE)
    items = [torch.zeros(B, dtype=torch.uint8, device=DEVICE),
             torch.zeros(B, dtype=torch.uint8, device="meta")]  # fmt: skip
    with pytest.raises(
        PlanError, match=f"tensor 1 is on meta, expected the arena's device {DEVICE}"
    ):
        pack(items, [[(0, 1)], [(1, 1)]], arena, B, backend="triton")


@pytest.mark.parametrize("side", ["items", "arena"])
def test_the_python_passes_plan_the_access_width_from_absolute_addresses(side):
    """Where the C planner is not asked (the copy-engine split), the plan's width still
    divides every absolute address: a base one byte off gives width 1."""
    buf = torch.zeros(8 * B + 16, dtype=torch.uint8)
    item = buf[1 : 1 + 64] if side == "items" else buf[:64]
    arena = buf[16 : 16 + 4 * B] if side == "items" else buf[1 : 1 + 4 * B]
    config = LaunchConfig(num_programs=1, num_warps=4, dma_min_bytes=1 << 30)
    base, plan = plan_batch([item], [[(1, 1)]], arena, B, config=config)
    assert base.data_ptr() == item.data_ptr() and plan.vec_bytes == 1
    aligned = LaunchConfig(num_programs=1, num_warps=4, dma_min_bytes=1 << 30)
    _, wide = plan_batch([buf[:64]], [[(1, 1)]], buf[: 4 * B], B, config=aligned)
    assert wide.vec_bytes == 16


@pytest.mark.parametrize("planner", ["c-pass", "python"])
def test_a_batch_of_empty_tensors_plans_nothing_whichever_pass(monkeypatch, planner):
    if planner == "python":
        monkeypatch.setattr(native, "planner", lambda: None)
    arena = torch.full((2 * B,), POISON, dtype=torch.uint8)
    empty = [torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 3)]
    for config in (LaunchConfig(num_programs=1, num_warps=4),
                   LaunchConfig(num_programs=1, num_warps=4, dma_min_bytes=1 << 30)):  # fmt: skip
        base, plan = plan_batch(empty, [[], []], arena, B, config=config)
        assert base is None and plan.num_segments == 0 and plan.nbytes == 0
    pack(empty, [[], []], arena, B, backend="reference")
    assert (arena == POISON).all()


class Honest(torch.Tensor):
    """A tensor subclass that changes nothing."""


@pytest.mark.kernel
def test_an_item_views_buffer_of_a_subclass_is_copied_through_a_plain_view():
    _kernel_here()
    arena = torch.arange(4 * B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    buf, data = poisoned(2 * B)
    views = ItemViews([data[:B], data[B:]], data.as_subclass(Honest), [0, B], [B, B])
    unpack(arena, [[(2, 1)], [(0, 1)]], B, views, backend="triton")  # ItemViews kept whole
    assert torch.equal(data[:B], arena[2 * B : 3 * B]) and torch.equal(data[B:], arena[:B])
    assert_poison_intact(buf, 2 * B)


def test_an_item_views_buffer_is_the_launch_base_as_it_is_unless_a_subclass():
    """The decision, whatever the backend: a plain buffer is the base itself (no view
    made, no Python per step); a subclass's buffer is replaced by a plain view of it,
    whose address no ``__torch_function__`` can answer."""
    arena = torch.zeros(4 * B, dtype=torch.uint8)
    data = torch.zeros(2 * B, dtype=torch.uint8)
    plain = ItemViews([data[:B], data[B:]], data, [0, B], [B, B])
    base, _ = plan_batch(plain, [[(2, 1)], [(0, 1)]], arena, B)
    assert base is data
    sub = ItemViews([data[:B], data[B:]], data.as_subclass(Honest), [0, B], [B, B])
    base, _ = plan_batch(sub, [[(2, 1)], [(0, 1)]], arena, B)
    assert type(base) is torch.Tensor and base.data_ptr() == data.data_ptr()


# --- plan_reach: a hand-made plan's table, number by number ----------------------------


def _reach(rows, programs, vec=1, tile=64, items_base=0, arena_base=0, table_size=None):
    from ecoffload.kernels.block_copy import plan_reach

    plan = _hand_made(rows, programs, vec, tile)
    if table_size is not None:
        plan = plan._replace(table=plan.table[:table_size])
    return plan_reach(plan, items_base, arena_base)


def test_plan_reach_of_valid_hand_made_plans():
    assert _reach([], [0, 0, 0]) == (0, 0)  # no segment: an empty program
    assert _reach([], [5, 0, 0]) == (0, 0)  # an empty program names no segment
    # three segments, a 16-byte width, tails (100 = 6 * 16 + 4), tile 64: tiles 0-2, 3-4, 5
    rows = [0, 4096, 100, 0, 112, 8192, 80, 3, 208, 48, 16, 5]
    assert _reach(rows, [0, 0, 3, 1, 3, 6], vec=16) == (224, 8272)
    assert _reach(rows, [0, 0, 6], vec=16, items_base=32, arena_base=4096) == (224, 8272)
    assert _reach([0, 0, 10, 0], [0, 0, 10], tile=1) == (10, 10)  # one-byte tiles


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (dict(rows=[0, 0, 16, 0, 16, 16, 16, 1], programs=[0, 0, 2], table_size=10),
         "a plan of 2 segments and 1 programs (width 1, tile 64 bytes) whose table holds 10 "
         "numbers: expected 11, a width of (1, 2, 4, 8, 16) dividing the tile: use plan_copy "
         "or plan_batch"),
        (dict(rows=[0, 0, 16, 0], programs=[0, 0, 1], tile=0),
         "a plan of 1 segments and 1 programs (width 1, tile 0 bytes) whose table holds 7 "
         "numbers: expected 7, a width of (1, 2, 4, 8, 16) dividing the tile: use plan_copy "
         "or plan_batch"),
        (dict(rows=[0, 0, 16, 0], programs=[0, 0, 1], vec=16, tile=24), "(width 16, tile 24"),
        (dict(rows=[0, 0, 16, 0], programs=[0, 0, 1], vec=3, tile=64), "(width 3, tile 64"),
        (dict(rows=[0, -16, 16, 0], programs=[0, 0, 1]),
         "a segment with a negative offset or size: use plan_copy or plan_batch"),
        (dict(rows=[0, 0, 16, 1], programs=[0, 1, 2]),
         "segment rows whose first tiles do not follow each other from 0: use plan_copy or "
         "plan_batch"),
        (dict(rows=[0, 0, 16, 0, 16, 16, 16, 1, 32, 32, 16, 3], programs=[0, 0, 4]),
         "segment rows whose first tiles do not follow each other from 0"),
        (dict(rows=[0, 0, 16, 0], programs=[0, 0, 0, 7, 0, 1]),
         "program 1 starts at segment 7 of 1: use plan_copy"),
        (dict(rows=[0, 0, 128, 0, 128, 128, 16, 2], programs=[0, 2, 3]),
         "program 0 runs tiles [2, 3) of 3, from segment 0's [0, 2): use plan_copy"),
        (dict(rows=[4, 0, 16, 0], programs=[0, 0, 1], vec=16, tile=64, items_base=4),
         "a segment whose address the width 16 does not divide: use plan_copy"),
        (dict(rows=[0, 4, 16, 0], programs=[0, 0, 1], vec=16, tile=64, arena_base=4),
         "a segment whose address the width 16 does not divide: use plan_copy"),
        (dict(rows=[1, 0, 16, 0], programs=[0, 0, 1], vec=16, tile=64),
         "a segment whose address the width 16 does not divide"),
    ],
    ids=["table-size", "tile-0", "tile-not-a-multiple", "width-3", "negative-arena-offset",
         "first-tile-not-0", "third-segment-out-of-order", "empty-then-bad-program",
         "program-begins-past-its-segment", "items-base-misaligned", "arena-base-misaligned",
         "item-offset-misaligned"],
)  # fmt: skip
def test_plan_reach_refuses_a_table_the_kernel_would_walk_outside_of(case, message):
    with pytest.raises(ValueError) as caught:
        _reach(**case)
    if message.endswith(("use plan_copy", "use plan_copy or plan_batch")):  # the whole of it
        assert str(caught.value) == message
    else:
        assert message in str(caught.value)


def test_a_launch_names_bad_devices_and_warps_and_checks_a_half_recorded_plan():
    item = torch.zeros(B, dtype=torch.uint8)
    arena = torch.zeros(4 * B, dtype=torch.uint8)
    _, plan = plan_batch([item], [[(1, 1)]], arena, B)
    meta = torch.zeros(4 * B, dtype=torch.uint8, device="meta")
    for kwargs, message in (
        (dict(items=item, arena=meta, num_warps=4),
         "items are on cpu but the arena is on meta"),
        (dict(items=item, arena=arena, num_warps=0), "num_warps must be positive, got 0"),
    ):  # fmt: skip
        with pytest.raises(ValueError) as caught:
            launch_block_copy(plan=plan, to_arena=True, **kwargs)
        assert str(caught.value) == message
    bad = _hand_made([0, 8 * B, 16, 0], [0, 0, 1])._replace(arena_bytes=4 * B)  # items: -1
    with pytest.raises(ValueError, match="arena's bytes up to offset 32784"):
        launch_block_copy(item, arena, bad, to_arena=True, num_warps=4)
    bad = _hand_made([0, 8 * B, 16, 0], [0, 0, 1])._replace(items_bytes=B)  # arena: -1
    with pytest.raises(ValueError, match="arena's bytes up to offset 32784"):
        launch_block_copy(item, arena, bad, to_arena=True, num_warps=4)


@pytest.mark.kernel
def test_a_launch_of_one_warp_runs():
    _kernel_here()
    item = torch.arange(B, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    buf, arena = poisoned(4 * B)
    base, plan = plan_batch([item], [[(1, 1)]], arena, B)
    launch_block_copy(base, arena, plan, to_arena=True, num_warps=1, items_bytes=B)
    assert torch.equal(arena[B : 2 * B], item)
    assert_poison_intact(buf, 4 * B)


# --- plan_copy's own checks and defaults, whole (mutants of issue 30's plan.py) --------


def test_a_step_table_is_planned_by_the_c_pass_alone(monkeypatch):
    """With the C pass loaded, a StepTable is planned in C, its arrays read through the
    buffer protocol: no Python pass runs (they would give the same plan, slower)."""
    from ecoffload.kernels import planner as plan_module

    if native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    step = StepTable.from_tables([[(2, 1)], [(0, 2)]])
    kw = dict(block_bytes=B, arena_bytes=4 * B, items_bytes=3 * B, tile_bytes=1024,
              items_base=4096, arena_base=8192, num_programs=3)  # fmt: skip
    want = plan_copy([0, B], [B, 2 * B], step, **kw)
    for name in ("segments_arrays", "segments_vectorised", "segments_small", "segments_loop"):
        monkeypatch.setattr(plan_module, name, lambda *a: pytest.fail("planned in Python"))
    got = plan_copy([0, B], [B, 2 * B], step, **kw)
    assert got.table.tolist() == want.table.tolist() and got[1:] == want[1:]
    assert (got.num_segments, got.num_programs, got.tile_bytes, got.nbytes) == (2, 3, 1024, 3 * B)


def test_plan_copy_s_defaults_and_edges_in_the_python_passes(monkeypatch):
    monkeypatch.setattr(native, "planner", lambda: None)
    plan = plan_copy([0], [B], [[(1, 1)]], block_bytes=B, arena_bytes=4 * B, items_bytes=B)
    assert (plan.tile_bytes, plan.num_programs) == (16384, 1)
    tiles = plan_copy([0], [4 << 14], [[(0, 4)]], block_bytes=1 << 14, arena_bytes=4 << 14,
                      items_bytes=4 << 14)  # fmt: skip
    assert (tiles.num_tiles, tiles.num_programs) == (4, 1)  # one program unless asked
    one = plan_copy([0], [3], [[(1, 1)]], block_bytes=B, arena_bytes=4 * B, items_bytes=3,
                    tile_bytes=1)  # fmt: skip
    assert (one.tile_bytes, one.nbytes) == (1, 3)
    empty = plan_copy([], [], [], block_bytes=B, arena_bytes=0, items_bytes=0)
    assert empty.num_segments == 0 and empty.arena_bytes == 0
    top = 2**63 - 1
    edge = plan_copy([], [], [], block_bytes=1, arena_bytes=top, items_bytes=top)
    assert (edge.arena_bytes, edge.items_bytes) == (top, top)
    with pytest.raises(PlanError) as caught:
        plan_copy([], [], [], block_bytes=1, arena_bytes=top + 1, items_bytes=0)
    assert str(caught.value) == (
        f"an arena of {top + 1} bytes or items buffer of 0: past int64, which the launch "
        "table's offsets are"
    )
