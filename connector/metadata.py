"""What crosses processes each step (pickled by vLLM).

Scheduler -> worker, per step (:class:`ECOffloadMetadata`)::

    step        sequence number; the worker echoes the steps it processed
    arena       the arena file's nonce: a worker that mapped another file refuses
    loads       [LoadSpec(key, nbytes, dtype, shape)]   pinned READY items to unpack
    load_table  their block tables, item i of it the i-th load (a StepTable)
    saves       {key: SaveSpec(item, nbytes, generation)}  WRITING reservations to
                fill (and commit: the generation names the reservation in the
                shared catalog); ``item`` indexes ``save_table``
    save_table  their block tables (a StepTable)

Block tables travel as a :class:`~ecoffload.kernels.step_table.StepTable`: two
int64 arrays that pickle as two buffers, and that the worker's planner reads
as they are (no Python object per extent on either side).

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
from typing import NamedTuple

from ..kernels.step_table import StepTable
from .compat import ECConnectorMetadata, ECConnectorWorkerMetadata


class LoadSpec(NamedTuple):
    """A READY item to unpack this step (its blocks: the same index of ``load_table``)."""

    key: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class SaveSpec(NamedTuple):
    """A reservation to fill this step."""

    item: int  # its block table: ``save_table[item]``
    nbytes: int
    generation: int  # the reservation's, in the shared catalog


def _no_tables() -> StepTable:
    return StepTable.from_tables([])


@dataclass
class ECOffloadMetadata(ECConnectorMetadata):
    step: int
    arena: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    saves: dict[str, SaveSpec] = field(default_factory=dict)
    load_table: StepTable = field(default_factory=_no_tables)
    save_table: StepTable = field(default_factory=_no_tables)


@dataclass
class ECOffloadWorkerMetadata(ECConnectorWorkerMetadata):
    steps: set[int] = field(default_factory=set)
    saved: set[str] = field(default_factory=set)
    not_saved: dict[str, int] = field(default_factory=dict)
    loaded: Counter = field(default_factory=Counter)

    def aggregate(  # pyright: ignore[reportIncompatibleMethodOverride]  (vLLM merges one type)
        self, other: ECOffloadWorkerMetadata
    ) -> ECOffloadWorkerMetadata:
        """Merge another rank's report: union of steps and saves, sum of load counts."""
        return ECOffloadWorkerMetadata(
            steps=self.steps | other.steps,
            saved=self.saved | other.saved,
            not_saved={**self.not_saved, **other.not_saved},
            loaded=Counter(self.loaded) + Counter(other.loaded),
        )
