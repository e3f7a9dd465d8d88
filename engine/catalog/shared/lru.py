"""The shared catalog's eviction policy: least recently used, READY unpinned items first.

READY slots form one intrusive doubly linked list in use order (``S_PREV`` /
``S_NEXT``, ends in the header), each stamped with a use tick (``S_TICK``,
from which recovery rebuilds the order). A commit stamps its slot before
publishing it and appends it (:meth:`_lru_append`), a hit moves it to the tail
(:meth:`_lru_touch`), a drop unlinks it
(:meth:`_lru_unlink`); :meth:`_make_room` walks from the head. Changing the
policy means changing this file.
"""

from __future__ import annotations

import time

from .format import (
    H_DIRTY,
    H_EVICTABLE,
    H_FREE_BLOCKS,
    H_LRU_HEAD,
    H_LRU_TAIL,
    H_SLOT_FREE,
    H_TICK,
    S_BLOCKS,
    S_NEXT,
    S_PINS,
    S_PREV,
    S_TICK,
    SLOT_WORDS,
)
from .state import CatalogState


class LRUPolicy(CatalogState):
    """LRU order and eviction (a mixin of the shared catalog; lock held throughout)."""

    def _lru_touch(self, s: int, b: int) -> None:
        """A hit on READY slot ``s`` (its words at ``b``): the most recently used. Marks
        the catalog dirty when it relinks (the tick alone is no structure)."""
        w, sl = self._w, self._sl
        tick = w[H_TICK] + 1
        w[H_TICK] = tick
        w[b + S_TICK] = tick
        tail = w[H_LRU_TAIL]
        if tail != s:  # to the tail: s has a successor
            w[H_DIRTY] = self._pid
            prev, nxt = w[b + S_PREV], w[b + S_NEXT]
            self._check_links(s, prev, nxt, tail)
            if nxt < 0 or tail < 0:  # s is listed, not last: it has a successor, the list a tail
                self._corrupt(f"LRU: slot {s} has successor {nxt} but the tail is {tail}")
            if prev >= 0:
                w[sl + prev * SLOT_WORDS + S_NEXT] = nxt
            else:
                w[H_LRU_HEAD] = nxt
            w[sl + nxt * SLOT_WORDS + S_PREV] = prev
            w[b + S_PREV] = tail
            w[b + S_NEXT] = -1
            w[sl + tail * SLOT_WORDS + S_NEXT] = s
            w[H_LRU_TAIL] = s

    def _check_links(self, s: int, prev: int, nxt: int, tail: int = -1) -> None:
        """The LRU words around slot ``s`` name slots of the table (or -1 for none) that
        link back to ``s``; else the list is damaged and is not followed."""
        w, sl, n = self._w, self._sl, self._nslots
        if not (-1 <= prev < n and -1 <= nxt < n and -1 <= tail < n) or (
            prev >= 0 and w[sl + prev * SLOT_WORDS + S_NEXT] != s
        ) or (nxt >= 0 and w[sl + nxt * SLOT_WORDS + S_PREV] != s):  # fmt: skip
            self._corrupt(f"LRU links of slot {s} (previous {prev}, next {nxt}, tail {tail}) "
                          f"do not link back to it (slots: {n})")  # fmt: skip

    def _lru_append(self, s: int) -> None:
        w, sl = self._w, self._sl
        b = sl + s * SLOT_WORDS
        tail = w[H_LRU_TAIL]
        if (
            not -1 <= tail < self._nslots
            or (tail >= 0 and w[sl + tail * SLOT_WORDS + S_NEXT] >= 0)
            or (tail < 0 and w[H_LRU_HEAD] >= 0)  # an empty list has no head either
        ):
            head = w[H_LRU_HEAD]
            self._corrupt(f"LRU: the tail is slot {tail} (head {head}, slots: {self._nslots}), "
                          "not the last")  # fmt: skip
        w[b + S_PREV] = tail
        w[b + S_NEXT] = -1
        if tail >= 0:
            w[sl + tail * SLOT_WORDS + S_NEXT] = s
        else:
            w[H_LRU_HEAD] = s
        w[H_LRU_TAIL] = s

    def _lru_unlink(self, s: int) -> None:
        w, sl, n = self._w, self._sl, self._nslots
        b = sl + s * SLOT_WORDS
        prev, nxt = w[b + S_PREV], w[b + S_NEXT]
        if not (-1 <= prev < n and -1 <= nxt < n) or (
            prev >= 0 and w[sl + prev * SLOT_WORDS + S_NEXT] != s
        ) or (nxt >= 0 and w[sl + nxt * SLOT_WORDS + S_PREV] != s):  # fmt: skip
            self._check_links(s, prev, nxt)  # _check_links's test inline (an eviction's
            # hot path: a call less), then the call that names what is wrong and raises
        if prev >= 0:
            w[sl + prev * SLOT_WORDS + S_NEXT] = nxt
        else:
            w[H_LRU_HEAD] = nxt
        if nxt >= 0:
            w[sl + nxt * SLOT_WORDS + S_PREV] = prev
        else:
            w[H_LRU_TAIL] = prev

    def _make_room(self, need: int) -> bool:
        """Evict LRU items until ``need`` blocks and one slot are free; False if impossible."""
        w = self._w
        if need <= w[H_FREE_BLOCKS] and w[H_SLOT_FREE] >= 0:
            return True
        if w[H_FREE_BLOCKS] + w[H_EVICTABLE] < need or (w[H_SLOT_FREE] < 0 and not w[H_EVICTABLE]):
            now = time.monotonic()
            if now - self._last_reap < 0.05 or not self._reap():
                self._last_reap = now
                return False
            self._last_reap = now  # the walk below finds whether the reap made room enough
        sl = self._sl
        victims, room, slot_free = [], w[H_FREE_BLOCKS], w[H_SLOT_FREE] >= 0
        s, hops = w[H_LRU_HEAD], 0
        while s >= 0 and (room < need or not slot_free):  # oldest first
            if s >= self._nslots or hops >= self._nslots:  # past the table, or a cycle
                self._corrupt(f"LRU list reaches slot {s} after {hops} (slots: {self._nslots})")
            hops += 1
            b = sl + s * SLOT_WORDS
            if w[b + S_PINS] == 0:
                victims.append(s)
                room += w[b + S_BLOCKS]
                slot_free = True
            s = w[b + S_NEXT]
        if room < need or not slot_free:
            return False
        for s in victims:
            self._drop(s, evicted=True)
        return True
