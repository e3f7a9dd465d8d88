"""EC connector stats in vLLM's format: counters since the last report, plus gauges.

vLLM collects them from both sides each step (V1: the scheduler's only; V2
also the workers', merged with the scheduler's by ``aggregate``), sums them
over its logging interval and hands the result to the log line and to
Prometheus (:mod:`.prometheus`). The two sides count disjoint names, so
merging never counts an event twice:

* :data:`COUNTERS` - the scheduler's (its view of the host's shared catalog);
* :data:`WORKER_COUNTERS` - the writing worker's (one per instance);
* :data:`GAUGES` - the scheduler's view of the arena now; a later value
  replaces an earlier one instead of adding to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .compat import ECConnectorStats

COUNTERS = (
    "hits",
    "hits_from_other_instances",  # hits on items another instance (process) saved
    "misses",
    "items_saved",
    "bytes_saved",
    "items_loaded",
    "bytes_loaded",
    "evictions",
    "saves_skipped_no_room",
    "saves_failed",
    "unexpected_reports",  # worker reports for keys or loads the scheduler did not ship
    "remote_items_announced",  # producer: items offered to other hosts (copied for a lease)
    "remote_items_not_announced_window_full",  # producer: no room in its export window
    "remote_leases_expired",  # producer: leases released by expiry, not by a consumer
    "remote_items_pulled",  # consumer: items pulled from another host's arena
    "remote_bytes_pulled",
    "remote_pull_failures",  # consumer: pulls that failed, timed out or failed their CRC
    "remote_pulls_skipped_no_room",  # consumer: announced items with no local room
    "remote_fallbacks",  # consumer: requests that encode announced items locally
    "remote_params_refused",  # consumer: garbled or foreign ec_transfer_params
    "cluster_lookups",  # cluster tier: batched existence queries (one per step at most)
    "cluster_hits",  # local misses the store held
    "cluster_misses",
    "cluster_items_fetched",  # fetched, verified and committed into the arena
    "cluster_bytes_fetched",
    "cluster_fetch_failures",  # items not fetched: get failed or past fetch_timeout_s, or refused
    "cluster_publishes",  # items put into the store
    "cluster_publish_skipped",  # already in the store (at most once)
    "cluster_publish_drops",  # the publish queue was full
    "cluster_publish_failures",
    "cluster_mac_failures",  # values whose MAC (or MAC state) did not verify: never served
)
WORKER_COUNTERS = (
    "encoder_outputs",  # fresh encoder outputs the worker was handed (save_caches)
    "save_launches",  # pack launches (one per step with saves)
    "load_launches",  # unpack launches (one per step with loads)
)
GAUGES = (
    "items_resident",
    "bytes_resident",
    "blocks_free",
    "blocks_total",
    "arena_ready_fraction",  # share of the arena populated (allocatable) so far
    "arena_verified_fraction",  # share of a warm start's items' bytes checked so far
    "cluster_available",  # 1 while the cluster tier's store answers (only with `cluster`)
)


@dataclass
class ECOffloadStats(ECConnectorStats):
    """``data`` maps names of :data:`COUNTERS`, :data:`WORKER_COUNTERS` and
    :data:`GAUGES` to numbers; absent names are zero (counters) or unknown (gauges)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECOffloadStats:
        for key, value in other.data.items():
            self.data[key] = value if key in GAUGES else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = {key: self.data.get(key, 0) for key in COUNTERS + WORKER_COUNTERS}
        reduced.update({key: self.data[key] for key in GAUGES if key in self.data})
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in COUNTERS + WORKER_COUNTERS) and not any(
            key in self.data for key in GAUGES
        )


def delta(now: dict[str, int | float], reported: dict[str, int | float]) -> dict[str, int | float]:
    """What changed since ``reported`` (updated in place to ``now``): counter
    increments and new gauge values."""
    changed = {}
    for key, value in now.items():
        if value != reported.get(key, 0 if key not in GAUGES else None):
            changed[key] = value if key in GAUGES else value - reported.get(key, 0)
    reported.update(now)
    return changed
