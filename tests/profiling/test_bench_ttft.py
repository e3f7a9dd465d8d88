"""bench_ttft's parts that need no server: its arena-load timing, its refusals, its verdict,
and for ``--cluster`` the third column's verdict, ratios and table, and its master.

The timer itself runs on a real stream in ``test_serve_vllm.py`` (it shares that
file's server); the whole bench is ``python -m ecoffload.profiling.bench_ttft``.
"""

import os
import uuid
from dataclasses import asdict

import pytest

from ecoffload.connector.config import ClusterConfig
from ecoffload.engine.cluster.master import reachable
from ecoffload.engine.cluster.store import store_missing
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


def with_cluster_round(**changes):
    """A clean ``--cluster`` run: 3 images, each once on the cluster server, with ``changes``."""
    result = measured(cluster=True, cluster_hit=[0.6, 0.5, 0.5], cluster_local=[0.5] * 3,
                      cluster_plain=[4.0, 3.0, 2.0], cluster_fetched=3.0, cluster_saved=0.0,
                      cluster_tokens_identical=True)  # fmt: skip
    for name, value in changes.items():
        setattr(result, name, value)
    return result


def test_a_clean_cluster_round_passes_and_its_ratios_pair_the_same_images():
    result = with_cluster_round()
    assert bench_ttft.passed(result)
    to_local, speedup = result.cluster_ratios()
    assert to_local == pytest.approx([1.2, 1.0, 1.0])
    assert speedup == pytest.approx([4.0 / 0.6, 6.0, 4.0])


@pytest.mark.parametrize(
    "changes",
    [
        {"cluster_fetched": 2.0},  # one image came from somewhere else than the store
        {"cluster_saved": 1.0},  # the cluster server's encoder ran
        {"cluster_tokens_identical": False},
        {"cluster_hit": [0.5, 0.5], "cluster_local": [0.5] * 2, "cluster_plain": [3.0] * 2},
    ],
    ids=["not-fetched", "encoded", "tokens-differ", "image-missing"],
)
def test_a_cluster_round_that_did_not_measure_cluster_hits_fails(changes):
    assert not bench_ttft.passed(with_cluster_round(**changes))


def test_the_cluster_table_sits_beside_the_others():
    result = with_cluster_round()
    result.encoder_seconds, result.arena_load_seconds = [3.0], [0.001]
    result.load_average = [1.0, 2.0]
    text = bench_ttft.table(result)
    assert (
        "| repeated image | 3000.0 ms [2000.0 - 4000.0] | 500.0 ms [500.0 - 500.0] | "
        "500.0 ms [500.0 - 600.0] | 1.00x [1.00 - 1.20] | 6.00x [4.00 - 6.67] |" in text
    )
    assert "3 fetched from the store, 0 encoded" in text
    plain_run = measured(encoder_seconds=[3.0], load_average=[1.0, 1.0])
    assert "cluster tier hit" not in bench_ttft.table(plain_run)


def test_the_order_rotates_over_every_server():
    sides = ("plain", "offload", "cluster")
    assert [bench_ttft.rotation(sides, t)[0] for t in range(4)] == [
        "plain", "offload", "cluster", "plain"]  # fmt: skip
    assert sorted(bench_ttft.rotation(sides, 5)) == sorted(sides)


@pytest.mark.skipif(bool(store_missing()), reason=str(store_missing()))
def test_the_cluster_tier_s_master_serves_the_run_and_is_gone_after(tmp_path):
    with bench_ttft._cluster_tier(str(tmp_path)) as tier:
        parsed = ClusterConfig.from_value(tier)  # what the servers' connectors accept
        assert parsed is not None and parsed.master == tier["master"]
        host, port = tier["master"].rsplit(":", 1)
        assert reachable(host, int(port))
    assert not reachable(host, int(port))
