"""Pins of the shared catalog beside other processes' pins (engine/catalog/shared/pins.py).

A pin belongs to the process that took it, so every walk of an item's pin
records must pass over other processes' records and take this process's own:
a batch that fails half-way gives back only its own pins, an unpin through an
entry this object kept of a slot reused since is refused, the "not pinned"
refusal counts the pins other processes hold. The other processes are forked
children that pin and wait (fast: no interpreter start), or, where a real one
cannot exist, a second catalog object carrying the identity of a process that
is gone (a pid reused by this process, or a process started in the same clock
tick as this one).
"""

import contextlib
import os
import signal

import pytest
from catalogs import B, open_shared
from deadline import in_child
from test_shared_catalog import reopen, two_ready_items_and_a_counting_reader

from ecoffload.engine.base.errors import (
    CatalogCapacityError,
    CatalogCorruptError,
    ItemStateError,
    UnknownItemError,
)
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.format import P_NEXT


@contextlib.contextmanager
def pinned_by_a_child(catalog, keys):
    """A forked child pins ``keys`` in order through ``catalog`` and holds them until the end."""
    pinned, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        code = 1
        try:
            for key in keys:
                catalog.pin(key)
            os.write(pinned[1], b"x")
            os.read(done[0], 1)
            for key in keys:  # through whatever the parent left of the pin lists
                catalog.unpin(key)
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(pinned[0], 1) == b"x"
        yield pid
    finally:
        os.write(done[1], b"x")
        _, status = os.waitpid(pid, 0)
        for fd in (*pinned, *done):
            os.close(fd)
    assert status == 0


def ready(catalog, *keys):
    for key in keys:
        catalog.reserve(key, B)
        catalog.commit(key)


PROBES = ("p0", "p1", "p2", "p3", "p4", "p5")  # READY items free_pin_records pins


def free_pin_records(catalog):
    """How many pin records a pin of a new (item, process) pair could still take."""
    taken = []
    with contextlib.suppress(CatalogCapacityError):
        for key in PROBES:
            catalog.pin(key)
            taken.append(key)
    for key in taken:
        catalog.unpin(key)
    return len(taken)


def test_a_batch_that_runs_out_of_pin_records_gives_back_only_its_own_pins(tmp_path):
    c = open_shared(tmp_path / "c", 16, max_items=12, max_pins=4)
    ready(c, "a", "b", "x", "y", *PROBES)
    recoveries = c.recoveries
    c.pin("a")  # one record of ours on "a", behind the child's once it pins
    with pinned_by_a_child(c, ["a", "x"]):  # two records of the child's
        assert (c.lookup("a").pins, c.lookup("x").pins) == (2, 1)
        with pytest.raises(CatalogCapacityError) as err:
            c.pin_many(["a", "x", "b", "y"])  # a: nested; x: the last record; b: none left
        assert str(err.value) == (
            "pin('b'): all 4 pin records are in use; create the catalog with a larger max_pins"
        )
        c.check()
        assert [c.lookup(k).pins for k in "abxy"] == [2, 0, 1, 0]  # the child's still there
        assert free_pin_records(c) == 1  # the record "x" took is free again
        c.unpin("a")
        with pytest.raises(ItemStateError, match=r"by this process \(others hold 1 pin\(s\)\)"):
            c.unpin("x")  # the batch's pin of "x" is gone, the child's is not ours
        assert [c.lookup(k).pins for k in "ax"] == [1, 1]
        c.check()
    c.check()
    assert [c.lookup(k).pins for k in "abxy"] == [0, 0, 0, 0]
    assert c.recoveries == recoveries  # a refused call leaves nothing to rebuild
    c.close()


def test_unpin_through_a_kept_entry_of_an_evicted_or_reused_slot_is_refused(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    other = reopen(tmp_path / "c")
    ready(c, "a")
    recoveries = c.recoveries
    c.pin("a")  # c keeps its entry of "a": slot and generation
    c.unpin("a")
    c.evict("a")  # the slot is free, its generation not yet bumped
    calls = (c.pin, c.unpin, lambda k: c.unpin_many([k]))
    for call in calls:
        with pytest.raises(UnknownItemError, match=r"^key 'a' is not in the catalog"):
            call("a")
    ready(other, "b")  # the same slot, the next generation
    other.pin("b")
    for call in calls:
        with pytest.raises(UnknownItemError, match=r"^key 'a' is not in the catalog"):
            call("a")
    assert other.lookup("b").pins == 1
    assert c.recoveries == recoveries
    other.unpin("b")
    c.check()
    other.close()
    c.close()


def test_not_pinned_counts_the_other_processes_pins_of_that_item_only(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    ready(c, "a", "b", "d")  # "d" in slot 2: the count must be read from its own slot
    c.pin("a")
    c.pin("a")
    with pinned_by_a_child(c, ["d", "d", "d"]):
        for unpin in (c.unpin, lambda k: c.unpin_many([k])):
            with pytest.raises(ItemStateError) as err:
                unpin("d")
            assert str(err.value) == (
                "unpin('d'): the item is not pinned by this process (others hold 3 pin(s)); "
                "every unpin must match one pin"
            )
            with pytest.raises(ItemStateError) as err:
                unpin("b")
            assert str(err.value) == (
                "unpin('b'): the item is not pinned; every unpin must match one pin"
            )
        c.pin("d")
        with pytest.raises(ItemStateError) as err:
            c.unpin_many(["d", "b", "d"])  # one of ours, two asked: nothing taken
        assert str(err.value) == (
            "unpin('d'): the item is not pinned by this process (others hold 3 pin(s)); "
            "every unpin must match one pin"
        )
        assert [c.lookup(k).pins for k in "abd"] == [2, 0, 4]
        c.unpin("d")
        c.check()
    c.unpin_many(["a", "a"])
    c.check()
    c.close()


@pytest.mark.parametrize("same", ["pid", "start time"])
def test_a_pin_is_this_process_s_only_if_both_pid_and_start_time_match(tmp_path, same):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    ready(c, "a", "b")
    ghost = reopen(tmp_path / "c")
    if same == "pid":  # a process that had this pid before this one
        ghost._start = c._start + 1
    else:  # a process started in the same clock tick as this one
        ghost._pid = c._pid + 1
    if ghost._fast is not None:  # its C fast path carries the identity too
        ghost._fast.identify(ghost._pid, ghost._start)
    ghost.pin("a")
    ghost.pin("b")
    c.pin("b")  # a record of our own, ahead of the ghost's
    assert c.pin("a").pins == 2
    assert ghost.pin("a").pins == 3
    c.unpin_many(["a"])
    with pytest.raises(ItemStateError, match=r"by this process \(others hold 2 pin\(s\)\)"):
        c.unpin("a")
    with pytest.raises(ItemStateError, match=r"by this process \(others hold 2 pin\(s\)\)"):
        c.unpin_many(["a"])
    c.unpin("b")
    with pytest.raises(ItemStateError, match=r"by this process \(others hold 1 pin\(s\)\)"):
        c.unpin("b")
    assert [c.lookup(k).pins for k in "ab"] == [2, 1]
    c.check()
    ghost.close()
    c.close()


def test_a_record_comes_off_the_middle_of_a_list_of_three_processes_records(tmp_path):
    c = open_shared(tmp_path / "c", 16, max_items=10, max_pins=6)
    ready(c, "a", "b", "d", *PROBES)  # "d" in slot 2
    c.pin("a")  # record 0
    c.pin("b")  # record 1
    with pinned_by_a_child(c, ["d"]):  # record 2
        c.pin("d")  # record 3, ahead of the first child's
        with pinned_by_a_child(c, ["d"]):  # record 4, ahead of ours
            c.unpin("d")  # ours: unlinked from between the two children's
            c.check()
            assert c.lookup("d").pins == 2
            assert free_pin_records(c) == 2  # record 3 back on the free list, and 5
            with pytest.raises(ItemStateError, match=r"by this process \(others hold 2"):
                c.unpin("d")
        # the children unpinned through the relinked list (each exits 0 only if it could)
    c.check()
    assert c.lookup("d").pins == 0 and free_pin_records(c) == 4
    c.unpin_many(["a", "b"])
    c.check()
    c.close()


def test_a_pin_that_finds_every_record_taken_reaps_the_dead_processes_records(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=4, max_pins=2)
    ready(c, "a", "b", "x")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: pins two items and dies holding them
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        code = 1
        try:
            c.pin("a")
            c.pin("b")
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert [c.lookup(k).pins for k in "ab"] == [1, 1]  # nobody has looked yet
    assert c.pin("b").pins == 1  # both dead records reaped; "b"'s list (slot 1) holds ours
    c.check()
    assert c.lookup("a").pins == 0
    assert c.pin("a").pins == 1
    with pytest.raises(CatalogCapacityError) as err:
        c.pin("x")
    assert str(err.value) == (
        "pin('x'): all 2 pin records are in use; create the catalog with a larger max_pins"
    )
    c.unpin_many(["a", "b"])
    c.check()
    c.close()


def test_an_object_that_never_saw_the_item_unpins_this_process_s_pins(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    ready(c, "a", "b")
    c.reserve("w", B)
    c.pin("a")
    c.pin("a")
    c.pin("b")
    for op, name in (("pin", "pin"), ("unpin", "unpin"), ("unpin", "unpin_many")):
        fresh = reopen(tmp_path / "c")  # has seen no key yet: each call looks its key up
        recoveries = fresh.recoveries
        call = getattr(fresh, name)
        with pytest.raises(ItemStateError) as err:
            call(["w"] if name == "unpin_many" else "w")
        assert str(err.value) == f"{op}('w') needs an item in state 'ready', found 'writing'"
        with pytest.raises(UnknownItemError, match=r"^key 'z' is not in the catalog"):
            call(["z"] if name == "unpin_many" else "z")
        assert fresh.recoveries == recoveries
        fresh.close()
    fresh = reopen(tmp_path / "c")  # the same process: its pins are fresh's to undo
    fresh.unpin_many(["a", "b"])
    fresh_again = reopen(tmp_path / "c")
    fresh_again.unpin("a")
    assert [c.lookup(k).pins for k in "ab"] == [0, 0]
    c.check()
    fresh_again.close()
    fresh.close()
    c.close()


def test_unpin_many_of_an_item_not_pinned_here_is_refused_whatever_lies_before_the_records(
    tmp_path,
):
    c = open_shared(tmp_path / "c", 8, max_items=2)
    last = "k" * c.layout.max_key_bytes  # in the last slot: its key ends where the records begin
    ready(c, "a", last)
    for call in (c.unpin, lambda k: c.unpin_many([k])):
        with pytest.raises(ItemStateError, match=r"^unpin\('a'\): the item is not pinned;"):
            call("a")
    assert c.lookup("a").pins == 0
    c.check()
    c.close()


def test_a_seen_ready_item_is_pinned_and_unpinned_by_the_c_path(tmp_path, monkeypatch):
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")
    c = open_shared(tmp_path / "c", 8)
    fast = c._fast
    assert fast is not None, "the C fast paths are not built"
    ready(c, "a", "b")
    assert c.lookup("b") is not None  # seen READY
    before = (fast.pins, fast.unpins, fast.slow)
    assert [c.pin("b").pins for _ in range(2)] == [1, 2]
    c.unpin("b")
    c.unpin("b")
    assert (fast.pins, fast.unpins, fast.slow) == (before[0] + 2, before[1] + 2, before[2])
    assert c.entry("b").pins == 0
    c.check()
    c.close()


def test_the_python_way_pins_and_unpins_a_seen_ready_item_without_asking_the_table(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "0")  # the Python way's own shortcut
    c, other, finds = two_ready_items_and_a_counting_reader(tmp_path / "c", monkeypatch)
    assert other._fast is None
    assert other.lookup("b") is not None and finds == [b"b"]  # seen READY, in slot 1
    assert [other.pin("b").pins for _ in range(2)] == [1, 2]
    other.unpin("b")
    assert finds == [b"b"]  # neither asked the table again
    assert other.entry("b").pins == 1
    other.unpin("b")
    c.evict("b")
    ready(c, "b")  # slot 1 again, another reservation: the kept entry is refused
    assert other.pin("b").pins == 1 and finds == [b"b", b"b"]
    other.unpin("b")
    assert finds == [b"b", b"b"]  # seen READY again by that pin
    other.check()
    other.close()
    c.close()


@pytest.mark.parametrize(
    ("damage", "reaches", "hops"),
    [("none", -1, 1), ("a second record", -1, 2), ("past the records", 4, 1), ("a cycle", 0, 4)],
)
def test_unlinking_a_record_off_a_list_it_is_not_on_is_refused_after_a_bounded_walk(
    tmp_path, damage, reaches, hops
):
    """``_unlink_pin``'s own walk (its callers find the record by a walk first): a record
    not on the slot's list, whatever the list's words, is refused, never searched for
    past the records or round a cycle."""
    c = open_shared(tmp_path / "c", 8, max_pins=4)
    ready(c, "a", "b", "x")
    for key in ("a", "b", "x"):  # records 0, 1, 2 (the free list in ascending order)
        c.pin(key)
    w, ra = c._w, c._pn  # record 0: "a"'s only one
    if damage == "a second record":
        w[ra + P_NEXT] = 2  # "x"'s record follows "a"'s, then the list ends
    elif damage == "past the records":
        w[ra + P_NEXT] = 4
    elif damage == "a cycle":
        w[ra + P_NEXT] = 0

    def unlink():
        c._enter()
        try:
            c._unlink_pin(0, 1)  # "b"'s record, from "a"'s list
        except CatalogCorruptError as e:
            c._exit(True)
            return str(e)
        c._exit()
        return "unlinked"

    said = in_child(unlink, 10, here_under_mutation=True)
    assert said == (
        f"catalog {c.path}: slot 0's pin list reaches record {reaches} after {hops} records "
        "(records: 4) (a stray write, or a writer's bug); it was rebuilt from its slot "
        "table: retry the operation"
    )
    c.check()  # rebuilt (in the file the child shares): every pin kept
    assert [c.entry(k).pins for k in ("a", "b", "x")] == [1, 1, 1]
    c.close()
