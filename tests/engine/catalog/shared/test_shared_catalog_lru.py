"""Making room in the shared catalog (engine/catalog/shared/lru.py, ``_make_room``):
a reserve that finds no room reaps dead processes' reservations first (at most
every 50 ms), then evicts the least recently used unpinned items, and is
refused when even both cannot make the room.

The dead processes are forked children that reserve and exit without
committing (fast: no interpreter start).
"""

import os
import signal
import time

from catalogs import B, open_shared


def die_holding(catalog, key, nbytes):
    """A forked child reserves ``key`` through ``catalog`` and exits without committing."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        code = 1
        try:
            code = 0 if catalog.reserve(key, nbytes) is not None else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def test_a_reserve_reaps_a_dead_process_s_reservation_then_evicts_what_is_still_missing(
    tmp_path,
):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    c.reserve("old", 5 * B)
    c.commit("old")
    die_holding(c, "dead", 3 * B)  # full: 3 blocks held by the dead, 5 evictable
    assert c.reserve("new", 8 * B) is not None  # the reap frees 3, "old" makes up the 5
    assert (c.state("dead"), c.state("old")) == (None, None)
    assert c.stats().evictions == 1
    c.check()
    c.close()


def test_the_reap_alone_makes_room_and_a_room_it_cannot_make_is_refused(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=4)
    die_holding(c, "dead", 8 * B)
    assert c.reserve("a", 8 * B) is not None  # the reap frees all 8: nothing evicted
    assert c.state("dead") is None and c.stats().evictions == 0
    c.commit("a")
    c.pin("a")
    assert c.reserve("b", B) is None  # nothing dead, nothing evictable
    c.unpin("a")
    c.evict("a")
    c.reserve("keep", 6 * B)
    c.commit("keep")
    c.pin("keep")
    die_holding(c, "dead2", 2 * B)
    time.sleep(0.1)  # past the 50 ms between reaps
    assert c.reserve("c", 4 * B) is None  # the reap frees 2 of the 4: still refused
    assert c.state("dead2") is None  # reaped all the same
    die_holding(c, "dead3", 2 * B)
    time.sleep(0.1)
    assert c.reserve("d", 2 * B) is not None  # the next reap, 100 ms on, is not held back
    assert c.state("keep") is not None and c.stats().evictions == 1  # "a", by hand
    c.unpin("keep")
    c.check()
    c.close()


def test_reaps_are_at_most_every_50_ms(tmp_path, monkeypatch):
    c = open_shared(tmp_path / "c", 4, max_items=4)
    c.reserve("all", 4 * B)
    c.commit("all")
    c.pin("all")
    reaps = []
    monkeypatch.setattr(c, "_reap", lambda: reaps.append(time.monotonic()) or 0)
    c._last_reap = time.monotonic() - 1.0
    assert c.reserve("a", B) is None and c.reserve("b", B) is None  # within 50 ms: one reap
    assert len(reaps) == 1
    c._last_reap = time.monotonic() - 0.06
    assert c.reserve("a", B) is None and len(reaps) == 2
    c.unpin("all")
    c.close()


def test_a_walk_over_every_slot_of_a_full_table_is_no_cycle(tmp_path):
    """Room for the whole arena takes the walk through all ``max_items`` slots: the
    cycle test stops a walk past that many hops, never one of exactly that many."""
    c = open_shared(tmp_path / "c", 8, max_items=4)
    for key in "abcd":
        c.reserve(key, 2 * B)
        c.commit(key)
    assert c.reserve("e", 8 * B) is not None
    assert c.stats().evictions == 4 and all(c.state(k) is None for k in "abcd")
    c.check()
    c.close()


def test_a_slot_a_hit_moved_to_the_tail_is_evicted_and_appended_after(tmp_path):
    """The Python paths (a hit is C's otherwise): a hit relinks its slot as the tail,
    whose links an eviction, an append and the checker then follow."""
    c = open_shared(tmp_path / "c", 8, max_items=4)
    c._fast = None
    for key in "abc":
        c.reserve(key, B)
        c.commit(key)
    assert c.lookup("a") is not None  # a, the head, to the tail: b c a
    c.check()
    c.evict("a")
    c.reserve("d", B)
    c.commit("d")
    assert c.lookup("b") is not None  # c d b
    c.check()
    assert c.reserve("e", 6 * B) is not None  # 5 free: c, the oldest, goes
    assert c.state("c") is None and c.stats().evictions == 2  # and "a", by hand
    assert c.state("d") is not None and c.state("b") is not None
    c.check()
    c.close()
