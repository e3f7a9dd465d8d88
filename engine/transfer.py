"""Moving item bytes between tensors and arena blocks, ordered with the caller's stream.

:class:`BlockMover` is the worker-side half of the engine: it knows an arena
and a device, not the catalog. ``save`` packs a batch into given block tables;
``load`` unpacks block tables into fresh per-item tensors. On CUDA each runs
as one kernel launch on a dedicated stream that first waits for the caller's
stream; the returned :class:`Completion` carries the CUDA event that marks the
end, and ``load`` makes the caller's stream wait on it, so work the caller
enqueues next sees the data. On CPU the copies are synchronous, unless
:attr:`BlockMover.run_cpu_copy` is replaced: tests install a runner that
defers copies, so "visible only once complete" is checked with copies in flight.

Paths, chosen once per mover:

* ``kernel``: Triton over the arena's device alias (CUDA) or its host tensor
  (CPU under ``TRITON_INTERPRET=1``).
* ``reference``: torch slice copies through the host tensor, when no kernel can
  run (CPU without the interpreter, or an arena CUDA could not register).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, TypeVar

import torch

from ..kernels import (
    PACK_CONFIG,
    UNPACK_CONFIG,
    LaunchConfig,
    empty_items,
    pack,
    triton_available,
    unpack,
)
from ..profiling.nvtx import nvtx_range
from .arena import Arena

Extents = Sequence[tuple[int, int]]


class CopyEvent(Protocol):
    """What a Completion waits on: a ``torch.cuda.Event``, or a test's stand-in."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Completion:
    """The end of one asynchronous copy (None: a synchronous CPU copy, already done).

    The tensors it touched need no reference here: ``record_stream`` keeps the
    caching allocator from reusing them before the copy's stream gets past it.
    """

    def __init__(self, event: CopyEvent | None = None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


T = TypeVar("T")


def split_completed(
    pending: list[tuple[Completion, T]],
) -> tuple[list[T], list[tuple[Completion, T]]]:
    """(payloads of the completed copies, the pairs still in flight), order kept."""
    finished, still = [], []
    for done, payload in pending:
        if done.done():
            finished.append(payload)
        else:
            still.append((done, payload))
    return finished, still


def run_now(copy: Callable[[], None]) -> CopyEvent | None:
    """The default CPU copy runner: copy at once; nothing left to wait for."""
    copy()
    return None


class BlockMover:
    """Packs and unpacks batches of items for one arena on one device."""

    #: How a CPU copy runs: given the copy, run it (now or later) and return the
    #: event marking its end, None if it already ran. Tests set a deferring runner.
    run_cpu_copy: Callable[[Callable[[], None]], CopyEvent | None] = staticmethod(run_now)

    def __init__(
        self,
        arena: Arena,
        device: torch.device | str | None = None,
        *,
        pack_config: LaunchConfig = PACK_CONFIG,
        unpack_config: LaunchConfig = UNPACK_CONFIG,
    ) -> None:
        self.arena = arena
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if arena.registered else "cpu"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pack_config, self.unpack_config = pack_config, unpack_config
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.path = "kernel" if arena.registered else "reference"
        else:
            self.stream = None
            self.path = "kernel" if triton_available(self.device) else "reference"

    def _arena_view(self) -> torch.Tensor:
        """The arena as the copy path addresses it (fetched per call: holds no view)."""
        if self.device.type == "cuda" and self.path == "kernel":
            return self.arena.device_view(self.device)
        if self.arena.host is None:
            raise ValueError(f"{self.arena.path} is closed")
        return self.arena.host

    def save(self, sources: Sequence[torch.Tensor], tables: Sequence[Extents]) -> Completion:
        """Copy ``sources`` (on this mover's device) into their blocks; one launch."""
        with nvtx_range("ecoffload.save"):
            sources = list(sources)
            if self.stream is None:
                copy = partial(self._copy, sources, tables, to_arena=True)
                return Completion(self.run_cpu_copy(copy))
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in sources:  # the allocator must not reuse them before the copy ends
                t.record_stream(self.stream)
            with torch.cuda.stream(self.stream):
                self._copy(sources, tables, to_arena=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return Completion(event)

    def load(
        self, tables: Sequence[Extents], specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> tuple[list[torch.Tensor], Completion]:
        """New tensors of the given (dtype, shape), filled from their blocks; one launch.

        On CUDA the caller's current stream waits for the copy, so kernels it
        launches next read the loaded data without a host sync.
        """
        with nvtx_range("ecoffload.load"):
            outputs = empty_items(specs, self.device)
            if self.stream is None:
                copy = partial(self._copy, outputs, tables, to_arena=False)
                return outputs, Completion(self.run_cpu_copy(copy))
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            if outputs:
                outputs[0].record_stream(self.stream)  # views of one buffer: one record
            with torch.cuda.stream(self.stream):
                self._copy(outputs, tables, to_arena=False)
                event = torch.cuda.Event()
                event.record(self.stream)
            caller.wait_event(event)
            return outputs, Completion(event)

    def _copy(
        self, tensors: list[torch.Tensor], tables: Sequence[Extents], *, to_arena: bool
    ) -> None:
        block = self.arena.block_bytes
        backend = "auto" if self.path == "kernel" else "reference"
        arena = self._arena_view()
        if to_arena:
            pack(tensors, tables, arena, block, config=self.pack_config, backend=backend)
        else:
            unpack(arena, tables, block, tensors, config=self.unpack_config, backend=backend)
