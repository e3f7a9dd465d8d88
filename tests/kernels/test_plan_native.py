"""The planner's C pass (kernels/plan_native.c) against the loop planner (the reference),
and how it is loaded (kernels/native.py; built at install time by setup.py).

The pass must give the loop's launch table, byte for byte, for every valid step, and
None for every faulty or unusual one (plan_copy then plans in Python and the loop names
the fault), from per-item tables (``plan``) and from a step table's int64 arrays
(``plan_step``) alike. It is loaded at a mover's start; nothing compiles at run time.
"""

import logging
import random
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import test_plan_small as small
import test_plan_vectorised as fragmented
import torch
from planners import require_native

from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.catalog.allocator import Extent
from ecoffload.engine.transfer import BlockMover
from ecoffload.kernels import PlanError, api, items, native, plan, planner
from ecoffload.kernels.planner import plan_copy
from ecoffload.kernels.step_table import StepTable


@pytest.fixture(scope="module")
def c_module():
    return require_native()


@pytest.fixture
def c_pass(c_module, monkeypatch):
    """The C pass, and plan_copy / the item layout using it whatever the environment says."""
    monkeypatch.setattr(native, "planner", lambda: c_module)
    return c_module


def c_plan(c_pass, args, num_programs=8):
    """The C pass on a Python pass's arguments (it takes the arena's bytes, not its blocks)."""
    offsets, sizes, tables, block, blocks, *rest = args
    return c_pass.plan(offsets, sizes, tables, block, blocks * block, *rest, num_programs)


def loop_plan(args, num_programs):
    """The reference: the loop's rows and the program rows, as one int64 list."""
    rows, first_tiles, tiles, vec, total = plan.segments_loop(*args)
    programs = min(num_programs, tiles)
    table = list(rows) + plan.split_tiles(first_tiles, tiles, programs)
    return table, len(first_tiles), programs, vec, tiles, total


def c_plan_step(c_pass, args, num_programs=8):
    """The C pass on the same step given as a step table (int64 arrays)."""
    offsets, sizes, tables, block, blocks, *rest = args
    step = StepTable.from_tables(tables)
    return c_pass.plan_step(offsets, sizes, step.extents, step.bounds, block, blocks * block,
                            *rest, num_programs)  # fmt: skip


def agree(c_pass, args, num_programs=8):
    want_table, *want_rest = loop_plan(args, num_programs)
    for planned in (c_plan, c_plan_step):
        got = planned(c_pass, args, num_programs)
        assert got is not None, f"a valid step was refused by {planned.__name__}"
        table, *rest = got
        assert np.frombuffer(table, np.int64).tolist() == want_table
        assert rest == want_rest


# A power-of-two tile is counted with shifts, any other with a division: both.
@pytest.mark.parametrize("tile_bytes", [1000, 1024, 3000, 4096, 16384, 1 << 40])
@pytest.mark.parametrize("seed", range(40))
def test_few_extent_steps_give_the_loop_s_table(c_pass, seed, tile_bytes):
    args = small.args_of(*small.step(seed), tile_bytes=tile_bytes)
    agree(c_pass, args)


@pytest.mark.parametrize("seed", range(12))
def test_fragmented_steps_give_the_loop_s_table(c_pass, seed):
    agree(c_pass, fragmented.args_of(*fragmented.step(seed)))


@pytest.mark.parametrize("num_programs", [1, 2, 3, 7, 8, 16, 1000])
def test_tiles_split_between_programs_as_the_loop_splits_them(c_pass, num_programs):
    """Fewer tiles than programs, uneven splits, and one program for everything."""
    agree(c_pass, fragmented.args_of(*fragmented.step(3, items=9, max_extents=3)), num_programs)


@pytest.mark.parametrize("items_base, arena_base", [(1, 0), (2, 4), (4, 8), (8, 0), (0, 16)])
def test_the_access_width_comes_from_every_address(c_pass, items_base, arena_base):
    agree(c_pass, small.args_of(*small.step(7), items_base=items_base, arena_base=arena_base))


def test_an_empty_step(c_pass):
    assert c_pass.plan([], [], [], 4096, 40960, 0, 1024, 0, 0, 8) == (bytearray(), 0, 0, 16, 0, 0)
    empty = plan_copy([], [], [], block_bytes=4096, arena_bytes=4096, items_bytes=0)
    assert empty.table.numel() == 0 and empty.num_programs == 0
    agree(c_pass, small.args_of([0, 0], [0, 0], [[], []], 0))


def test_many_shuffled_extents_over_a_large_arena_are_checked_for_overlap(c_pass):
    """More extents than the insertion sort takes, block numbers of 3 bytes: the radix
    sort's passes; one block given twice, far apart in stream order, is found."""
    rng = random.Random(5)
    blocks = rng.sample(range(1 << 22), 500)
    offsets = [i * 4096 for i in range(500)]
    args = (offsets, [4096] * 500, [[(b, 1)] for b in blocks], 4096, 1 << 22, 500 * 4096,
            16384, 0, 0)  # fmt: skip
    agree(c_pass, args)
    sorted_args = (*args[:2], [[(b, 1)] for b in sorted(blocks)], *args[3:])
    agree(c_pass, sorted_args)  # already in block order: no sort at all
    twice = [[(b, 1)] for b in blocks]
    twice[400] = [(blocks[3], 1)]
    assert c_plan(c_pass, (*args[:2], twice, *args[3:])) is None


@pytest.mark.parametrize("kind", small.FAULTS)
def test_every_faulty_step_is_refused_and_the_loop_names_it(c_pass, kind):
    args = small.one_fault(kind)
    assert c_plan(c_pass, args) is None
    if all(len(pair) == 2 for table in args[2] for pair in table):
        assert c_plan_step(c_pass, args) is None  # the same fault in int64 arrays
    small.assert_plan_copy_raises_the_loop_s_error(args)


@pytest.mark.parametrize("kind", ["overlap", "too-long", "too-short", "outside"])
@pytest.mark.parametrize("seed", range(3))
def test_faulty_fragmented_steps_are_refused(c_pass, kind, seed):
    offsets, sizes, tables, total = fragmented.step(seed, zero_items=False)
    bad = fragmented.corrupt(tables, sizes, kind, random.Random(seed))
    assert c_plan(c_pass, fragmented.args_of(offsets, sizes, bad, total)) is None
    assert c_plan_step(c_pass, fragmented.args_of(offsets, sizes, bad, total)) is None


@pytest.mark.parametrize(
    "entry", [(5, 1, 0), (5,), None, ("5", 1), (5.0, 1), (2**63, 1), (5, -(2**63) - 1)]
)
def test_entries_that_are_not_pairs_of_int64_are_refused(c_pass, entry):
    args = small.one_fault("none")
    args[2][2] = [entry]
    assert c_plan(c_pass, args) is None


def test_lists_and_tuples_plan_alike(c_pass):
    offsets, sizes, tables, total = small.step(11)
    want = c_plan(c_pass, small.args_of(offsets, sizes, tables, total))
    assert want is not None
    assert c_plan(c_pass, small.args_of(tuple(offsets), tuple(sizes), tables, total)) == want
    as_lists = [[list(e) for e in t] for t in tables]
    assert c_plan(c_pass, small.args_of(offsets, sizes, as_lists, total)) == want
    as_extents = [[Extent(*e) for e in t] for t in tables]  # what the catalogs hand out
    assert c_plan(c_pass, small.args_of(offsets, sizes, as_extents, total)) == want
    assert c_plan_step(c_pass, small.args_of(offsets, sizes, tables, total)) == want


@pytest.mark.parametrize(
    "odd", ["int32 extents", "float extents", "strided extents", "odd length", "bounds past",
            "bounds not from 0", "bounds backwards", "no bounds", "a list"],
)  # fmt: skip
def test_step_arrays_it_cannot_read_as_given_are_refused(c_pass, odd):
    offsets, sizes, tables, total = small.step(11)
    args = small.args_of(offsets, sizes, tables, total)
    step = StepTable.from_tables(tables)
    extents, bounds = step.extents, step.bounds.copy()
    if odd == "int32 extents":
        extents = extents.astype(np.int32)
    elif odd == "float extents":
        extents = extents.astype(np.float64)
    elif odd == "strided extents":
        extents = np.repeat(extents, 2, axis=0)[::2]
    elif odd == "odd length":
        extents = extents.reshape(-1)[:-1]
    elif odd == "bounds past":
        bounds[-1] += 1
    elif odd == "bounds not from 0":
        bounds[0] = 1
    elif odd == "bounds backwards":
        bounds[1], bounds[2] = bounds[2], bounds[1]
    elif odd == "no bounds":
        bounds = bounds[:0]
    else:
        extents = extents.tolist()
    _, _, _, block, blocks, *rest = args
    assert c_pass.plan_step(offsets, sizes, extents, bounds, block, blocks * block, *rest,
                            8) is None  # fmt: skip


def misaligned(array: np.ndarray) -> np.ndarray:
    """A copy of int64 ``array`` at an odd address (a view one byte into a byte buffer)."""
    raw = np.zeros(array.nbytes + 1, dtype=np.uint8)
    out = raw[1:].view(np.int64).reshape(array.shape)
    out[...] = array
    assert out.ctypes.data % 8 and not out.flags.aligned
    return out


@pytest.mark.parametrize("which", ["extents", "bounds"])
def test_misaligned_step_arrays_are_left_to_numpy(c_pass, which):
    # an int64 load from an address that is no multiple of 8 is undefined behaviour in C
    # (UBSan reports it; some machines trap): the C pass declines, numpy plans them
    offsets, sizes, tables, total = small.step(11)
    step = StepTable.from_tables(tables)
    want = plan_copy(offsets, sizes, step, block_bytes=small.B, items_bytes=total,
                     arena_bytes=small.BLOCKS * small.B)  # fmt: skip
    extents, bounds = step.extents, step.bounds
    if which == "extents":
        extents = misaligned(extents)
    else:
        bounds = misaligned(bounds)
    assert c_pass.check_step(extents, bounds) is None
    assert c_pass.check_step(extents, bounds, small.BLOCKS) is None
    args = small.args_of(offsets, sizes, tables, total)
    _, _, _, block, blocks, *rest = args
    assert c_pass.plan_step(offsets, sizes, extents, bounds, block, blocks * block, *rest,
                            8) is None  # fmt: skip
    odd = StepTable.__new__(StepTable)
    odd.extents, odd.bounds = extents, bounds
    odd.check(small.BLOCKS)  # numpy's check: inside the arena
    got = plan_copy(offsets, sizes, odd, block_bytes=small.B, items_bytes=total,
                    arena_bytes=small.BLOCKS * small.B)  # fmt: skip
    assert torch.equal(got.table, want.table) and got.vec_bytes == want.vec_bytes


class Index:
    """An int-like whose ``__index__`` runs code: here, code that empties a list the C pass
    is reading (it must never run such code while it holds borrowed references)."""

    def __init__(self, value, victim=None):
        self.value, self.victim = value, victim

    def __index__(self):
        if self.victim is not None:
            self.victim.clear()
        return self.value


def test_only_exact_ints_are_read_int_likes_go_to_python(c_pass):
    offsets, sizes, tables, total = small.step(11)
    want = plan_copy(offsets, sizes, tables, block_bytes=small.B, items_bytes=total,
                     arena_bytes=small.BLOCKS * small.B, tile_bytes=1024)  # fmt: skip
    as_numpy = tuple(tuple((np.int64(s), np.int32(c)) for s, c in t) for t in tables)
    assert c_plan(c_pass, small.args_of(offsets, sizes, as_numpy, total)) is None
    got = plan_copy(offsets, sizes, as_numpy, block_bytes=small.B, items_bytes=total,
                    arena_bytes=small.BLOCKS * small.B, tile_bytes=1024)  # fmt: skip
    assert torch.equal(got.table, want.table)
    pair = [Index(0), 1]
    pair[0].victim = pair
    tables = [[pair], [(2, 1)]]
    sizes = [4096, Index(4096, victim=tables)]
    assert c_pass.plan([0, 4096], sizes, tables, 4096, 8 * 4096, 8192, 1024, 0, 0, 1) is None
    assert c_pass.plan([Index(0, victim=sizes), 4096], [4096, 4096], [[(0, 1)], [(1, 1)]], 4096,
                       8 * 4096, 8192, 1024, 0, 0, 1) is None  # fmt: skip


def test_a_table_too_large_to_allocate_is_a_memory_error_not_an_overflow(c_pass):
    huge = 2**61
    with pytest.raises(MemoryError):
        c_pass.plan([0], [huge], [[(0, 1)]], huge, huge, huge, 1, 0, 0, huge)


@pytest.mark.parametrize("items_bytes", [-(2**63), -1, 4096])
def test_an_items_buffer_too_small_or_negative_is_the_loop_s_error(c_pass, items_bytes):
    args = ([1], [4096], [[(0, 1)]], 4096, 1, items_bytes, 1024, 0, 0)
    assert c_plan(c_pass, args) is None
    with pytest.raises(PlanError, match=r"item 0: bytes \[1, 4097\) are not inside the items"):
        plan_copy(*args[:3], block_bytes=4096, arena_bytes=4096, items_bytes=items_bytes)


def test_arguments_that_are_not_ints_are_planned_in_python(c_pass):
    got = plan_copy([0], [4096], [[(0, 1)]], block_bytes=4096, arena_bytes=4096,
                    items_bytes=4096.0)  # fmt: skip
    assert got.segments.tolist() == [[0, 0, 4096, 0]]


def test_what_the_c_pass_refuses_to_read_the_python_passes_plan(c_pass):
    """Offsets as a numpy array, a table as a numpy array, a base past int64: not the C
    pass's input, still the same plan (the Python passes take any sequence and any int)."""
    offsets, sizes, tables, total = small.step(2)
    kw = dict(block_bytes=small.B, arena_bytes=small.BLOCKS * small.B, items_bytes=total,
              tile_bytes=1024, num_programs=8)  # fmt: skip
    want = plan_copy(offsets, sizes, tables, **kw)
    as_array = np.array(offsets, np.int64)
    assert c_plan(c_pass, small.args_of(as_array, sizes, tables, total)) is None
    assert torch.equal(plan_copy(as_array, sizes, tables, **kw).table, want.table)
    arrays = [np.array(t, np.int64).reshape(-1, 2) for t in tables]
    assert torch.equal(plan_copy(offsets, sizes, arrays, **kw).table, want.table)
    far = plan_copy(offsets, sizes, tables, **kw, arena_base=2**64)  # 2**64: 16-byte aligned
    assert torch.equal(far.table, want.table)


def test_valid_steps_never_reach_the_python_passes(c_pass, monkeypatch):
    steps = [small.args_of(*small.step(4)), fragmented.args_of(*fragmented.step(4))]
    wanted = [loop_plan(args, 8)[0] for args in steps]

    def python(*args):
        raise AssertionError("planned in Python although the C pass was loaded")

    for name in ("segments_small", "segments_vectorised", "segments_loop"):
        monkeypatch.setattr(planner, name, python)
    for args, want in zip(steps, wanted, strict=True):
        offsets, sizes, tables, block, blocks, items_bytes, tile, ib, ab = args
        got = plan_copy(offsets, sizes, tables, block_bytes=block, arena_bytes=blocks * block,
                        items_bytes=items_bytes, tile_bytes=tile, items_base=ib, arena_base=ab,
                        num_programs=8)  # fmt: skip
        assert got.table.tolist() == want


def test_a_copy_engine_split_is_planned_in_python(c_pass, monkeypatch):
    """``dma_min_bytes`` (unmeasured, off by default) takes the Python passes."""
    calls = []
    real = plan.segments_small
    monkeypatch.setattr(planner, "segments_small", lambda *a: calls.append(1) or real(*a))
    offsets, sizes, tables, total = small.step(4)
    plan_copy(offsets, sizes, tables, block_bytes=small.B, arena_bytes=small.BLOCKS * small.B,
              items_bytes=total, dma_min_bytes=1 << 20)  # fmt: skip
    assert calls == [1]


# --- loading ----------------------------------------------------------------------------


@pytest.fixture
def undecided():
    """No decision yet in this process (as a new process); forgotten again after."""
    require_native()
    native.forget()
    yield
    native.forget()


def test_the_installed_extension_is_what_planner_loads(undecided):
    module = native.planner()
    assert module.__name__ == "ecoffload.kernels._plan_native"
    assert Path(module.__file__).name.endswith(sysconfig.get_config_var("EXT_SUFFIX"))
    assert module.plan([], [], [], 1, 1, 0, 1, 0, 0, 1)[1] == 0


def test_nothing_compiles_or_writes_at_run_time(undecided, monkeypatch, arena_dir):
    def no_subprocess(*args, **kwargs):
        raise AssertionError("a process was started to build the C pass")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    with Arena.create("native", block_bytes=4096, num_blocks=8, directory=arena_dir) as arena:
        mover = BlockMover(arena, "cpu")
        assert native._loaded["module"] is not None  # loaded by the mover's start
        mover.save([torch.arange(3000, dtype=torch.int16)], StepTable.of_pairs([[(2, 2)]])).wait()
        outputs, done = mover.load(StepTable.of_pairs([[(2, 2)]]), [(torch.int16, (3000,))])
        done.wait()
        assert torch.equal(outputs[0], torch.arange(3000, dtype=torch.int16))


def test_without_the_extension_planning_stays_in_python_and_says_so_once(
    undecided, monkeypatch, caplog
):
    monkeypatch.setattr(native, "MODULE_NAME", "ecoffload.kernels._not_built_here")
    with caplog.at_level(logging.WARNING, logger="ecoffload.kernels.native"):
        assert native.planner() is None
        assert native.planner() is None
        offsets, sizes, tables, total = small.step(9)
        got = plan_copy(offsets, sizes, tables, block_bytes=small.B,
                        arena_bytes=small.BLOCKS * small.B, items_bytes=total)  # fmt: skip
    assert got.num_segments == sum(map(len, tables))
    (record,) = caplog.records
    # what an operator reads: what happened, why, and both ways out, in one sentence
    message = record.message
    assert message.startswith(
        "ecoffload: copy planning stays in Python (slower for fragmented steps): "
        "ecoffload.kernels._not_built_here is not built in this install ("
    ), message
    assert message.endswith(
        "): reinstall ecoffload on a host with a C compiler and this Python's headers (e.g. "
        "gcc and python3-dev; `pip install -e .` again after editing kernels/plan_native.c), "
        "or set ECOFFLOAD_NATIVE_PLAN=0 to plan in Python without this warning"
    ), message


def test_first_calls_racing_decide_once(undecided, monkeypatch):
    # the kernels' warm-up thread and a first step may ask at the same moment: one
    # decision (one load, at most one warning), the same answer for both
    decided = []
    real = native._decide

    def slow_decide():
        decided.append(threading.get_ident())
        time.sleep(0.2)  # the other caller reaches the lock meanwhile
        return real()

    monkeypatch.setattr(native, "_decide", slow_decide)
    answers = []
    callers = [threading.Thread(target=lambda: answers.append(native.planner())) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=10)
    assert len(decided) == 1 and len(answers) == 2
    assert answers[0] is answers[1] is not None


def test_once_decided_a_call_takes_no_lock(undecided):
    # every step asks: after the decision, a dict lookup, never the lock
    module = native.planner()
    answers = []
    with native._lock:  # held: a call that needed it would wait here
        asker = threading.Thread(target=lambda: answers.append(native.planner()))
        asker.start()
        asker.join(timeout=2)
    assert answers == [module], "planner() waited for the lock after the decision"


def test_disabled_by_the_environment_it_is_not_loaded(undecided, monkeypatch):
    monkeypatch.setenv("ECOFFLOAD_NATIVE_PLAN", "0")
    assert native.planner() is None
    native.forget()
    monkeypatch.setenv("ECOFFLOAD_NATIVE_PLAN", "1")
    assert native.planner() is not None


# --- item layout ------------------------------------------------------------------------


def tensors_of(seed):
    """Separate allocations and views of one buffer, empty ones (first, last, between),
    0-d scalars, several dtypes and shapes, in shuffled order."""
    rng = random.Random(seed)
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    out = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.choice(["own", "view", "empty", "scalar"])
        dtype = rng.choice([torch.uint8, torch.int16, torch.bfloat16, torch.float32])
        if kind == "own":
            out.append(torch.zeros(rng.randint(1, 40), rng.randint(1, 9), dtype=dtype))
        elif kind == "view":
            start = rng.randrange(0, 1 << 15, 16)
            out.append(buffer[start : start + 16 * rng.randint(1, 50)].view(dtype))
        elif kind == "empty":
            out.append(torch.zeros(0, 7, dtype=dtype))
        else:
            out.append(torch.tensor(3, dtype=dtype))
    rng.shuffle(out)
    return out


def python_layout(tensors, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native, "planner", lambda: None)
        return planner.item_layout(tensors)


@pytest.mark.parametrize("seed", range(30))
def test_the_item_layout_is_python_s(c_pass, seed, monkeypatch):
    tensors = tensors_of(seed)
    lowest, *numbers = c_pass.item_layout(tensors)
    want_base, *want = python_layout(tensors, monkeypatch)
    assert numbers == want
    base, offsets, sizes, span = planner.item_layout(tensors)
    assert [offsets, sizes, span] == want
    if want_base is None:
        assert base is None
    else:
        assert (base.data_ptr(), base.dtype, base.shape) == (
            want_base.data_ptr(), want_base.dtype, want_base.shape)  # fmt: skip


def test_an_empty_tensor_is_outside_the_span(c_pass):
    """Wherever its address (torch 2.13 reports 0 for empty views; others need not)."""
    buffer = torch.zeros(4096, dtype=torch.uint8)
    tensors = [buffer[4000:4000], buffer[100:300], buffer[0:50]]
    assert c_pass.item_layout(tensors) == (2, [0, 100, 0], [0, 200, 50], 300)


def test_valid_layouts_never_reach_the_python_lines(c_pass, monkeypatch):
    tensors = tensors_of(3) + [torch.zeros(5)]
    want = python_layout(tensors, monkeypatch)[1:]
    for name in ("_is_contiguous", "_data_ptr", "_nbytes"):
        monkeypatch.setattr(items, name, lambda t: pytest.fail("laid out in Python"))
    assert list(planner.item_layout(tensors)[1:]) == list(want)


class Clearing(torch.Tensor):
    """A tensor whose contiguity check empties the list being laid out."""

    victim: list = []

    def is_contiguous(self, *args, **kwargs):
        Clearing.victim.clear()
        return super().is_contiguous(*args, **kwargs)


def test_a_list_emptied_while_it_is_laid_out_is_read_as_it_was(c_pass):
    """A subclass's methods run Python code: the C layout declines subclasses before it
    calls anything (api.py lays them out with torch functions off), so the list is read
    whole; the Python lines lay out what they were given."""
    tensors = [torch.zeros(4), torch.zeros(8).as_subclass(Clearing), torch.zeros(2)]
    Clearing.victim = tensors
    snapshot = list(tensors)
    assert c_pass.item_layout(tensors) is None and tensors == snapshot
    _, offsets, sizes, span = planner.item_layout(tensors)
    assert sizes == [16, 32, 8] and len(offsets) == 3


@pytest.mark.parametrize(
    "odd", ["transposed", "not a tensor", "a tuple"], ids=lambda s: s.replace(" ", "-")
)
def test_what_the_c_layout_refuses_python_names(c_pass, odd):
    tensors = [torch.zeros(4, 8), torch.zeros(8, 4).t(), torch.zeros(3)]
    if odd == "not a tensor":
        tensors[1] = object()
    elif odd == "a tuple":
        tensors = tuple(tensors[::2])
    assert c_pass.item_layout(tensors) is None  # no exception left pending either
    if odd == "transposed":
        with pytest.raises(PlanError, match=r"tensor 1 is not contiguous \(shape \(4, 8\)"):
            planner.item_layout(tensors)
    elif odd == "not a tensor":
        with pytest.raises(TypeError):
            planner.item_layout(tensors)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_kernels_warm_up_loads_the_c_pass_for_any_device(undecided, monkeypatch, device):
    """What a CUDA mover's warm-up relies on (it calls this, not native.planner)."""
    loads = []
    real = native.load
    monkeypatch.setattr(native, "load", lambda: loads.append("load") or real())
    monkeypatch.setattr(api, "compile_variants", lambda variants, dev: None)  # no GPU here
    api.warm_up(torch.device(device))
    assert loads == ["load"]


class _Counting:
    """The C pass, counting its item_layout calls; its planner declining (or not)."""

    def __init__(self, c_module, plans: bool):
        self.c_module, self.plans, self.layouts = c_module, plans, 0

    def item_layout(self, tensors):
        self.layouts += 1
        return self.c_module.item_layout(tensors)

    def plan(self, *args):
        return self.c_module.plan(*args) if self.plans else None

    def plan_step(self, *args):
        return self.c_module.plan_step(*args) if self.plans else None

    def __getattr__(self, name):  # check_step and the rest: the C pass's own
        return getattr(self.c_module, name)


@pytest.mark.parametrize("plans", [True, False], ids=["c-plans", "c-declines"])
@pytest.mark.parametrize("tables", ["lists", "step-table"])
def test_a_step_asks_the_c_pass_for_its_item_layout_once(c_module, monkeypatch, plans, tables):
    """One C item layout per planned step, whether the C planner plans or declines (when
    it declined, the Python layout asked the C pass again: two calls, the same numbers); the
    plan is the one the Python passes make."""
    items = [torch.arange(n, dtype=torch.uint8) for n in (100, 5000, 1)]
    blocks = [[(0, 1)], [(1, 2)], [(3, 1)]]
    table = StepTable.from_tables(blocks) if tables == "step-table" else blocks
    arena = torch.zeros(4 * 4096, dtype=torch.uint8)
    counting = _Counting(c_module, plans)
    monkeypatch.setattr(native, "planner", lambda: counting)
    base, plan_ = api.plan_batch(items, table, arena, 4096)
    assert counting.layouts == 1
    monkeypatch.setattr(native, "planner", lambda: None)
    want_base, want = api.plan_batch(items, table, arena, 4096)
    assert base.data_ptr() == want_base.data_ptr()
    assert plan_.table.tolist() == want.table.tolist() and plan_[1:] == want[1:]


@pytest.mark.parametrize("as_views", [False, True], ids=["tensors", "item-views"])
def test_a_usual_step_is_laid_out_and_planned_by_the_c_pass_straight_from_plan_items(
    c_pass, monkeypatch, as_views
):
    """The decision on every step: ``plan_items`` asks the C pass for the layout and the
    plan itself, with the step's own numbers; neither the Python layout nor the keyword
    ``plan_copy`` (a microsecond more per step) runs. The plan is the reference's."""
    from ecoffload.kernels import PACK_CONFIG, empty_items

    specs = [(torch.bfloat16, (3, 64)), (torch.bfloat16, (0, 64)), (torch.bfloat16, (40, 64))]
    outputs = empty_items(specs, "cpu")
    tensors = outputs if as_views else [t.clone() for t in outputs]
    tables = StepTable.of_pairs([[(5, 1)], [], [(0, 2), (3, 1)]])
    arena = torch.zeros(8 * 2048, dtype=torch.uint8)
    with monkeypatch.context() as m:
        m.setattr(native, "planner", lambda: None)  # the reference: the Python passes
        want = planner.plan_items(tensors, tables, arena, 2048, PACK_CONFIG)
    monkeypatch.setattr(planner, "python_item_layout", lambda t: pytest.fail("laid out in Python"))
    monkeypatch.setattr(planner, "plan_copy", lambda *a, **k: pytest.fail("a keyword plan_copy"))
    got = planner.plan_items(tensors, tables, arena, 2048, PACK_CONFIG)
    assert got.plan.table.tolist() == want.plan.table.tolist() and got.plan[1:] == want.plan[1:]
    assert list(got.offsets) == list(want.offsets) and got.base.data_ptr() == want.base.data_ptr()
    assert got.plan.num_programs == min(PACK_CONFIG.num_programs, got.plan.num_tiles)
