"""bench_ttft's parts that need no server: its arena-load timing, its refusals, its verdict.

The timer itself runs on a real stream in ``test_serve_vllm.py`` (it shares that
file's server); the whole bench is ``python -m ecoffload.profiling.bench_ttft``.
"""

import os
import uuid
from dataclasses import asdict

import pytest

from ecoffload.profiling import bench_ttft
from ecoffload.testing.tiny_vlm import SIGLIP_BASE


def test_arena_load_times_a_bit_exact_load_and_leaves_no_arena(tmp_path):
    shape = [SIGLIP_BASE.num_image_tokens, SIGLIP_BASE.text_hidden]
    seconds = bench_ttft.time_arena_load(shape, str(tmp_path), runs=3)
    assert len(seconds) == 3
    assert all(0 < s < 5 for s in seconds)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("images", [1, bench_ttft.ENCODER_CACHE_IMAGES])
def test_refuses_a_cycle_that_vllms_own_encoder_cache_would_serve(images):
    with pytest.raises(ValueError, match="more images than vLLM's encoder cache holds"):
        bench_ttft.run("tiny", images=images, rounds=1)


def measured(**changes):
    """A run's result as a clean run leaves it (3 images, 2 rounds), with ``changes``."""
    g = SIGLIP_BASE
    result = bench_ttft.TtftResult(
        "siglip-base", asdict(g) | {"num_image_tokens": g.num_image_tokens}, 3, 2, 4,
        [g.num_image_tokens, g.text_hidden], 2 * g.num_image_tokens * g.text_hidden,
    )  # fmt: skip
    result.plain_repeat, result.offload_repeat = [4.0] * 6, [0.5] * 6
    result.items_loaded, result.tokens_identical = 6.0, True
    result.placeholder_tokens = [g.num_image_tokens] * 18
    result.embedding_shape = [g.num_image_tokens, g.text_hidden]
    for name, value in changes.items():
        setattr(result, name, value)
    return result


def test_a_clean_run_passes():
    assert bench_ttft.passed(measured())


@pytest.mark.parametrize(
    "changes",
    [
        {"items_loaded": 5.0},  # a repeat the encoder served, not the arena
        {"tokens_identical": False},
        {"placeholder_tokens": [196] * 17 + [64]},  # a prompt without the whole image
        {"embedding_shape": [196, 768]},  # timed an item of another shape than vLLM makes
        {"arena_leftovers": [f"/dev/shm/ecoffload-ttft-{uuid.uuid4().hex[:6]}"]},
    ],
    ids=["repeat-not-loaded", "tokens-differ", "placeholders", "item-shape", "arena-left"],
)
def test_a_run_that_did_not_measure_the_two_paths_fails(changes):
    assert not bench_ttft.passed(measured(**changes))


def test_the_table_shows_the_ratio_of_each_pair():
    result = measured(offload_repeat=[0.5, 1.0, 2.0, 0.5, 0.5, 0.5])
    assert result.ratios() == [8.0, 4.0, 2.0, 8.0, 8.0, 8.0]
    result.encoder_seconds, result.arena_load_seconds = [3.0], [0.001]
    result.load_average = [1.0, 2.0]
    text = bench_ttft.table(result)
    assert (
        "| 4000.0 ms [4000.0 - 4000.0] | 500.0 ms [500.0 - 2000.0] | 8.00x [2.00 - 8.00] |" in text
    )
    assert "3000x (medians)" in text
