"""The ctypes binding of the robust process-shared mutex (engine/catalog/shared/robust_mutex.py).

The binding is made once at import; these tests make it again and check what
every declared call takes and returns, and let the real C library refuse an
attribute value to see the refusal named (no C library fails these calls on
demand otherwise). Locking itself is tested in test_shared_catalog_lock.py.
"""

import ctypes
import errno
import os

import pytest

from ecoffload.engine.base.errors import CatalogLockError
from ecoffload.engine.catalog.shared import robust_mutex

VOID_P, INT = ctypes.c_void_p, ctypes.c_int
DECLARED = {
    "pthread_mutex_consistent": [VOID_P],
    "pthread_mutex_init": [VOID_P, VOID_P],
    "pthread_mutexattr_init": [VOID_P],
    "pthread_mutexattr_destroy": [VOID_P],
    "pthread_mutexattr_setpshared": [VOID_P, INT],
    "pthread_mutexattr_setrobust": [VOID_P, INT],
    "pthread_mutexattr_settype": [VOID_P, INT],
    "pthread_mutex_timedlock": [VOID_P, ctypes.POINTER(robust_mutex.Timespec)],
}

pytestmark = pytest.mark.skipif(robust_mutex.PT is None, reason="no robust mutexes here")


@pytest.mark.parametrize("lib_type", [ctypes.PyDLL, ctypes.CDLL], ids=["PyDLL", "CDLL"])
def test_every_call_is_declared_with_its_argument_and_result_types(lib_type):
    lib = robust_mutex._pthread(lib_type)
    assert isinstance(lib, lib_type)
    for name, argtypes in DECLARED.items():
        fn = getattr(lib, name)
        assert fn.argtypes is not None and list(fn.argtypes) == argtypes, name
        assert fn.restype is INT, name


def test_no_loadable_c_library_gives_no_binding():
    tried = []

    def no_library(name):
        tried.append(name)
        return ctypes.CDLL("libecoffload-no-such-library.so")  # OSError

    assert robust_mutex._pthread(no_library) is None
    assert tried == [None, "libc.so.6", "libpthread.so.0"]  # each candidate, in order


@pytest.mark.parametrize(
    "constant, call",
    [
        ("PTHREAD_PROCESS_SHARED", "mutexattr_setpshared"),
        ("PTHREAD_MUTEX_ROBUST", "mutexattr_setrobust"),
        ("PTHREAD_MUTEX_ERRORCHECK", "mutexattr_settype"),
    ],
)
def test_a_refused_attribute_names_the_call_the_file_and_what_is_needed(monkeypatch, constant,
                                                                          call):  # fmt: skip
    monkeypatch.setattr(robust_mutex, constant, 99)  # a value the C library refuses: EINVAL
    mutex = ctypes.create_string_buffer(64)
    with pytest.raises(CatalogLockError) as err:
        robust_mutex.init_mutex(ctypes.c_void_p(ctypes.addressof(mutex)), "/dev/shm/x.catalog")
    assert str(err.value) == (
        f"catalog /dev/shm/x.catalog: pthread_{call} failed with {os.strerror(errno.EINVAL)}: "
        "the shared catalog needs robust process-shared mutexes (Linux, glibc or musl)"
    )


@pytest.mark.parametrize("call", ["mutexattr_init", "mutex_init"])
def test_a_failing_init_call_names_itself(monkeypatch, call):
    # the two calls no constant can make fail: the C library answering ENOMEM (or EAGAIN)
    real = robust_mutex.PT

    class Failing:
        def __getattr__(self, name):
            if name == f"pthread_{call}":
                return lambda *args: errno.ENOMEM
            return getattr(real, name)

    monkeypatch.setattr(robust_mutex, "PT", Failing())
    mutex = ctypes.create_string_buffer(64)
    with pytest.raises(CatalogLockError) as err:
        robust_mutex.init_mutex(ctypes.c_void_p(ctypes.addressof(mutex)), "/dev/shm/x.catalog")
    assert str(err.value).startswith(
        f"catalog /dev/shm/x.catalog: pthread_{call} failed with {os.strerror(errno.ENOMEM)}: "
    )
