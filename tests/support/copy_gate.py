"""Copies in flight on CPU: a BlockMover copy runner whose completion the test controls.

On CPU a BlockMover copies at once, so "visible only once the copy completed"
could never fail a test. Install a gate instead::

    gate = CopyGate.install(mover)   # or CopyGate.install(cache.mover)
    cache.save(...)                  # the pack is queued: no byte written, not done
    gate.complete()                  # now it runs, and its Completion is done

Each deferred copy is a :class:`PendingCopy`, the event a ``Completion`` waits
on (``query`` / ``synchronize``, like ``torch.cuda.Event``), so the engine's own
``Completion.done`` and ``split_completed`` decide what counts as finished.
``synchronize`` runs the copy (a wait lets the GPU get there); a copy whose
writer was killed (:meth:`CopyGate.kill`) never runs and never completes, and
waiting for it returns at once, as a timed-out wait would.
"""

from __future__ import annotations

from collections.abc import Callable


class PendingCopy:
    """One deferred copy: runs when the gate (or a wait) lets it."""

    def __init__(self, copy: Callable[[], None]) -> None:
        self._copy: Callable[[], None] | None = copy
        self.ran = self.killed = False

    def run(self) -> None:
        if self._copy is not None and not self.killed:
            copy, self._copy = self._copy, None
            copy()
            self.ran = True

    def query(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.run()


class CopyGate:
    """Collects a mover's CPU copies; the test completes (or kills) them."""

    def __init__(self) -> None:
        self.copies: list[PendingCopy] = []

    @classmethod
    def install(cls, mover) -> CopyGate:
        gate = cls()
        mover.run_cpu_copy = gate
        return gate

    def __call__(self, copy: Callable[[], None]) -> PendingCopy:
        pending = PendingCopy(copy)
        self.copies.append(pending)
        return pending

    @property
    def in_flight(self) -> list[PendingCopy]:
        return [c for c in self.copies if not c.ran and not c.killed]

    def complete(self, n: int | None = None) -> int:
        """Run the oldest ``n`` copies still in flight (all by default); returns how many."""
        todo = self.in_flight[:n] if n is not None else self.in_flight
        for copy in todo:
            copy.run()
        return len(todo)

    def kill(self) -> None:
        """The writer dies: every copy in flight stays unfinished for ever."""
        for copy in self.in_flight:
            copy.killed = True
