"""ecoffload's counters and arena occupancy at vLLM's ``/metrics``.

vLLM's ``PrometheusStatLogger`` (API server process) asks the connector class
for ``build_prom_metrics(...)`` once, then calls ``observe(data, engine_idx)``
with the ``data`` dict of each step's merged :class:`~.stats.ECOffloadStats`
(scheduler and worker counter increments, changed gauges). Each name of
:data:`~.stats.COUNTERS` and :data:`~.stats.WORKER_COUNTERS` becomes a counter
``vllm:ecoffload_<name>_total``; each name of :data:`~.stats.GAUGES` a gauge
``vllm:ecoffload_<name>``, plus ``vllm:ecoffload_arena_usage_perc`` (used
blocks / all blocks). Any other key is ignored, so a newer connector never
breaks an older metrics process. The metric classes come from vLLM
(``metric_types``), so its multiprocess registry works unchanged; the
``vllm:`` prefix lets vLLM unregister them with its own.

    vllm:ecoffload_hits_total             items found ready in the arena
    vllm:ecoffload_items_loaded_total     items served from the arena (encoder skipped)
    vllm:ecoffload_arena_usage_perc       used arena blocks / all blocks (1 = full)
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from .stats import COUNTERS, GAUGES, WORKER_COUNTERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.metrics import PromMetric, PromMetricT

PREFIX = "vllm:ecoffload_"
USAGE = "arena_usage_perc"  # 1 - blocks_free / blocks_total

DESCRIPTIONS = {
    "hits": "Encoder outputs found ready in the ecoffload arena (on vLLM's own "
    "encoder-cache misses; not vllm:mm_cache_hits, the input processor's cache).",
    "hits_from_other_instances": "Hits on encoder outputs another instance on the host "
    "saved into the shared arena (encoder disaggregation, replicas, a restart).",
    "misses": "Encoder-output lookups in the ecoffload arena that found nothing ready.",
    "items_saved": "Encoder outputs whose copy into the arena completed.",
    "bytes_saved": "Bytes of encoder outputs copied into the arena.",
    "items_loaded": "Encoder outputs served from the arena instead of running the encoder.",
    "bytes_loaded": "Bytes of encoder outputs copied out of the arena.",
    "evictions": "Items evicted from the arena to make room.",
    "saves_skipped_no_room": "Saves skipped: no room even after evicting (items pinned "
    "or in flight).",
    "saves_failed": "Reserved saves that were not completed (wrong size, not produced, "
    "copy failed).",
    "unexpected_reports": "Worker reports for keys or loads the scheduler did not ship.",
    "remote_items_announced": "Encoder outputs announced to other hosts in ec_transfer_params "
    "(copied into the export window until the consumer's notification or the lease's end).",
    "remote_items_not_announced_window_full": "READY encoder outputs not announced: the export "
    "window (nixl.window_bytes) had no room for them.",
    "remote_leases_expired": "Announcements released because their lease ended before a "
    "consumer's notification.",
    "remote_items_pulled": "Encoder outputs pulled from another host's arena with NIXL.",
    "remote_bytes_pulled": "Bytes of encoder outputs pulled from other hosts' arenas.",
    "remote_pull_failures": "Pulls from other hosts that failed, timed out or failed their "
    "CRC-32 (the items were encoded locally).",
    "remote_pulls_skipped_no_room": "Announced items not pulled: no room in the local arena.",
    "remote_fallbacks": "Requests whose announced items were encoded locally instead.",
    "remote_params_refused": "Garbled or foreign ec_transfer_params refused.",
    "encoder_outputs": "Fresh encoder outputs handed to the writing worker.",
    "save_launches": "Copy launches into the arena (one per step with saves).",
    "load_launches": "Copy launches out of the arena (one per step with loads).",
    "items_resident": "Items ready in the ecoffload arena.",
    "bytes_resident": "Bytes of the items ready in the ecoffload arena.",
    "blocks_free": "Free blocks of the ecoffload arena.",
    "blocks_total": "Blocks of the ecoffload arena.",
    "arena_ready_fraction": "Share of the ecoffload arena pre-faulted and allocatable so far.",
    "arena_verified_fraction": "Share of the bytes a warm restart kept whose CRC-32 is checked "
    "so far (1 = every item served; unchecked items are misses until checked).",
    USAGE: "Used blocks of the ecoffload arena / all blocks (1 = full).",
}


class ECOffloadPromMetrics(ECConnectorPromMetrics):
    """A counter per counter name, a gauge per gauge name, and the arena's usage."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS + WORKER_COUNTERS:
            metric = self._counter_cls(
                name=PREFIX + name, documentation=_describe(name), labelnames=labelnames
            )
            self.counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        self.gauges: dict[str, dict[int, Any]] = {}
        for name in (*GAUGES, USAGE):
            metric = self._gauge_cls(
                name=PREFIX + name,
                documentation=_describe(name),
                multiprocess_mode="mostrecent",  # pyright: ignore[reportCallIssue]  (a Gauge)
                labelnames=labelnames,
            )
            self.gauges[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._blocks: dict[int, dict[str, float]] = {}  # engine -> latest blocks_free/_total

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the step's counter increments and set the gauges it carries."""
        for name, value in (transfer_stats_data or {}).items():
            if not _is_number(value):
                continue
            if name in self.counters:
                if value > 0:  # a counter never goes down
                    self.counters[name][engine_idx].inc(value)
            elif name in GAUGES:
                self.gauges[name][engine_idx].set(value)
                if name in ("blocks_free", "blocks_total"):
                    self._blocks.setdefault(engine_idx, {})[name] = value
        blocks = self._blocks.get(engine_idx, {})
        total, free = blocks.get("blocks_total"), blocks.get("blocks_free")
        if total and free is not None:
            self.gauges[USAGE][engine_idx].set(max(0.0, total - free) / total)


def _describe(name: str) -> str:
    return DESCRIPTIONS.get(name, f"ecoffload {name.replace('_', ' ')}.")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
