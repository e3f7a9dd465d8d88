"""Populate: pre-faulting an arena's data area so no transfer pays page faults.

By mode (``Arena.create(populate=)``):

* ``background``: the creator returns as soon as the header is written; bounded
  threads fault the data area in chunks, in order (``madvise`` releases the
  GIL), and publish the *ready prefix*: the header's ``ready_bytes`` (a
  monotonic uint64 only the populating process writes) is the length of the
  longest fully faulted prefix. Any process reads it (``Arena.ready_blocks``);
  the catalog hands out blocks below it only. Progress is logged (percent,
  GiB/s, ETA). ``close`` stops the threads within one chunk.
* ``eager``: the same work, finished before the magic is written.
* ``lazy``: nothing is faulted; every block is ready at once and pages fault
  on first touch (tmpfs may then run out of memory mid-serving: SIGBUS).

The prefix only ever covers chunks that are *all* faulted: a chunk another
thread is still faulting holds the prefix back, whatever finished after it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time

from ..base.errors import ArenaError
from .format import write_ready

# the arena's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.arena.arena")

MADV_POPULATE_WRITE = 23  # Linux >= 5.14
POPULATE_CHUNK = 128 << 20  # ~0.1 s of faulting: the first blocks are ready at once
PARALLEL_POPULATE_BYTES = 4 << 30
PROGRESS_EVERY_S = 1.0

_libc_madvise = None


def prefault(mm: mmap.mmap, base: int, offset: int, size: int, path: str) -> None:
    """Fault in ``size`` bytes at ``offset`` of ``mm`` (``base``: its address)."""
    global _libc_madvise
    if _libc_madvise is None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc_madvise = madvise
    # ctypes drops the GIL during the call, so threads fault pages in parallel.
    if _libc_madvise(base + offset, size, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, f"pre-faulting {path}: {os.strerror(err)}")
        mm[offset : offset + size : mmap.PAGESIZE] = bytes(-(-size // mmap.PAGESIZE))


class Populator:
    """Faults a data area chunk by chunk, in order, with bounded threads (``madvise``
    drops the GIL), publishing the ready prefix into the header as it grows."""

    def __init__(
        self, mm: mmap.mmap, start: int, end: int, threads: int | None, path: str, done: int = 0
    ) -> None:
        self._mm, self._start, self._end, self._path = mm, start, end, path
        self._done = done  # resumed: bytes [start, start + done) were faulted already
        step = POPULATE_CHUNK
        self._chunks = [(o, min(step, end - o)) for o in range(start + done, end, step)]
        if threads is None:
            threads = 1 if end - start < PARALLEL_POPULATE_BYTES else min(8, os.cpu_count() or 1)
        self.threads = max(1, min(threads, len(self._chunks)))
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._next = self._prefix = 0  # next chunk to take; chunks [0, _prefix) are done
        self._finished: set[int] = set()  # done beyond the prefix
        self._workers: list[threading.Thread] = []
        self._base = 0  # address of the mapping, once started
        self._t0 = self._last_log = 0.0
        self.failure: OSError | None = None
        self.seconds: float | None = None  # wall time of the whole populate, once done

    def run(self) -> None:
        """Populate everything now (eager)."""
        self.start()
        self.join()
        self._raise_failure()

    def run_first(self) -> None:
        """Populate the first chunk in the caller's thread (then ``start`` the rest)."""
        self._begin()
        self._step()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise ArenaError(f"{self.failure}; is there enough free memory for the arena?")

    def _begin(self) -> None:
        if not self._base:
            buf = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(buf)
            del buf  # release the buffer export at once, or mm.close() would fail
            self._t0 = self._last_log = time.monotonic()

    def start(self) -> None:
        """Fault the remaining chunks in background threads."""
        self._begin()
        self._workers = [
            threading.Thread(target=self._work, name=f"ecoffload-populate-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for w in self._workers:
            w.start()

    def join(self) -> None:
        for w in self._workers:
            w.join()

    def stop(self) -> None:
        """Stop after the chunks in progress (at most ~0.1 s of work each) and join."""
        self._stop.set()
        self.join()

    def _work(self) -> None:
        while not self._stop.is_set() and self._step():
            pass

    def _step(self) -> bool:
        """Fault the next chunk; False when there is none left (or populate failed)."""
        with self._lock:
            i = self._next
            if i >= len(self._chunks) or self.failure is not None:
                return False
            self._next += 1
        offset, size = self._chunks[i]
        try:
            prefault(self._mm, self._base, offset, size, self._path)
        except OSError as exc:
            exc.with_traceback(None)  # kept: must not hold this frame (and the mapping)
            with self._lock:
                self.failure = self.failure or exc
            log.error(
                "arena %s: populate stopped at %d of %d MiB (%s); only the ready part is used",
                self._path, self._ready() >> 20, (self._end - self._start) >> 20, exc,
            )  # fmt: skip
            return False
        with self._lock:
            self._finished.add(i)
            while self._prefix in self._finished:  # only a run of finished chunks counts
                self._finished.discard(self._prefix)
                self._prefix += 1
            ready = self._ready()
            write_ready(self._mm, ready)
            self._progress(ready)
        return True

    def _ready(self) -> int:
        return self._done if not self._prefix else sum(self._chunks[self._prefix - 1]) - self._start

    def _progress(self, ready: int) -> None:
        now, total = time.monotonic(), self._end - self._start
        elapsed = max(now - self._t0, 1e-9)
        rate = (ready - self._done) / elapsed
        if ready == total:
            self.seconds = elapsed
            log.log(
                logging.INFO if len(self._chunks) > 4 else logging.DEBUG,
                "arena %s: pre-faulted %.1f GiB in %.2f s (%.2f GiB/s, %d thread(s))",
                self._path, total / 2**30, elapsed, rate / 2**30, self.threads,
            )  # fmt: skip
        elif now - self._last_log >= PROGRESS_EVERY_S:
            self._last_log = now
            log.info(
                "arena %s: pre-faulted %d%% (%.1f of %.1f GiB) at %.2f GiB/s, ETA %.1f s",
                self._path, 100 * ready // total, ready / 2**30, total / 2**30, rate / 2**30,
                (total - ready) / rate if rate else float("inf"),
            )  # fmt: skip
