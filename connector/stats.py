"""EC connector stats in vLLM's format (counters since the last report)."""

from __future__ import annotations

from dataclasses import dataclass

from .compat import ECConnectorStats

COUNTERS = (
    "hits",
    "misses",
    "items_saved",
    "bytes_saved",
    "items_loaded",
    "bytes_loaded",
    "evictions",
    "saves_skipped_no_room",
    "saves_failed",
    "unexpected_reports",  # worker reports for keys or loads the scheduler did not ship
)


@dataclass
class ECOffloadStats(ECConnectorStats):
    """``data`` maps each name of :data:`COUNTERS` to a count."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECOffloadStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())
