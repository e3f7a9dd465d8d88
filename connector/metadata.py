"""What crosses processes each step (pickled by vLLM).

Scheduler -> worker, per step (:class:`ECOffloadMetadata`)::

    step    sequence number; the worker echoes the steps it processed
    arena   the arena file's nonce: a worker that mapped another file refuses
    loads   [(key, extents, nbytes, dtype, shape)]  pinned READY items to unpack
    saves   {key: (extents, nbytes, generation)}    WRITING reservations to fill (and
                                                    commit: the generation names the
                                                    reservation in the shared catalog)

Worker -> scheduler (:class:`ECOffloadWorkerMetadata`, merged across ranks):

    steps      metadata steps processed (a shipped step never echoed was
               dropped by vLLM: its reservations are aborted, its pins released)
    saved      {key}                  copy complete; the worker committed it (with
                                      its dtype and shape, in the shared catalog)
    not_saved  {key: nbytes}          never written (aborted if it was reserved);
                                      nbytes: the real size it saw, or -1
    loaded     {key: ranks}           unpack complete on that many ranks
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .compat import ECConnectorMetadata, ECConnectorWorkerMetadata

Extents = list[tuple[int, int]]
LoadSpec = tuple[str, Extents, int, str, tuple[int, ...]]
SaveSpec = tuple[Extents, int, int]


@dataclass
class ECOffloadMetadata(ECConnectorMetadata):
    step: int
    arena: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    saves: dict[str, SaveSpec] = field(default_factory=dict)


@dataclass
class ECOffloadWorkerMetadata(ECConnectorWorkerMetadata):
    steps: set[int] = field(default_factory=set)
    saved: set[str] = field(default_factory=set)
    not_saved: dict[str, int] = field(default_factory=dict)
    loaded: Counter = field(default_factory=Counter)

    def aggregate(self, other: ECOffloadWorkerMetadata) -> ECOffloadWorkerMetadata:
        """Merge another rank's report: union of steps and saves, sum of load counts."""
        return ECOffloadWorkerMetadata(
            steps=self.steps | other.steps,
            saved=self.saved | other.saved,
            not_saved={**self.not_saved, **other.not_saved},
            loaded=Counter(self.loaded) + Counter(other.loaded),
        )
