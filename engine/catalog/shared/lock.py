"""The shared catalog's lock protocol: one robust mutex, entered and left the same way
by every operation.

One process-shared, robust, error-checking pthread mutex in the header
(:mod:`.robust_mutex`) guards every operation. It is owned by a thread, so
threads of one process, catalog objects of one process and processes all
exclude each other with it alone. When its holder dies (process or thread),
the kernel marks the mutex's futex word OWNER_DIED, and the next locker gets
``EOWNERDEAD``: it marks the mutex consistent at once (the data's own
consistency is the ``dirty`` word's business), counts the death and goes on,
recovering if ``dirty`` is set. A mutex unlocked while inconsistent would
refuse every process forever (``ENOTRECOVERABLE``), so no path unlocks before
``pthread_mutex_consistent``; should a foreign process do it anyway,
:class:`CatalogLockError` names the file and the remedy.

Every operation runs between :meth:`LockProtocol._enter` and
:meth:`LockProtocol._exit`: enter takes the mutex, rebuilds the catalog first
if the last updater died inside an update (``dirty`` set) and, for an update,
sets ``dirty`` to this process's pid; exit clears ``dirty`` (unless the
operation failed half-way with anything but a CatalogError: then the next
locker rebuilds) and releases the mutex.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from typing import NoReturn

from ...base.errors import CatalogCorruptError, CatalogLockError
from ...base.liveness import ProcessId
from . import robust_mutex
from .format import H_DIRTY, H_LOCK_DEATHS, MUTEX_AT
from .robust_mutex import FUTEX_TID_MASK, GLIBC, Timespec
from .state import CatalogState

# the catalog's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.catalog.shared.catalog")

_WAIT_SLICE_S = 0.2  # a blocked locker returns to Python this often (signals, warnings)
_WAIT_WARN_S = 10.0  # then every minute

# Every live catalog object: a forked child's copies learn their pid again at the fork
# (the mutex needs no new descriptor), so no operation has to ask whether it forked.
_catalogs: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for catalog in list(_catalogs):
        catalog._identify()


os.register_at_fork(after_in_child=_after_fork_in_child)
if robust_mutex.PT is not None:
    _trylock, _unlock = robust_mutex.trylock, robust_mutex.unlock


class LockProtocol(CatalogState):
    """Entering and leaving the shared catalog's mutex (a mixin of
    :class:`~ecoffload.engine.catalog.shared.catalog.SharedCatalog`: it uses the region's
    words ``_w``, the mutex address ``_mx``, ``path`` and ``_recover``)."""

    def _identify(self) -> None:
        """Who this process is (pid, start time), for dirty marks, pins and reservations:
        at open and again in a forked child (the mutex needs no new descriptor)."""
        self._me = ProcessId.of_this_process()
        self._pid, self._start = self._me
        fast = self.__dict__.get("_fast")  # bound after the layout is read
        if fast is not None:
            fast.identify(self._pid, self._start)
        _catalogs.add(self)

    def _enter(self, update: bool = True, recover: bool = True) -> memoryview:
        """Take the mutex for this thread; rebuild first if the last updater died inside
        an update (``recover``); mark the catalog dirty (``update``). The region's words.
        """
        rc = _trylock(self._mx)
        if rc:
            self._lock_slow(rc)
        w = self._w
        if recover and w[H_DIRTY]:
            try:
                self._recover()
            except BaseException:
                self._exit(False)
                raise
        if update:
            w[H_DIRTY] = self._pid
        return w

    def _corrupt(self, what: str) -> NoReturn:
        """A word read under the lock is impossible (``what``: which, and its value): it is
        never followed. Rebuild every derived structure from the slot table now (as a
        locker finding the catalog dirty would; bounded, whatever the words) and raise
        CatalogCorruptError, so the caller's ``_exit`` leaves a consistent catalog."""
        self._w[H_DIRTY] = self._pid
        log.error("catalog %s: %s; rebuilding it from its slot table", self.path, what)
        self._recover()
        raise CatalogCorruptError(
            f"catalog {self.path}: {what} (a stray write, or a writer's bug); it was rebuilt "
            "from its slot table: retry the operation"
        )

    def _exit(self, clean: bool = True) -> None:
        """Leave what :meth:`_enter` began: ``clean`` clears the dirty mark (the update
        finished, or failed with nothing written); without it the next locker rebuilds."""
        if clean:
            self._w[H_DIRTY] = 0
        if _unlock(self._mx):
            self._unlock_failed()

    def _lock(self) -> None:
        """The bare mutex, no recovery, no dirty mark (recover, verify, check, open)."""
        self._enter(update=False, recover=False)

    def _unlock(self) -> None:
        """Release the bare mutex, leaving the dirty word as it is."""
        self._exit(False)

    def _unlock_failed(self) -> None:
        raise CatalogLockError(
            f"catalog {self.path}: this thread released a lock it does not hold (a bug)"
        )

    def _took_over(self) -> None:
        """Count and report a lock holder's death (this thread holds the mutex, marked
        consistent)."""
        self._w[H_LOCK_DEATHS] += 1
        log.warning(
            "catalog %s: its lock's holder (a process or thread) died holding it (%s); "
            "taken over", self.path,
            "inside an update: rebuilding" if self._w[H_DIRTY] else "no update pending",
        )  # fmt: skip

    def _native_lock(self, rc: int) -> None:
        """What a C fast path's trylock answered (it wrote nothing), handled as
        :meth:`_lock_slow` does: EOWNERDEAD (it holds the mutex, marked consistent): count
        the death and release the mutex, for the caller's Python way, whose :meth:`_enter`
        recovers if needed; any other error (not held: ENOTRECOVERABLE...) raises."""
        if rc != errno.EOWNERDEAD:
            self._lock_slow(rc)  # raises for every rc but EBUSY, which C never answers
            return
        try:
            self._took_over()
        finally:
            self._unlock()

    def _lock_slow(self, rc: int) -> None:
        """The mutex was held (EBUSY: wait for it) or its holder died (EOWNERDEAD: make
        it consistent, count the death); anything else raises CatalogLockError."""
        mx, t0 = self._mx, time.monotonic()
        warn_at = t0 + _WAIT_WARN_S
        pt, pt_wait = robust_mutex.PT, robust_mutex.PT_WAIT
        assert pt is not None and pt_wait is not None, "no catalog opens without them"
        try:
            while rc == errno.EBUSY or rc == errno.ETIMEDOUT:
                until = time.time() + _WAIT_SLICE_S
                rc = pt_wait.pthread_mutex_timedlock(
                    mx, Timespec(int(until), int(until % 1 * 1e9)))  # fmt: skip
                if rc == errno.ETIMEDOUT and time.monotonic() >= warn_at:
                    warn_at += 60
                    log.warning(
                        "catalog %s: waiting %.0f s for its lock; a process holds it without "
                        "releasing it (stopped, or stuck inside an update?)",
                        self.path, time.monotonic() - t0,
                    )  # fmt: skip
            if rc == errno.EOWNERDEAD:
                # At once, before anything can raise: an unlock before this would make
                # the mutex unrecoverable for every process. The data's state is
                # dirty's business: the caller recovers if the holder died inside an update.
                pt.pthread_mutex_consistent(mx)
                rc = 0
                self._took_over()
        except BaseException:  # rc is always the last call's: held if 0 or EOWNERDEAD
            if rc == errno.EOWNERDEAD:
                pt.pthread_mutex_consistent(mx)
            if rc == 0 or rc == errno.EOWNERDEAD:
                _unlock(mx)
            raise
        if rc == 0:
            return
        if rc == errno.ENOTRECOVERABLE:
            # glibc's trylock returns this with the futex word still naming this thread
            # (its CAS succeeded; the mutex is on no robust list): clear it, or every
            # other locker would wait forever instead of hearing the same.
            word = MUTEX_AT // 8  # glibc: int __lock, then int __count
            if GLIBC and self._w[word] & FUTEX_TID_MASK == threading.get_native_id():
                self._w[word] = 0
            raise CatalogLockError(
                f"catalog {self.path}: its lock is unrecoverable (a process released it after "
                "its holder died without marking it consistent, which ecoffload never "
                "does): stop every process using this arena, then remove the file (a "
                "persistent arena: Arena.remove_shared) and start again"
            )
        if rc == errno.EDEADLK:
            raise CatalogLockError(
                f"catalog {self.path}: this thread already holds its lock (a catalog call "
                "from inside another, e.g. from a fault hook or signal handler, or through "
                "a second catalog object of the same file)"
            )
        raise CatalogLockError(  # trylock's answer or timedlock's: the message names neither
            f"catalog {self.path}: locking its mutex failed with "
            f"{errno.errorcode.get(rc, rc)}: {os.strerror(rc)}"
        )
