"""Verifying a warm-started shared catalog in the background, after it serves.

A warm start (a persistent arena reopened by nobody else) only marks the items
saved with a CRC-32 UNVERIFIED (:meth:`SharedCatalog.begin_verify`, no item
byte read): they are misses until checked. Every process that opens the arena
while items are left runs one :class:`BackgroundVerifier`: a thread with a
catalog object of its own that checks slices of items from the catalog's
shared cursor (:meth:`SharedCatalog.verify_step`), the lock held only to take
a slice and to apply its results. Several processes share the work; when one
dies, the cursor starts over for what it left, and the next opener starts a
thread of its own if none is left. A lookup checks an UNVERIFIED item at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from .base.sizes import format_bytes
from .catalog.shared.catalog import SharedCatalog
from .catalog.shared.format import H_MAGIC, H_VERIFY_LEFT, MAGIC
from .catalog.shared.verify import VERIFY_SLICE_BYTES

log = logging.getLogger(__name__)

PROGRESS_LOG_S = 5.0  # a progress line this often while verifying


def items_left(arena) -> int:
    """UNVERIFIED items of ``arena``'s catalog, read from the file without mapping or
    locking it (0 if it has no catalog yet)."""
    if not arena.meta_bytes:
        return 0
    words = os.pread(arena.fileno(), 8 * (H_VERIFY_LEFT + 1), arena.meta_offset)
    if len(words) < 8 * (H_VERIFY_LEFT + 1):
        return 0
    magic = int.from_bytes(words[8 * H_MAGIC : 8 * H_MAGIC + 8], "little")
    left = int.from_bytes(words[8 * H_VERIFY_LEFT :], "little", signed=True)
    return left if magic == MAGIC and left > 0 else 0


class BackgroundVerifier:
    """One thread checking ``arena``'s UNVERIFIED items until none is left or
    :meth:`stop` (the arena's close calls it). ``failure``: what ended it early."""

    def __init__(self, arena, *, max_items: int | None = None,
                 slice_bytes: int = VERIFY_SLICE_BYTES) -> None:  # fmt: skip
        self.catalog = SharedCatalog.for_arena(arena, max_items=max_items)
        self.slice_bytes = slice_bytes
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ecoffload-verify", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        catalog, next_log = self.catalog, time.monotonic() + PROGRESS_LOG_S
        try:
            while not self._stop.is_set():
                done, left = catalog.verify_step(self.slice_bytes)
                if not left:
                    return
                if not done:  # the rest is in other verifiers' hands, or lookups' now
                    self._stop.wait(0.01)
                if time.monotonic() >= next_log:
                    next_log += PROGRESS_LOG_S
                    v = catalog.verification()
                    log.info("catalog %s: %.0f%% verified, %d item(s) (%s) left, %d dropped",
                             catalog.path, 100 * v.fraction, v.items_left,
                             format_bytes(v.bytes_left), v.dropped)  # fmt: skip
        except BaseException as exc:  # the others, the next opener or lookups go on
            self.failure = exc
            log.error("catalog %s: background verification stopped: %r", catalog.path, exc)

    def stop(self) -> None:
        """End the thread (within one slice) and close its catalog; idempotent."""
        self._stop.set()
        self._thread.join()
        self.catalog.close()


def start_verifier(arena, *, max_items: int | None = None) -> BackgroundVerifier | None:
    """A :class:`BackgroundVerifier` for ``arena`` if its catalog has items left to
    verify (the arena stops it at close), else None."""
    if not items_left(arena):
        return None
    verifier = BackgroundVerifier(arena, max_items=max_items)
    arena._verifier = verifier
    return verifier
