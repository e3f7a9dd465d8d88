"""StepTable: a step's block tables as int64 arrays, and the same tables item by item."""

import array
import pickle

import numpy as np
import pytest
import torch
from planners import PLANNERS, use_planner

from ecoffload.engine.catalog.allocator import Extent
from ecoffload.kernels import PlanError, native, plan_copy, planner
from ecoffload.kernels.step_table import StepTable

TABLES = [[(4, 2)], [], [(0, 1), (9, 3), (7, 1)], [(12, 1)]]


def test_arrays_hold_every_item_s_extents_in_order():
    step = StepTable.from_tables(TABLES)
    assert step.extents.dtype == np.int64 and step.extents.shape == (5, 2)
    assert step.bounds.tolist() == [0, 1, 1, 4, 5]
    assert len(step) == 4 and step.num_extents == 5
    assert [step[i] for i in range(4)] == TABLES == list(step)
    assert step[-1] == [(12, 1)] and step[1:3] == TABLES[1:3]
    with pytest.raises(IndexError, match="item 4 of a step table of 4 items"):
        step[4]


def test_the_catalogs_extents_convert_alike():
    as_extents = [[Extent(*e) for e in t] for t in TABLES]
    assert StepTable.from_tables(as_extents) == StepTable.from_tables(TABLES)
    assert StepTable.from_tables(iter(TABLES)) == StepTable.from_tables(TABLES)


def test_select_and_concat_keep_each_item_s_extents():
    step = StepTable.from_tables(TABLES)
    assert list(step.select([3, 0, 2])) == [TABLES[3], TABLES[0], TABLES[2]]
    assert list(step.select([])) == []
    assert step.select(range(4)) is step  # the whole step as it is
    joined = StepTable.concat([step, step.select([1, 3])])
    assert list(joined) == TABLES + [TABLES[1], TABLES[3]]
    assert list(StepTable.concat([])) == []


def test_a_pickled_step_table_is_the_same_table():
    step = StepTable.from_tables(TABLES)
    again = pickle.loads(pickle.dumps(step))
    assert again == step and again.extents.flags.c_contiguous


@pytest.mark.parametrize("bounds", [[0, 1, 6], [1, 5], [], [0, 2, 4]])
def test_bounds_that_do_not_run_from_0_to_the_extents_are_refused(bounds):
    with pytest.raises(ValueError, match="bounds must run from 0 to the 5 extents given"):
        StepTable(StepTable.from_tables(TABLES).extents, np.array(bounds, np.int64))


@pytest.mark.parametrize("c_pass", [True, False], ids=["c-pass", "numpy"])
def test_a_step_table_plans_as_its_per_item_tables(monkeypatch, c_pass):
    module = native.planner()
    if c_pass and module is None:
        pytest.skip("the planner's C pass is not built on this host")
    if not c_pass:
        monkeypatch.setattr(native, "planner", lambda: None)
    block = 4096
    sizes = [2 * block - 100, 0, 5 * block, 1]
    offsets = [0, 8192, 8192, 8192 + 5 * block]
    want = plan_copy(offsets, sizes, TABLES, block_bytes=block, arena_bytes=16 * block,
                     items_bytes=sum(sizes) + 200, tile_bytes=1024, num_programs=3)  # fmt: skip
    got = plan_copy(offsets, sizes, StepTable.from_tables(TABLES), block_bytes=block,
                    arena_bytes=16 * block, items_bytes=sum(sizes) + 200, tile_bytes=1024,
                    num_programs=3)  # fmt: skip
    assert torch.equal(got.table, want.table) and got[1:] == want[1:]


@pytest.mark.parametrize("c_pass", [True, False], ids=["c-pass", "numpy"])
def test_a_faulty_step_table_is_named_as_precisely_as_per_item_tables(monkeypatch, c_pass):
    if c_pass and native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    if not c_pass:
        monkeypatch.setattr(native, "planner", lambda: None)
    numpy_refusals = []
    real = planner.segments_arrays

    def counted(*args):
        numpy_refusals.append(real(*args))
        return numpy_refusals[-1]

    monkeypatch.setattr(planner, "segments_arrays", counted)
    overlapping = StepTable.from_tables([[(0, 2)], [(1, 1)]])
    with pytest.raises(PlanError, match=r"blocks given twice: extent \(0, 2\) of item 0 "
                                        r"overlaps extent \(1, 1\) of item 1"):  # fmt: skip
        plan_copy([0, 8192], [8000, 10], overlapping, block_bytes=4096, arena_bytes=8 * 4096,
                  items_bytes=8202)  # fmt: skip
    assert numpy_refusals == [None]  # the numpy pass saw it too, and handed it to the loop


def test_a_step_of_catalog_entries_is_their_extents_concatenated():
    from ecoffload.engine.catalog.allocator import BlockAllocator
    from ecoffload.engine.catalog.catalog import Catalog

    catalog = Catalog(BlockAllocator(32, 4096))
    fillers = [catalog.reserve(f"fill-{i}", 4096) for i in range(32)]
    for entry in fillers[::2]:  # every other block free: the next items get several extents
        catalog.abort(entry.key)
    entries = [catalog.reserve(f"item-{i}", n) for i, n in enumerate([4096 * 3, 100, 4096 * 5])]
    step = StepTable.of_entries(entries)
    assert list(step) == [list(e.extents) for e in entries]
    assert step.num_extents == 9 and step.extents.dtype == np.int64
    assert StepTable.of_entries([]) == StepTable.from_tables([])
    with pytest.raises(ValueError):  # an entry's array is made once and never written
        entries[0].extent_array[0, 0] = 7


# --- a table of pairs (of_pairs): the same table, its arrays made only when asked -------


def test_a_table_of_pairs_reads_as_the_arrays_would_without_making_them():
    pairs = [list(t) for t in TABLES]
    step = StepTable.of_pairs(pairs)
    arrays = StepTable.from_tables(TABLES)
    assert step.pairs is pairs  # kept as given, not copied
    assert len(step) == 4 and step.num_extents == 5
    assert [step[i] for i in range(4)] == TABLES == list(step)
    assert step[-1] == [(12, 1)] and step[1:3] == TABLES[1:3]
    with pytest.raises(IndexError, match="item 4 of a step table of 4 items"):
        step[4]
    assert list(step.select([3, 0])) == [TABLES[3], TABLES[0]]
    assert step.select([3, 0]).pairs == [pairs[3], pairs[0]]  # still pairs
    assert step.select(range(4)) is step
    assert step.pairs is pairs  # none of the above made arrays
    assert step == arrays and step.pairs is None  # comparing does (the arrays compare)
    assert step.extents.tolist() == arrays.extents.tolist()
    assert step.bounds.tolist() == arrays.bounds.tolist()
    assert repr(StepTable.of_pairs(iter(TABLES))) == "StepTable(4 items, 5 extents)"


def test_a_table_of_pairs_makes_its_arrays_when_asked_and_holds_them_from_then_on():
    for ask in ("extents", "bounds", "extents_of", "pickle", "check", "set extents", "set bounds"):
        step = StepTable.of_pairs([list(t) for t in TABLES])
        if ask == "pickle":
            got = pickle.loads(pickle.dumps(step))
            assert got.pairs is None and got == StepTable.from_tables(TABLES)
        elif ask == "check":
            step.check(16)
        elif ask == "extents_of":
            assert step.extents_of(2).tolist() == [[0, 1], [9, 3], [7, 1]]
        elif ask.startswith("set"):  # the other array is made first: the pair stays whole
            other = step.bounds.copy() if ask == "set extents" else step.extents.copy()
            step = StepTable.of_pairs([list(t) for t in TABLES])
            setattr(step, ask[4:], getattr(StepTable.from_tables(TABLES), ask[4:]).copy())
            assert (step.bounds if ask == "set extents" else step.extents).tolist() == (
                other.tolist()
            )
        else:
            getattr(step, ask)
        assert step.pairs is None, ask
        assert list(step) == TABLES, ask
    with pytest.raises(PlanError, match=r"item 0: extent \(1, 'x'\) is not a \(start, count\)"):
        _ = StepTable.of_pairs([[(1, "x")]]).extents


def test_a_table_of_pairs_is_refused_where_it_leaves_the_arena():
    """Checked when asked (the worker's check makes the arrays, then checks them)."""
    with pytest.raises(PlanError, match=r"extent 1 \(16, 1\) of a step table is not inside"):
        StepTable.of_pairs([[(0, 1), (16, 1)]]).check(16)


@pytest.mark.parametrize("c_pass", [True, False], ids=["c-pass", "python"])
def test_the_planner_plans_a_table_of_pairs_as_pairs(monkeypatch, c_pass):
    """No arrays made for a table of pairs: the C pass reads the pairs (``plan``, never
    ``plan_step``), the Python passes plan them as per-item pairs; the plan is the one
    the arrays get."""
    module = native.planner()
    if c_pass and module is None:
        pytest.skip("the planner's C pass is not built on this host")
    calls = []

    class Counted:
        def __getattr__(self, name):  # item_layout, check_step: the module's own
            return getattr(module, name)

        def plan(self, *args):
            calls.append("plan")
            return module.plan(*args)

        def plan_step(self, *args):
            calls.append("plan_step")
            return module.plan_step(*args)

    monkeypatch.setattr(native, "planner", (lambda: Counted()) if c_pass else (lambda: None))
    kw = dict(block_bytes=4096, arena_bytes=16 * 4096, items_bytes=9 * 4096, tile_bytes=4096)
    offsets, sizes = [0, 2 * 4096, 2 * 4096, 7 * 4096], [2 * 4096, 0, 5 * 4096, 4096]
    step = StepTable.of_pairs([list(t) for t in TABLES])
    got = plan_copy(offsets, sizes, step, **kw)
    assert step.pairs is not None  # planned without arrays
    want = plan_copy(offsets, sizes, StepTable.from_tables(TABLES), **kw)
    assert got.table.tolist() == want.table.tolist() and got[1:] == want[1:]
    assert calls == (["plan", "plan_step"] if c_pass else [])


HOSTILE_PAIRS = [[[(0, 2)], [(1, 1)]], [[(0, 2)], [(20, 1)]], [[(0, 2)], [(3, -1)]],
                 [[(0, 2)], [(3, "1")]], [[(0, 2)], [(3.0, 1)]], [[(0, 2)], [(3, 1, 0)]],
                 [[(0, 2)], [3]], [[(0, 2)]], [[(0, 2)], [(2, 1)], []]]  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [[[(0, 1, 5)], [(4,)]], [[(0.9, 1)]], [[("0", 1)]], [[None]], [None], [[(0, 2**63)]]],
    ids=["triple-and-single", "float", "string", "no-pair", "no-table", "past-int64"],
)
def test_pairs_that_are_no_table_never_become_arrays(bad):
    """A table of pairs makes its arrays from pairs of integers only: a triple and a single
    are not re-cut into two pairs, a float not truncated, a string not parsed. Whatever
    asks for the arrays (the worker's check, a pickle, the arrays themselves) gets
    PlanError, and the table equals no table."""
    for ask in ("extents", "check", "pickle"):
        step = StepTable.of_pairs(bad)
        with pytest.raises(PlanError, match="pair of integers|sequence of|int64"):
            if ask == "extents":
                _ = step.extents
            elif ask == "check":
                step.check(16)
            else:
                pickle.dumps(step)
    assert StepTable.of_pairs(bad) != StepTable.from_tables([[(0, 1)], [(5, 4)]])
    assert "StepTable(" in repr(StepTable.of_pairs(bad))


def test_of_pairs_refuses_what_is_no_sequence_of_tables():
    with pytest.raises(PlanError) as caught:
        StepTable.of_pairs(5)  # pyright: ignore[reportArgumentType]  (the refusal tested)
    assert str(caught.value) == (
        "block tables must be a sequence of per-item tables of (start, count) pairs, got int"
    )


def test_an_item_whose_table_is_no_sequence_is_named_when_arrays_are_made():
    step = StepTable.of_pairs([[(0, 1)], 5])  # pyright: ignore[reportArgumentType]
    assert repr(step) == "StepTable(2 items, pairs that are no table)"
    with pytest.raises(PlanError) as caught:
        step.check(16)
    assert str(caught.value) == (
        "item 1: its block table is a int, not a sequence of (start, count) pairs"
    )


def test_a_table_of_pairs_gives_its_items_pairs_as_given_and_its_arrays_python_ints():
    """Item by item, the pairs as given (the reference copies walk them after the planner
    checked each): no check per extent on the CPU path; its arrays hold them as int64."""
    import numpy as np

    step = StepTable.of_pairs([[(np.int64(3), True)], [[4, 2]]])
    assert step[0] == [(3, 1)] and step[1] == [[4, 2]] and step[0] is not step.pairs[0]
    assert step.extents.tolist() == [[3, 1], [4, 2]] and step[1] == [(4, 2)]


@pytest.mark.parametrize("bad", HOSTILE_PAIRS)
@pytest.mark.parametrize("passes", PLANNERS)
def test_a_hostile_table_of_pairs_is_refused_before_any_copy(bad, passes, monkeypatch):
    """Overlapping, outside the arena, a negative count, no integer, no pair, too few
    or too many items: PlanError from every planner pass (the C pass, the small and the
    vectorised Python passes, the loop that names it), the arena untouched."""
    from ecoffload.kernels import pack

    use_planner(monkeypatch, passes)
    arena = torch.full((16 * 4096,), 0xA5, dtype=torch.uint8)
    sources = [torch.ones(2 * 4096, dtype=torch.uint8), torch.ones(4096, dtype=torch.uint8)]
    with pytest.raises(PlanError):
        pack(sources, StepTable.of_pairs(bad), arena, 4096, backend="reference")
    assert bool((arena == 0xA5).all())


def test_a_mover_takes_one_step_table_and_names_how_to_make_one(tmp_path):
    """The one block-table type past the catalogs: per-item pairs are refused at the
    mover's door with the constructor to use, before any copy."""
    from ecoffload.engine.arena.arena import Arena
    from ecoffload.engine.transfer import BlockMover

    arena = Arena.create("one-type", block_bytes=4096, num_blocks=4, directory=tmp_path,
                         processes=1, register_cuda="never")  # fmt: skip
    try:
        mover = BlockMover(arena, "cpu")
        item = torch.ones(4096, dtype=torch.uint8)
        for call in (lambda: mover.save([item], [[(0, 1)]]),
                     lambda: mover.load([[(0, 1)]], [(torch.uint8, (4096,))])):  # fmt: skip
            with pytest.raises(TypeError, match=r"one StepTable per step, got list: make one "
                                                r"with StepTable\.of_pairs"):  # fmt: skip
                call()
        assert not arena.host_tensor().any()
        mover.save([item], StepTable.of_pairs([[(1, 1)]])).wait()
        (out,), done = mover.load(StepTable.of_pairs([[(1, 1)]]), [(torch.uint8, (4096,))])
        done.wait()
        assert torch.equal(out, item)
    finally:
        arena.close()


@pytest.mark.parametrize("shared", [False, True])
def test_a_save_s_fresh_reservations_get_one_pass_and_a_load_s_entries_keep_their_arrays(
    tmp_path, shared, monkeypatch
):
    """What ``OffloadCache`` hands its mover for a step of many extents: for a save (its
    reservations are new objects, planned once) the Extent lists the C pass reads, or
    without it one pass over every extent, and no array left on any entry; for a load
    (entries the catalog keeps and hands out again) the entries' own arrays, made on
    the first step and reused on the next. Both give the entries' extents, in order."""
    from catalogs import B, open_shared

    from ecoffload.engine.cache import STEP_TABLE_FROM, step_tables
    from ecoffload.engine.catalog.allocator import BlockAllocator
    from ecoffload.engine.catalog.catalog import Catalog

    blocks = 2 * STEP_TABLE_FROM + 4
    catalog = open_shared(tmp_path / "c", blocks) if shared else Catalog(BlockAllocator(blocks, B))
    fillers = [catalog.reserve(f"fill-{i}", B) for i in range(blocks)]
    for entry in fillers[::2]:  # every other block free: each item takes single blocks
        catalog.abort(entry.key)
    entries = [catalog.reserve(f"item-{i}", B * (STEP_TABLE_FROM // 2 + 1)) for i in range(2)]
    want = [list(e.extents) for e in entries]
    assert sum(map(len, want)) >= STEP_TABLE_FROM

    monkeypatch.setattr(native, "planner", object)  # a C pass loaded: it reads the lists
    saved = step_tables(entries, fresh=True)
    assert isinstance(saved, StepTable) and saved.pairs is not None and all(
        s is e.extents for s, e in zip(saved.pairs, entries, strict=True))  # fmt: skip
    monkeypatch.setattr(native, "planner", lambda: None)  # no C pass: the numpy pass's table
    saved = step_tables(entries, fresh=True)
    assert isinstance(saved, StepTable) and saved.pairs is None and list(saved) == want
    monkeypatch.undo()
    assert not any("extent_array" in vars(e) for e in entries)  # no array made per entry

    loaded = step_tables(entries)
    assert isinstance(loaded, StepTable) and loaded.pairs is None and list(loaded) == want
    kept = [vars(e)["extent_array"] for e in entries]  # made by that step, kept by each entry
    assert [a.tolist() for a in kept] == [[list(x) for x in w] for w in want]
    assert step_tables(entries) == loaded
    assert all(vars(e)["extent_array"] is a for e, a in zip(entries, kept, strict=True))
    if shared:
        catalog.close()


# --- every refusal whole, by both passes (issue 30's checks; mutation found them unpinned) --

_SHAPE = "a step table's {} must be a C-contiguous native int64 array of shape {}, got {}"
_HOW = ": make it with StepTable(extents, bounds) or StepTable.from_tables"


@pytest.fixture(params=["c-pass", "python"])
def either_pass(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(native, "planner", lambda: None)
    elif native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    return request.param


@pytest.mark.parametrize(
    ("extents", "bounds", "message"),
    [
        (np.zeros((2, 3), np.int64), np.array([0, 2]),
         _SHAPE.format("extents", "[E, 2]", "ndarray '<q' (2, 3)")),
        (np.zeros(4, np.int64), np.array([0, 2]),
         _SHAPE.format("extents", "[E, 2]", "ndarray '<q' (4,)")),
        (np.zeros((2, 2), np.int32), np.array([0, 2]),
         _SHAPE.format("extents", "[E, 2]", "ndarray 'i' (2, 2)")),
        (np.zeros((2, 2), ">i8"), np.array([0, 2]),
         _SHAPE.format("extents", "[E, 2]", "ndarray '>q' (2, 2)")),
        (np.zeros((4, 2), np.int64)[::2], np.array([0, 2]),
         _SHAPE.format("extents", "[E, 2]", "ndarray '<q' (2, 2)")),
        ([[0, 1], [1, 1]], np.array([0, 2]), _SHAPE.format("extents", "[E, 2]", "list ")),
        (np.zeros((2, 2), np.int64), np.array([[0, 2]]),
         _SHAPE.format("bounds", "[N + 1]", "ndarray '<q' (1, 2)")),
        (np.zeros((2, 2), np.int64), np.array([0, 2], np.int32),
         _SHAPE.format("bounds", "[N + 1]", "ndarray 'i' (2,)")),
    ],
    ids=["three-columns", "flat", "int32", "big-endian", "strided", "a-list", "bounds-2d",
         "bounds-int32"],
)  # fmt: skip
def test_arrays_the_planner_cannot_read_are_refused_whole(either_pass, extents, bounds, message):
    from ecoffload.kernels.step_table import step_arrays

    message = message.replace("'<q'", f"'{np.zeros(1, np.int64).data.format}'")
    with pytest.raises(PlanError) as caught:
        step_arrays(extents, bounds)
    assert str(caught.value) == message + _HOW


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ([1, 3], "bounds must run from 0 to the 3 extents given, one entry per item plus one; "
                 "got [1, 3]...[1, 3]"),
        ([0, 1, 2], "bounds must run from 0 to the 3 extents given, one entry per item plus "
                    "one; got [0, 1, 2]...[0, 1, 2]"),
        ([0, 1, 2, 3, 4], "bounds must run from 0 to the 3 extents given, one entry per item "
                          "plus one; got [0, 1, 2]...[2, 3, 4]"),
        ([], "bounds must run from 0 to the 3 extents given, one entry per item plus one; "
             "got []...[]"),
        ([0, 1, 1, 3, 2, 3], "bounds must not go down (item i's extents are "
                             "extents[bounds[i]:bounds[i + 1]]); got bounds[3] = 3 > "
                             "bounds[4] = 2"),
    ],
    ids=["not-from-0", "short", "past", "none", "down-after-a-repeat"],
)  # fmt: skip
def test_bounds_that_do_not_cover_the_extents_are_refused_whole(either_pass, bounds, message):
    from ecoffload.kernels.step_table import step_arrays

    extents = np.array([[0, 1], [1, 1], [2, 1]], np.int64)
    for make in (lambda: step_arrays(extents, np.array(bounds, np.int64)),
                 lambda: StepTable(extents, np.array(bounds, np.int64)),
                 lambda: pickle.loads(pickle.dumps(_unchecked(extents, bounds)))):  # fmt: skip
        with pytest.raises(PlanError) as caught:
            make()
        assert str(caught.value) == message


def _unchecked(extents, bounds) -> StepTable:
    table = StepTable.from_tables([[(0, 1), (1, 1), (2, 1)]])
    table.extents, table.bounds = extents, np.array(bounds, np.int64)
    return table


def test_valid_arrays_come_back_as_given(either_pass):
    from ecoffload.kernels.step_table import step_arrays

    extents, bounds = np.array([[0, 1], [5, 2]], np.int64), np.array([0, 0, 2], np.int64)
    got = step_arrays(extents, bounds)
    assert got[0] is extents and got[1] is bounds
    table = StepTable(extents, bounds)
    assert table.extents.tolist() == [[0, 1], [5, 2]] and table.bounds.tolist() == [0, 0, 2]
    assert pickle.loads(pickle.dumps(table)) == table


@pytest.mark.parametrize(
    ("extents", "bad"),
    [([[0, 1], [3, 1]], None), ([[0, 1], [4, 1]], 1), ([[-1, 1]], 0), ([[0, 0]], 0),
     ([[2, 3]], 0), ([[0, 4], [1, -1]], 1), ([[3, 1], [0, 5]], 1), ([[0, 2], [2, 2]], None)],
    ids=["inside", "start-at-the-end", "negative-start", "no-blocks", "past-the-end",
         "negative-count", "longer-than-the-arena", "exactly-to-the-end"],
)  # fmt: skip
def test_a_worker_s_check_names_the_first_extent_outside_the_arena(either_pass, extents, bad):
    table = StepTable(np.array(extents, np.int64), np.array([0, len(extents)], np.int64))
    if bad is None:
        table.check(4)
        return
    with pytest.raises(PlanError) as caught:
        table.check(4)
    assert str(caught.value) == (
        f"extent {bad} {tuple(extents[bad])} of a step table is not inside the arena's blocks "
        "[0, 4): block tables must come from this arena's catalog"
    )


def test_a_worker_s_check_of_arrays_the_c_pass_cannot_read_names_them(either_pass):
    table = StepTable.from_tables([[(0, 1)]])
    table.extents = np.zeros((1, 2), np.int32)
    with pytest.raises(PlanError, match="a step table's extents must be a C-contiguous"):
        table.check(4)


def _unaligned(values) -> np.ndarray:
    """An int64 array one byte off its alignment (numpy exports it as format '=q')."""
    values = np.asarray(values, np.int64)
    raw = np.zeros(values.nbytes + 1, np.uint8)[1:]
    out = raw.view(np.int64).reshape(values.shape)
    out[...] = values
    return out


@pytest.mark.parametrize(
    "make",
    [lambda v: _unaligned(v), lambda v: array.array("q", v),
     lambda v: memoryview(bytearray(np.asarray(v, np.int64).tobytes())).cast("@q")],
    ids=["numpy-unaligned-=q", "array-q", "memoryview-@q"],
)  # fmt: skip
def test_native_int64_bounds_of_any_exporter_are_read_as_an_int64_array(either_pass, make):
    """Bounds given through the buffer protocol as native int64 ('q' with or without a
    '@' or '=' prefix) are read, as an int64 ndarray, and their checks hold."""
    from ecoffload.kernels.step_table import step_arrays

    extents = np.array([[0, 1], [1, 1]], np.int64)
    _, bounds = step_arrays(extents, make([0, 1, 2]))
    assert type(bounds) is np.ndarray and bounds.dtype == np.int64
    assert bounds.tolist() == [0, 1, 2]
    with pytest.raises(PlanError, match=r"got bounds\[1\] = 2 > bounds\[2\] = 1"):
        step_arrays(extents[:1], make([0, 2, 1]))  # three entries, going down


def test_bounds_of_three_entries_that_go_down_are_refused(either_pass):
    from ecoffload.kernels.step_table import step_arrays

    with pytest.raises(PlanError) as caught:
        step_arrays(np.array([[0, 1]], np.int64), np.array([0, 2, 1], np.int64))
    assert str(caught.value) == (
        "bounds must not go down (item i's extents are extents[bounds[i]:bounds[i + 1]]); "
        "got bounds[1] = 2 > bounds[2] = 1"
    )


def test_the_constructor_takes_any_integer_arrays_as_int64_and_flattens_the_bounds(
    either_pass,
):
    table = StepTable(np.array([0, 1, 4, 2], np.int32), np.array([[0, 1, 2]], np.int32))
    assert table.extents.dtype == table.bounds.dtype == np.int64
    assert table.extents.tolist() == [[0, 1], [4, 2]] and table.bounds.tolist() == [0, 1, 2]
    assert table == StepTable.from_tables([[(0, 1)], [(4, 2)]])


@pytest.mark.parametrize("state", [5, None, (1, 2, 3)], ids=["an-int", "none", "three"])
def test_a_pickled_state_that_is_no_pair_is_refused_by_name(state):
    table = StepTable.__new__(StepTable)
    with pytest.raises(PlanError) as caught:
        table.__setstate__(state)
    assert str(caught.value) == (
        f"a pickled StepTable holds (extents, bounds), got {type(state).__name__}"
    )


def test_usual_arrays_are_checked_by_the_c_pass_alone(monkeypatch):
    """With the C pass loaded, ndarray step arrays (what the catalogs and the scheduler
    make) are checked in C, every call: neither step_arrays nor a worker's check reads
    them in Python (~0.4 us a table in C, ~3.6 us in numpy: BENCHMARKS.md, issue 30)."""
    from ecoffload.kernels import step_table

    if native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    table = StepTable.from_tables(TABLES)

    def python_pass(*args):
        raise AssertionError("read in Python")

    monkeypatch.setattr(step_table, "memoryview", python_pass, raising=False)
    assert step_table.step_arrays(table.extents, table.bounds)[0] is table.extents
    monkeypatch.setattr(step_table, "step_arrays", python_pass)
    table.check(16)
    with pytest.raises(PlanError, match=r"extent 4 \(12, 1\) of a step table is not inside"):
        table.check(12)


def test_tables_with_the_same_extents_cut_into_other_items_differ():
    one_item = StepTable.from_tables([[(0, 1), (1, 1)]])
    two_items = StepTable.from_tables([[(0, 1)], [(1, 1)]])
    assert one_item.extents.tolist() == two_items.extents.tolist()
    assert one_item != two_items and StepTable.of_pairs([[(0, 1)], [(1, 1)]]) == two_items


@pytest.mark.parametrize("fresh", [False, True])
def test_a_step_of_fewer_extents_than_step_table_from_keeps_its_pairs(fresh, monkeypatch):
    """From ``STEP_TABLE_FROM`` extents a load's step gets arrays (a fresh save's, only
    without the C pass); below it, the entries' pairs as they are."""
    from ecoffload.engine.cache import STEP_TABLE_FROM, step_tables
    from ecoffload.engine.catalog.allocator import BlockAllocator
    from ecoffload.engine.catalog.catalog import Catalog

    monkeypatch.setattr(native, "planner", lambda: None)  # no C pass: a fresh save's arrays too
    catalog = Catalog(BlockAllocator(4 * STEP_TABLE_FROM, 4096))
    entries = [catalog.reserve(f"item-{i}", 4096) for i in range(STEP_TABLE_FROM)]
    below = step_tables(entries[:-1], fresh=fresh)
    assert below.pairs is not None and all(
        p is e.extents for p, e in zip(below.pairs, entries, strict=False))  # fmt: skip
    at = step_tables(entries, fresh=fresh)
    assert at.pairs is None and at.num_extents == STEP_TABLE_FROM


@pytest.mark.parametrize("extent", [(3, "1"), (3.0, 1), (3, 1, 0), 3], ids=repr)
def test_an_extent_that_is_no_pair_of_integers_is_named(extent):
    with pytest.raises(PlanError) as caught:
        plan_copy([0, 4096], [4096, 4096], StepTable.of_pairs([[(0, 1)], [extent]]),
                  block_bytes=4096, arena_bytes=8 * 4096, items_bytes=2 * 4096)  # fmt: skip
    assert str(caught.value) == (
        f"item 1: extent {extent!r} is not a (start, count) pair of integers; "
        "block tables must come from this arena's allocator"
    )


def test_concat_of_three_tables_offsets_each_one_s_items_past_all_before_it():
    a, b, c = (StepTable.from_tables(t) for t in ([[(0, 1)], [(1, 2)]], [[(5, 1)]], [[(7, 1)]]))
    joined = StepTable.concat([a, b, c])
    assert list(joined) == [[(0, 1)], [(1, 2)], [(5, 1)], [(7, 1)]]
    assert joined.bounds.tolist() == [0, 1, 2, 3, 4]
