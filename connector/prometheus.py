"""ecoffload's counters and arena occupancy at vLLM's ``/metrics``.

vLLM's ``PrometheusStatLogger`` (API server process) asks the connector class
for ``build_prom_metrics(...)`` once, then calls ``observe(data, engine_idx)``
with the ``data`` dict of the step's merged :class:`~.stats.ECOffloadStats`
(worker and scheduler deltas). Each counter name of :data:`~.stats.COUNTERS`
becomes ``vllm:ecoffload_<name>_total``; absolute values (keys of
:data:`GAUGES`) set gauges; any other key is ignored, so a newer connector
never breaks an older metrics process. The metric classes come from vLLM
(``metric_types``), so its multiprocess registry works unchanged.

    vllm:ecoffload_hits_total             items found ready in the arena
    vllm:ecoffload_items_loaded_total     items served from the arena (encoder skipped)
    vllm:ecoffload_arena_usage_perc       used arena blocks / all blocks (1 = full)
"""

from __future__ import annotations

import numbers
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from .config import OffloadConfig
from .stats import COUNTERS

PREFIX = "vllm:ecoffload_"

DESCRIPTIONS = {
    "hits": "Encoder outputs found ready in the ecoffload arena (on vLLM's own "
    "encoder-cache misses; not vllm:mm_cache_hits, the input processor's cache).",
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
}

# Absolute values (not deltas): the latest one wins.
GAUGES = {
    "items_resident": "Items ready in the ecoffload arena.",
    "bytes_resident": "Bytes of the items ready in the ecoffload arena.",
    "used_blocks": "Blocks of the ecoffload arena in use (ready, being written or reserved).",
}
USAGE = "arena_usage_perc"  # derived from used_blocks and the configured arena size


def arena_blocks(vllm_config: Any) -> int | None:
    """Blocks of the configured arena, or None if the extra config cannot say."""
    transfer = getattr(vllm_config, "ec_transfer_config", None)
    extra = getattr(transfer, "ec_connector_extra_config", None)
    try:
        arena = OffloadConfig.from_extra_config(extra, engine_id="metrics")
    except Exception:  # validated (and reported) by the connector itself
        return None
    return arena.num_blocks


class ECOffloadPromMetrics(ECConnectorPromMetrics):
    """One counter per name of COUNTERS, one gauge per name of GAUGES, plus usage."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.num_blocks = arena_blocks(vllm_config)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(
                name=PREFIX + name,
                documentation=DESCRIPTIONS.get(name, f"ecoffload {name.replace('_', ' ')}."),
                labelnames=labelnames,
            )
            self.counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        gauges = dict(GAUGES)
        if self.num_blocks:
            gauges[USAGE] = "Used blocks of the ecoffload arena / all blocks (1 = full)."
        self.gauges: dict[str, dict[int, Any]] = {}
        for name, doc in gauges.items():
            metric = self._gauge_cls(
                name=PREFIX + name,
                documentation=doc,
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            self.gauges[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the step's counter deltas and set the gauges it carries."""
        for name, value in (transfer_stats_data or {}).items():
            if not _is_number(value):
                continue
            if name in self.counters:
                if value > 0:  # a counter never goes down
                    self.counters[name][engine_idx].inc(value)
            elif name in self.gauges:
                self.gauges[name][engine_idx].set(value)
                if name == "used_blocks" and USAGE in self.gauges:
                    self.gauges[USAGE][engine_idx].set(value / self.num_blocks)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
