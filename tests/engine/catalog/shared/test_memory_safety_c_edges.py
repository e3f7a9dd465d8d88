"""The C paths at their edges: counters at int64's limits answer as Python does (or go the
Python way), and the catalog's C hit path never writes through a read-only buffer."""

import mmap
import os

import pytest
from catalogs import B, open_shared

from ecoffload.engine.base.errors import CatalogError
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import fault_points
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
from ecoffload.engine.catalog.shared.format import (
    H_EVICTABLE,
    H_HITS,
    H_TICK,
    MUTEX_AT,
    MUTEX_SLOT,
    P_COUNT,
    PIN_WORDS,
    S_PIN_HEAD,
    S_PINS,
    SLOT_WORDS,
)

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def catalog(path, native: bool) -> SharedCatalog:
    """READY items "a" (pinned once by this process) and "b" (unpinned), both seen."""
    c = open_shared(path, 16, max_key_bytes=4, max_items=8, max_pins=8)
    for key in ("a", "b"):
        c.reserve(key, 2 * B)
        c.commit(key)
    c.pin("a")
    if native and c._fast is None:
        pytest.skip("the shared catalog's C paths are not built on this host")
    if not native:
        c._fast = None
    return c


def region(c: SharedCatalog) -> bytes:
    return bytes(c._mm[:MUTEX_AT]) + bytes(c._mm[MUTEX_AT + MUTEX_SLOT :])


def outcome(call):
    try:
        got = call()
    except (CatalogError, ValueError, OverflowError) as e:
        return type(e).__name__
    return None if got is None else (got.key, got.pins) if hasattr(got, "key") else got


def slot_words(c, key):
    return c._sl + c.entry(key).slot * SLOT_WORDS


def record_of_a(c):
    return c._pn + c._w[slot_words(c, "a") + S_PIN_HEAD] * PIN_WORDS


LIMITS = {  # the word set at a limit, and the call that steps past it
    "hits": (lambda c: H_HITS, I64_MAX, lambda c: c.lookup("b")),
    "tick": (lambda c: H_TICK, I64_MAX, lambda c: c.lookup("b")),
    "pins": (lambda c: slot_words(c, "a") + S_PINS, I64_MAX, lambda c: c.pin("a")),
    "pin-count": (lambda c: record_of_a(c) + P_COUNT, I64_MAX, lambda c: c.pin("a")),
    "evictable-on-pin": (lambda c: H_EVICTABLE, I64_MIN, lambda c: c.pin("b")),
    "evictable-on-unpin": (lambda c: H_EVICTABLE, I64_MAX, lambda c: c.unpin("a")),
    "pins-on-unpin": (lambda c: slot_words(c, "a") + S_PINS, I64_MIN, lambda c: c.unpin("a")),
}


@pytest.mark.parametrize("limit", LIMITS)
def test_a_counter_at_an_int64_limit_answers_as_python_does(tmp_path, limit):
    where, value, call = LIMITS[limit]
    answers, regions = [], []
    for native in (True, False):
        c = catalog(tmp_path / f"c{native}", native)
        c._w[where(c)] = value
        fast_before = c._fast.slow if native else 0
        answers.append(outcome(lambda c=c: call(c)))
        if native:
            assert c._fast.slow == fast_before + 1  # declined: the Python way answered
        regions.append(region(c))
        c.close()
    assert answers[0] == answers[1] == "ValueError"  # a memoryview holds int64s only
    assert regions[0] == regions[1]


def hit_path_over(words: memoryview, c: SharedCatalog):
    lay = c.layout
    return shared_catalog_native.module().HitPath(
        words, c._seen, ItemState.READY, fault_points, c._sl, c._pn, lay.max_items,
        lay.max_pins, c._pid, c._start,
    )  # fmt: skip


def test_the_hit_path_refuses_a_read_only_mapping(tmp_path):
    c = catalog(tmp_path / "c", native=True)
    fd = os.open(c.path, os.O_RDONLY)
    try:
        ro = mmap.mmap(fd, c.layout.nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    words = memoryview(ro).cast("q")
    with pytest.raises(ValueError, match="writable memoryview"):
        hit_path_over(words, c)  # a hit through it would fault (SIGSEGV) on its first write
    words.release()
    ro.close()
    c.close()


def test_the_hit_path_refuses_an_immutable_buffer(tmp_path):
    c = catalog(tmp_path / "c", native=True)
    frozen = bytes(c._mm[: c.layout.nbytes])
    with pytest.raises(ValueError, match="writable memoryview"):
        hit_path_over(memoryview(frozen).cast("q"), c)
    assert frozen == bytes(c._mm[: c.layout.nbytes])  # nothing written into the bytes
    c.close()
