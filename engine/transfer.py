"""Moving item bytes between tensors and arena blocks, ordered with the caller's stream.

:class:`BlockMover` is the worker-side half of the engine: it knows an arena
and a device, not the catalog. ``save`` packs a batch into given block tables;
``load`` unpacks block tables into fresh per-item tensors. On CUDA each runs
as one kernel launch on the mover's own stream; the returned
:class:`Completion` carries the CUDA event that marks the end. Stream order:

* ``save`` waits for the work queued on the caller's stream so far (it
  produced the sources), and keeps the sources alive until the event: their
  memory cannot be handed to another tensor while the copy still reads it.
* ``load`` waits for nothing: its outputs are allocated for the copy stream
  and its sources are pinned arena blocks, so it overlaps compute already
  queued; the caller's stream waits on its event (work enqueued next sees the
  data) and the outputs are recorded as used there.

Events come from a small pool: one is reused once its copy was seen complete.
On CPU the copies are synchronous, unless :attr:`BlockMover.run_cpu_copy` is
replaced: tests install a runner that defers copies, so "visible only once
complete" is checked with copies in flight.

Paths, chosen once per mover:

* ``kernel``: Triton over the arena's device alias (CUDA) or its host tensor
  (CPU under ``TRITON_INTERPRET=1``).
* ``reference``: torch slice copies through the host tensor, when no kernel can
  run (CPU without the interpreter, or an arena CUDA could not register).

On the kernel path, items with a block this process has not registered (the
arena is still being populated, or that chunk's registration failed: see
``Arena.covers``) take the reference path in the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Generic, Protocol, TypeVar

import torch

from ..kernels import (
    PACK_CONFIG,
    UNPACK_CONFIG,
    KernelVariant,
    LaunchConfig,
    empty_items,
    native,
    pack,
    triton_available,
    unpack,
    warm_up,
)
from ..kernels.nvtx import nvtx_range
from ..kernels.step_table import StepTable
from .arena.arena import Arena


class CopyEvent(Protocol):
    """What a Completion waits on: a ``torch.cuda.Event``, or a test's stand-in."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


E = TypeVar("E", bound=CopyEvent)


class Completion(Generic[E]):
    """The end of one asynchronous copy (no event: a synchronous CPU copy, already done).

    Holds ``keep_alive`` (the tensors the copy reads) until the copy is seen
    complete, then drops them and hands the event to ``release`` (the mover's
    pool).
    """

    def __init__(
        self,
        event: E | None = None,
        *,
        keep_alive: Sequence[torch.Tensor] = (),
        release: Callable[[E], None] | None = None,
    ) -> None:
        self._event, self._keep_alive, self._release = event, keep_alive, release

    def done(self) -> bool:
        if self._event is None:
            return True
        if not self._event.query():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        """Block until the copy completes (then as :meth:`done`)."""
        if self._event is not None:
            self._event.synchronize()
            self.done()  # finished only if the event says so (a killed writer's never is)

    def _finish(self) -> None:
        event, self._event, self._keep_alive = self._event, None, ()
        if self._release is not None and event is not None:
            self._release(event)


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
        warm_up: bool = True,
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
        self._events: list[torch.cuda.Event] = []  # completed copies' events, for reuse
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self._fence = torch.cuda.Event()  # "the caller's work so far", re-recorded per save
            self.path = "kernel" if arena.registered else "reference"
        else:
            self.stream = None
            self.path = "kernel" if triton_available(self.device) else "reference"
        if warm_up:
            self.warm_up()

    def warm_up(self) -> list[KernelVariant]:
        """Load the copy planner's C pass and, on a CUDA kernel path, compile every
        kernel variant this mover can launch, so nothing compiles mid-serving.

        Runs when a mover is created (``warm_up=True``); kernel compile time is
        logged. Returns the variants compiled: none on CPU or the reference path.
        """
        if self.device.type != "cuda" or self.path != "kernel":
            native.planner()  # every path plans (the reference path validates its tables)
            return []
        # The kernels' warm-up loads the C pass too.
        return warm_up(self.device, pack_config=self.pack_config,
                       unpack_config=self.unpack_config)  # fmt: skip

    def _arena_view(self) -> torch.Tensor:
        """The arena as the copy path addresses it (fetched per call: holds no view)."""
        if self.device.type == "cuda" and self.path == "kernel":
            return self.arena.device_view(self.device)
        if self.arena.host is None:
            raise ValueError(f"{self.arena.path} is closed")
        return self.arena.host

    def save(self, sources: Sequence[torch.Tensor], tables: StepTable) -> Completion:
        """Copy ``sources`` (on this mover's device) into their blocks; one launch."""
        with nvtx_range("ecoffload.save"):
            _check_step_table(tables)
            sources = list(sources)
            if self.stream is None:
                copy = partial(self._copy, sources, tables, to_arena=True)
                return Completion(self.run_cpu_copy(copy))
            # The producer's kernels are queued on the caller's stream: copy after them.
            self._fence.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(self._fence)
            with torch.cuda.stream(self.stream):
                self._copy(sources, tables, to_arena=True)
                event = self._recorded_event()
            return Completion(event, keep_alive=sources, release=self._events.append)

    def load(
        self, tables: StepTable, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> tuple[list[torch.Tensor], Completion]:
        """New tensors of the given (dtype, shape), filled from their blocks; one launch.

        On CUDA the copy does not wait for the caller's queued work; the caller's
        current stream waits for the copy, so kernels it launches next read the
        loaded data without a host sync.
        """
        with nvtx_range("ecoffload.load"):
            _check_step_table(tables)
            if self.stream is None:
                outputs = empty_items(specs, self.device)
                copy = partial(self._copy, outputs, tables, to_arena=False)
                return outputs, Completion(self.run_cpu_copy(copy))
            caller = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                outputs = empty_items(specs, self.device)  # copy-stream memory: free now
                self._copy(outputs, tables, to_arena=False)
                event = self._recorded_event()
            if outputs:
                outputs[0].record_stream(caller)  # views of one buffer: used on the caller's
            caller.wait_event(event)
            return outputs, Completion(event, release=self._events.append)

    def _recorded_event(self) -> torch.cuda.Event:
        """A pooled event recorded on the copy stream now (a new one if none is free)."""
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record(self.stream)
        return event

    def _copy(self, tensors: list[torch.Tensor], tables: StepTable, *, to_arena: bool) -> None:
        block = self.arena.block_bytes
        backend = "auto" if self.path == "kernel" else "reference"
        if backend == "auto" and self.arena.registered:
            # An item's extents as an array view or its pairs: covers() walks them only
            # while registration is incomplete, so no Python object per extent otherwise.
            pairs = tables.pairs  # a table of pairs keeps them: no arrays made for this
            of = pairs.__getitem__ if pairs is not None else tables.extents_of
            unregistered = {i for i in range(len(tables)) if not self.arena.covers(of(i))}
            if unregistered:
                host = sorted(unregistered)
                rest = [i for i in range(len(tables)) if i not in unregistered]
                host_tables, tables = tables.select(host), tables.select(rest)
                self._host_copy([tensors[i] for i in host], host_tables, to_arena)
                tensors = [tensors[i] for i in rest]
                if not tensors:
                    return
        arena = self._arena_view()
        if to_arena:
            pack(tensors, tables, arena, block, config=self.pack_config, backend=backend)
        else:
            unpack(arena, tables, block, tensors, config=self.unpack_config, backend=backend)

    def _host_copy(self, tensors: list[torch.Tensor], tables: StepTable, to_arena: bool) -> None:
        """Reference copies through the host mapping (blocks this process has not registered)."""
        block, host = self.arena.block_bytes, self.arena.host_tensor()
        if to_arena:
            pack(tensors, tables, host, block, backend="reference")
        else:
            unpack(host, tables, block, tensors, backend="reference")


def _check_step_table(tables: object) -> None:
    """TypeError unless ``tables`` is the one block-table type past the catalogs."""
    if not isinstance(tables, StepTable):
        raise TypeError(
            f"a mover's block tables are one StepTable per step, got {type(tables).__name__}: "
            "make one with StepTable.of_pairs(per_item_pairs) or StepTable.from_tables"
        )
