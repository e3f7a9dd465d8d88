"""A ctypes binding of the C library's robust, process-shared pthread mutex.

The shared catalog keeps one ``pthread_mutex_t`` in its region (glibc or musl,
Linux). :data:`PT` calls through ``ctypes.PyDLL`` (keeps the GIL: trylock,
unlock, consistent and init never block); :data:`PT_WAIT` through
``ctypes.CDLL`` (releases the GIL: timedlock blocks). :data:`PT` is None
where the C library has no ``pthread_mutex_consistent``.
"""

from __future__ import annotations

import ctypes
import os
import platform

from ...base.errors import CatalogLockError

# sizeof(pthread_mutex_t), which no run-time interface reports: glibc's per
# machine (musl's is 40 on every 64-bit machine). Every one fits a 64-byte slot.
MUTEX_BYTES = {"x86_64": 40, "aarch64": 48, "ppc64le": 40, "s390x": 40, "riscv64": 40}
PTHREAD_PROCESS_SHARED, PTHREAD_MUTEX_ROBUST, PTHREAD_MUTEX_ERRORCHECK = 1, 1, 2
FUTEX_TID_MASK = 0x3FFFFFFF  # the owner's thread id in a robust futex word (kernel ABI)
GLIBC = platform.libc_ver()[0] == "glibc"


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _pthread(lib_type):
    """The pthread functions of the C library, called through ``lib_type``: PyDLL
    (keeps the GIL: for calls that never block) or CDLL (releases it)."""
    for name in (None, "libc.so.6", "libpthread.so.0"):
        try:
            lib = lib_type(name)
            lib.pthread_mutex_consistent  # noqa: B018 - present since glibc 2.12
        except (OSError, AttributeError):
            continue
        void_p = [ctypes.c_void_p]
        # The hot pair, trylock and unlock, goes without argtypes (a tenth cheaper a
        # call): every caller passes the mutex as a c_void_p.
        for fn, args in (("pthread_mutex_consistent", void_p), ("pthread_mutex_init", void_p * 2),
                         ("pthread_mutexattr_init", void_p),
                         ("pthread_mutexattr_destroy", void_p),
                         ("pthread_mutexattr_setpshared", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutexattr_setrobust", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutexattr_settype", [ctypes.c_void_p, ctypes.c_int]),
                         ("pthread_mutex_timedlock",
                          [ctypes.c_void_p, ctypes.POINTER(Timespec)])):  # fmt: skip
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    return None


PT = _pthread(ctypes.PyDLL)  # trylock, unlock, consistent, init: never block
PT_WAIT = _pthread(ctypes.CDLL)  # timedlock: blocks, so the GIL is released
if PT is not None:
    trylock, unlock = PT.pthread_mutex_trylock, PT.pthread_mutex_unlock


def init_mutex(mx: ctypes.c_void_p, path: str) -> None:
    """(Re)initialise the mutex at ``mx``: process-shared, robust, error-checking.

    Only while nobody can hold it (the catalog's open lock is held)."""
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 or 8 bytes
    pt = PT
    assert pt is not None, "a catalog opens only where the C library has the mutex"
    for what, call in (
        ("mutexattr_init", lambda: pt.pthread_mutexattr_init(attr)),
        ("mutexattr_setpshared",
         lambda: pt.pthread_mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED)),
        ("mutexattr_setrobust",
         lambda: pt.pthread_mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST)),
        ("mutexattr_settype",
         lambda: pt.pthread_mutexattr_settype(attr, PTHREAD_MUTEX_ERRORCHECK)),
        ("mutex_init", lambda: pt.pthread_mutex_init(mx, attr)),
    ):  # fmt: skip
        rc = call()
        if rc:
            raise CatalogLockError(
                f"catalog {path}: pthread_{what} failed with {os.strerror(rc)}: "
                "the shared catalog needs robust process-shared mutexes (Linux, glibc "
                "or musl)"
            )
    pt.pthread_mutexattr_destroy(attr)
