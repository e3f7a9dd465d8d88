"""A corrupt word in the shared catalog is never followed: no loop under the mutex, no write
outside the structure walked.

Each case damages one word of a healthy catalog with its dirty flag clear (a stray
write, or a writer's bug: nothing tells the next locker to rebuild), then runs one
operation in a forked child, through the C paths or the Python ones, with a
deadline: a child still running after it is killed and the test fails (a loop
under the process-shared mutex would block every process of the host). The
operation must raise CatalogCorruptError, having rebuilt the catalog, whose
check passes after.
"""

import os
import zlib

import pytest
from catalogs import B, open_shared, unhash
from deadline import in_child

from ecoffload.engine.base.errors import CatalogCorruptError, CatalogError
from ecoffload.engine.catalog.shared import format as fmt
from ecoffload.engine.catalog.shared import native as shared_catalog_native
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
from ecoffload.engine.catalog.shared.format import (
    H_CLASSES,
    H_DIRTY,
    H_LRU_TAIL,
    H_MASK,
    H_PIN_FREE,
    H_RECOVERIES,
    H_SLOT_FREE,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    P_NEXT,
    PIN_WORDS,
    S_BLOCKS,
    S_EXT,
    S_HASH,
    S_HNEXT,
    S_NEXT,
    S_PIN_HEAD,
    S_PREV,
    S_VERIFY,
    SLOT_WORDS,
    UNVERIFIED,
    VERIFIED,
)

DEADLINE_S = 10.0  # a fixed catalog answers in milliseconds; a loop never does
MAX_ITEMS, MAX_PINS, BLOCKS = 8, 4, 16


def healthy(path, native: bool) -> SharedCatalog:
    """Three READY items (``b`` pinned by this process), one WRITING, 9 blocks free."""
    c = open_shared(path, BLOCKS, max_key_bytes=4, max_items=MAX_ITEMS, max_pins=MAX_PINS)
    for key, blocks in (("abcd", 2), ("b", 3), ("w", 1), ("z", 1)):
        c.reserve(key, blocks * B)
    for key in ("abcd", "b", "z"):
        c.commit(key)
    c.pin("b")
    c.check()
    if not native:
        c._fast = None  # the Python paths alone
    elif c._fast is None:
        pytest.skip("the shared catalog's C paths are not built on this host")
    return c


def slot(c: SharedCatalog, key: str) -> int:
    return c.entry(key).slot


def words(c: SharedCatalog, key: str) -> int:
    return c._sl + slot(c, key) * SLOT_WORDS


def same_bucket(c: SharedCatalog, key: str) -> str:
    """A key not in the catalog whose hash chain is ``key``'s."""
    want = zlib.crc32(key.encode()) & c._hmask
    return next(
        k for k in (f"m{i}" for i in range(10_000)) if zlib.crc32(k.encode()) & c._hmask == want
    )


def in_child_with_deadline(op, here_under_mutation: bool = True) -> tuple[str, str]:
    """(outcome, message) of ``op()`` run in a forked child (tests/support/deadline.py):
    "returned", the name of the error it raised, or "hung" (killed at the deadline)."""

    def run() -> str:
        try:
            op()
        except Exception as e:
            return f"{type(e).__name__}\n{e}"
        return "returned\n"

    report = in_child(run, DEADLINE_S, here_under_mutation=here_under_mutation)
    if report == "killed":
        return "hung", f"still running after {DEADLINE_S} s (killed)"
    outcome, _, message = report.partition("\n")
    return outcome, message


def pin_list_cycle(c):
    r = c._w[words(c, "b") + S_PIN_HEAD]  # this process's record: the only one
    c._w[c._pn + r * PIN_WORDS + P_NEXT] = r


def extent_chain_cycle(c):
    e = c._w[words(c, "abcd") + S_EXT]
    c._i[c._en + e] = e


def unverified_extent_chain_cycle(c):
    """A warm start's UNVERIFIED item whose chain cycles and whose block count is huge:
    the walk that collects its extents for the check (issue 31) must stop."""
    b = words(c, "abcd")
    c._w[b + S_VERIFY] = UNVERIFIED
    c._w[b + S_BLOCKS] = 1 << 40
    c._w[H_VERIFY_LEFT], c._w[H_VERIFY_LEFT_BYTES] = 1, 2 * B
    extent_chain_cycle(c)


def checked(c, call):
    """``call`` on a catalog that knows where the data lies (one opened on an arena does;
    this one is told: the file's first page, never read before the walk fails)."""

    def op():
        c._data_at = (0, 4096)
        call()

    return fresh(c, op)


def hash_chain_cycle(c):
    b = words(c, "z")
    c._w[b + S_HNEXT] = slot(c, "z")


def fresh(c, call):
    """``call`` as a process that has seen no entry makes it (the child's copy of this
    object forgets what the parent saw)."""

    def op():
        c._seen.clear()
        call()

    return op


CASES = {  # damage, and the operations that must not follow it
    "pin-list-cycle": (pin_list_cycle, {
        "pin": lambda c: fresh(c, lambda: c.pin("b")),
        "unpin": lambda c: fresh(c, lambda: c.unpin("b")),
        "lookup-pin": lambda c: fresh(c, lambda: c.lookup("b", pin=True)),
    }),
    "pin-free-list-past-the-records": (
        lambda c: c._w.__setitem__(H_PIN_FREE, MAX_PINS + 2),
        {"pin": lambda c: fresh(c, lambda: c.pin("z"))},
    ),
    "slot-free-list-past-the-table": (
        lambda c: c._w.__setitem__(H_SLOT_FREE, MAX_ITEMS + 2),
        {"reserve": lambda c: lambda: c.reserve("new", B)},
    ),
    "free-extent-class-past-the-blocks": (
        lambda c: c._w.__setitem__(H_CLASSES + 3, BLOCKS + 100),  # 9 free blocks: class 3
        {"reserve": lambda c: lambda: c.reserve("new", B)},
    ),
    "lru-tail-past-the-table": (
        lambda c: c._w.__setitem__(H_LRU_TAIL, MAX_ITEMS + 3),
        {
            "lookup": lambda c: fresh(c, lambda: c.lookup("abcd")),
            "commit": lambda c: lambda: c.commit("w"),
        },
    ),
    "extent-chain-cycle": (extent_chain_cycle, {
        "entry": lambda c: fresh(c, lambda: c.entry("abcd")),
        "lookup": lambda c: fresh(c, lambda: c.lookup("abcd")),
        "evict": lambda c: lambda: c.evict("abcd"),
    }),
    "unverified-extent-chain-cycle": (unverified_extent_chain_cycle, {
        "lookup": lambda c: checked(c, lambda: c.lookup("abcd")),
        "verify-step": lambda c: checked(c, c.verify_step),  # grew a list without bound
    }),
    "hash-chain-cycle": (hash_chain_cycle, {
        "lookup-missing": lambda c: lambda: c.lookup(same_bucket(c, "z")),
        "reserve-same-bucket": lambda c: lambda: c.reserve(same_bucket(c, "z"), B),
    }),
}  # fmt: skip


def slot_word(key: str, word: int, value: int):
    """Damage: slot ``key``'s ``word`` (an LRU link, its state, shape, first extent...)
    set to ``value``."""
    return lambda c: c._w.__setitem__(words(c, key) + word, value)


# LRU links one past the table or below -1, each where an operation reads it: an eviction
# unlinks the tail "z", a lookup relinks the head "abcd", a commit appends after the tail
for value in (MAX_ITEMS, -2):
    for word, name in ((S_PREV, "prev"), (S_NEXT, "next")):
        CASES[f"lru-{name}-of-the-tail-at-{value}"] = (slot_word("z", word, value), {
            "evict": lambda c: lambda: c.evict("z")})  # fmt: skip
        CASES[f"lru-{name}-of-the-head-at-{value}"] = (slot_word("abcd", word, value), {
            "lookup": lambda c: fresh(c, lambda: c.lookup("abcd")),
            "evict": lambda c: lambda: c.evict("abcd")})  # fmt: skip
    CASES[f"lru-tail-at-{value}"] = (
        lambda c, value=value: c._w.__setitem__(H_LRU_TAIL, value),
        {"commit": lambda c: lambda: c.commit("w"),
         "lookup": lambda c: fresh(c, lambda: c.lookup("abcd"))},
    )  # fmt: skip
# links to slot 0 ("abcd"), which does not link back: the boundary of each link's test
CASES["lru-prev-of-the-tail-at-slot-0"] = (
    lambda c: c._w.__setitem__(words(c, "z") + S_PREV, slot(c, "abcd")),
    {"evict": lambda c: lambda: c.evict("z")},
)
CASES["lru-next-of-the-head-at-slot-0"] = (
    lambda c: c._w.__setitem__(words(c, "abcd") + S_NEXT, slot(c, "abcd")),
    {"lookup": lambda c: fresh(c, lambda: c.lookup("abcd"))},
)
CASES["lru-tail-s-successor-slot-0"] = (
    lambda c: c._w.__setitem__(words(c, "z") + S_NEXT, slot(c, "abcd")),
    {"commit": lambda c: lambda: c.commit("w")},
)


def past_the_table(c, word: int, value: int) -> None:
    """Slot ``nslots``'s ``word`` (the keys' first words) set to ``value``: what a link
    one past the table would find there."""
    c._w[c._sl + MAX_ITEMS * SLOT_WORDS + word] = value


# links one past the table, where the word they lead to looks right (a link back to the
# slot, the tail's empty next): only the bounds test stops them
CASES["lru-prev-of-the-tail-at-8-linking-back"] = (
    lambda c: (slot_word("z", S_PREV, MAX_ITEMS)(c), past_the_table(c, S_NEXT, slot(c, "z"))),
    {"evict": lambda c: lambda: c.evict("z")},
)
CASES["lru-tail-at-8-with-no-next"] = (
    lambda c: (c._w.__setitem__(H_LRU_TAIL, MAX_ITEMS), past_the_table(c, S_NEXT, -1)),
    {"commit": lambda c: lambda: c.commit("w")},
)


def foreign_pin(c, then: int | None) -> int:
    """Another process's pin record (a free one, filled in) put at the head of "b"'s pin
    list, its next ``then`` (None: this process's record, as a second pinner leaves it).
    A walk for this process's record passes it in this very process: no child needed."""
    w, s = c._w, slot(c, "b")
    r = w[fmt.H_PIN_FREE]
    p = c._pn + r * PIN_WORDS
    w[fmt.H_PIN_FREE] = w[p + P_NEXT]
    head = w[words(c, "b") + S_PIN_HEAD]
    w[p + fmt.P_SLOT], w[p + fmt.P_COUNT] = s, 1
    w[p + fmt.P_PID], w[p + fmt.P_START] = os.getppid(), 12345  # not this process
    w[p + P_NEXT] = head if then is None else then
    w[words(c, "b") + S_PIN_HEAD] = r
    w[words(c, "b") + fmt.S_PINS] += 1
    return r


PINNERS = {
    "pin": lambda c: fresh(c, lambda: c.pin("b")),
    "unpin": lambda c: fresh(c, lambda: c.unpin("b")),
    "lookup-pin": lambda c: fresh(c, lambda: c.lookup("b", pin=True)),
    "pin-many": lambda c: fresh(c, lambda: c.pin_many(["b", "z"])),
    "unpin-many": lambda c: fresh(c, lambda: c.unpin_many(["b"])),
}
# a reserve that finds no room reaps dead processes' pins first (13 blocks: the 9 free
# and the 3 evictable are not enough): the other process's record is a dead one's (the
# cycle, before the reap checked the whole list first, led its walk onto the free list
# and returned with the pins miscounted)
REAP = {"reserve-13": lambda c: lambda: c.reserve("new", 13 * B)}
CASES["dead-pin-record-cycle"] = (lambda c: foreign_pin(c, then=c._w[fmt.H_PIN_FREE]), REAP)
CASES["dead-pin-record-next-past-the-records"] = (lambda c: foreign_pin(c, then=MAX_PINS), REAP)
CASES["foreign-pin-record-cycle"] = (
    lambda c: foreign_pin(c, then=c._w[fmt.H_PIN_FREE]),  # its own index: itself
    PINNERS,
)
CASES["foreign-pin-record-next-past-the-records"] = (
    lambda c: foreign_pin(c, then=MAX_PINS),
    PINNERS,
)


# an eviction to make room drops its victims by slot: each is unlinked from its chain,
# and its blocks freed after the one-extent test or the whole chain's
CASES["hash-chain-missing-a-victim"] = (
    lambda c: unhash(c, slot(c, "z")),
    {"reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)


def victim_chain_cycle(c) -> None:
    """Damage: "z" off its chain, which now runs round "b" for ever."""
    unhash(c, slot(c, "z"))
    w = c._w
    w[c._bk + (w[words(c, "z") + S_HASH] & c._hmask)] = slot(c, "b")
    w[words(c, "b") + S_HNEXT] = slot(c, "b")


CASES["hash-chain-cycle-without-a-victim"] = (
    victim_chain_cycle,
    {"reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)
# words a fresh reader decodes into an entry (a lookup by a process that has not seen it)
fresh_lookup = {"lookup": lambda c: fresh(c, lambda: c.lookup("abcd"))}
CASES["shape-of-too-many-dimensions"] = (slot_word("abcd", fmt.S_NDIM, 9), fresh_lookup)
CASES["extent-count-zero"] = (
    lambda c: c._i.__setitem__(c._ec + c.entry("abcd").extents[0].start, 0),
    fresh_lookup,
)
CASES["extent-at-the-watermark"] = (slot_word("abcd", fmt.S_EXT, 16), fresh_lookup)


def one_extent_past_the_blocks(c) -> None:
    """Damage: "z"'s one extent (block 6) made 12 blocks long, its block and byte words
    to match: the chain looks whole, but runs 2 blocks past the 16 the table has."""
    w, b = c._w, words(c, "z")
    c._i[c._ec + c.entry("z").extents[0].start] = 12
    w[b + fmt.S_BLOCKS], w[b + fmt.S_NBYTES] = 12, 12 * B


CASES["one-extent-past-the-blocks"] = (
    one_extent_past_the_blocks,
    {"evict": lambda c: lambda: c.evict("z")},
)
CASES["hash-chain-slot-in-no-state"] = (
    slot_word("z", fmt.S_STATE, 9),
    {"lookup": lambda c: fresh(c, lambda: c.lookup("z"))},
)
CASES["hash-chain-next-at-8"] = (
    slot_word("z", S_HNEXT, MAX_ITEMS),
    {"lookup-missing": lambda c: lambda: c.lookup(same_bucket(c, "z"))},
)
# the pin free list's head one past the records, and at a record in use (this process's
# pin of "b": record 0, count 1)
CASES["pin-free-list-at-the-record-count"] = (
    lambda c: c._w.__setitem__(H_PIN_FREE, MAX_PINS),
    {"pin": lambda c: fresh(c, lambda: c.pin("z"))},
)
CASES["pin-free-list-at-a-record-in-use"] = (
    lambda c: c._w.__setitem__(H_PIN_FREE, c._w[words(c, "b") + S_PIN_HEAD]),
    {"pin": lambda c: fresh(c, lambda: c.pin("z"))},
)
CASES["slot-free-list-at-a-slot-in-use"] = (  # "z", READY
    lambda c: c._w.__setitem__(H_SLOT_FREE, slot(c, "z")),
    {"reserve": lambda c: lambda: c.reserve("new", B)},
)
CASES["slot-free-list-at-the-slot-count"] = (
    lambda c: c._w.__setitem__(H_SLOT_FREE, MAX_ITEMS),  # one past: the first key's bytes
    {"reserve": lambda c: lambda: c.reserve("new", B)},
)


def victim_chain_past_the_table(c) -> None:
    """Damage: "z" off its chain, which now starts one past the slot table."""
    unhash(c, slot(c, "z"))
    c._w[c._bk + (c._w[words(c, "z") + S_HASH] & c._hmask)] = MAX_ITEMS


CASES["hash-chain-of-a-victim-past-the-table"] = (
    victim_chain_past_the_table,
    {"reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)
CASES["extent-count-off-by-one"] = (
    lambda c: c._i.__setitem__(c._ec + c.entry("abcd").extents[0].start, 1),  # of 2
    {"evict": lambda c: lambda: c.evict("abcd"),
     "reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)  # fmt: skip
CASES["lru-tail-s-successor-slot-0"][1]["evict"] = lambda c: lambda: c.evict("z")
# the tail word at -1 (an empty list) while slots are listed: a hit on the head appended
# it after slot -1, a word of the bucket table (found by mutating _check_links)
CASES["lru-tail-at--1"] = (
    lambda c: c._w.__setitem__(H_LRU_TAIL, -1),
    {"lookup": lambda c: fresh(c, lambda: c.lookup("abcd")),
     "commit": lambda c: lambda: c.commit("w")},
)  # fmt: skip
CASES["lru-tail-at-slot-0"] = (  # the head, which has a successor
    lambda c: c._w.__setitem__(H_LRU_TAIL, slot(c, "abcd")),
    {"commit": lambda c: lambda: c.commit("w")},
)
CASES["lru-next-of-the-head-at--1"] = (
    slot_word("abcd", S_NEXT, -1),
    {"lookup": lambda c: fresh(c, lambda: c.lookup("abcd"))},
)
CASES["lru-prev-of-the-head-s-successor-elsewhere"] = (
    lambda c: c._w.__setitem__(words(c, "b") + S_PREV, slot(c, "z")),
    {"evict": lambda c: lambda: c.evict("abcd")},
)
# an eviction's walk from the head: past the table, and round a pinned slot for ever
# (12 blocks wanted: the 9 free and the 3 evictable, so the walk goes on past "abcd")
CASES["lru-next-of-the-head-past-the-table"] = (
    slot_word("abcd", S_NEXT, MAX_ITEMS),
    {"reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)
CASES["lru-cycle-at-a-pinned-slot"] = (
    lambda c: c._w.__setitem__(words(c, "b") + S_NEXT, slot(c, "b")),
    {"reserve": lambda c: lambda: c.reserve("new", 12 * B)},
)


def block_word(array: str, block: int, value: int):
    """Damage: ``block``'s word of the per-block array ``array`` (``_fs`` sizes, ``_fe``
    end tags, ``_fn``/``_fp`` free-list links) set to ``value``."""
    return lambda c: c._i.__setitem__(getattr(c, array) + block, value)


def class_head(k: int, value: int):
    return lambda c: c._w.__setitem__(H_CLASSES + k, value)


# Free extents: blocks 7-15 are the only one (9 blocks, class 3). A reserve of 8 scans
# class 3, of 9 fits it exactly, of 4 or 1 takes the head of class 3 unscanned; an
# eviction of "abcd" (blocks 0-1, no free neighbour) inserts into class 1.
reserve = {n: (lambda c, n=n: lambda: c.reserve("new", n * B)) for n in (1, 4, 8, 9)}
stats = {"stats": lambda c: lambda: c.stats()}
for name, damage, ops in (
    ("free-extent-next-at-the-block-count", block_word("_fn", 7, 16),
     {"reserve-8": reserve[8], "reserve-9": reserve[9], **stats}),
    ("free-extent-next-at--2", block_word("_fn", 7, -2), {"reserve-9": reserve[9]}),
    ("free-extent-prev-past-the-blocks", block_word("_fp", 7, 16), {"reserve-8": reserve[8]}),
    ("free-extent-prev-at--2", block_word("_fp", 7, -2), {"reserve-8": reserve[8]}),
    ("free-extent-longer-than-the-blocks", block_word("_fs", 7, 100),
     {"reserve-8": reserve[8]}),
    ("free-extent-one-block-past-the-end", block_word("_fs", 7, 10), {"reserve-8": reserve[8]}),
    ("free-extent-shorter-than-its-class", block_word("_fs", 7, 2), {"reserve-4": reserve[4]}),
    ("free-extent-class-head-at-a-used-block", class_head(3, 0), {"reserve-8": reserve[8]}),
    ("free-extent-class-head-at-the-block-count", class_head(3, 16),
     {"reserve-1": reserve[1]}),
    ("free-extent-mask-cleared", lambda c: c._w.__setitem__(H_MASK, 0),
     {"reserve-4": reserve[4]}),
    ("free-extent-class-1-head-at--2", class_head(1, -2),
     {"evict": lambda c: lambda: c.evict("abcd")}),
    ("free-extent-class-1-head-at-the-block-count", class_head(1, 16),
     {"evict": lambda c: lambda: c.evict("abcd")}),
    ("free-extent-top-class-cycle", block_word("_fn", 7, 7), stats),
):  # fmt: skip
    CASES[name] = (damage, ops)
RUNS = [(case, op) for case, (_, ops) in CASES.items() for op in ops]
# What the error names: the damaged word, its value and what it leads to, the same
# through the C paths and Python's (slots: "abcd" 0, "b" 1, "w" 2, "z" 3)
SAYS = {
    ("dead-pin-record-cycle", "reserve-13"):
        "slot 1's pin list reaches record 1 after 4 records (records: 4)",
    ("dead-pin-record-next-past-the-records", "reserve-13"):
        "slot 1's pin list reaches record 4 after 1 records (records: 4)",
    ("slot-free-list-at-the-slot-count", "reserve"): "the slot free list's head is slot 8 of 8",
    ("slot-free-list-at-a-slot-in-use", "reserve"):
        "the slot free list's head is slot 3 of 8, in state 2",
    ("hash-chain-of-a-victim-past-the-table", "reserve"):
        "slot 3 is not on its hash chain (it reaches 8 after 0 hops)",
    ("pin-free-list-at-the-record-count", "pin"): "the pin free list's head is record 4 of 4",
    ("pin-free-list-at-a-record-in-use", "pin"):
        "the pin free list's head is record 0 of 4, with a count of 1",
    ("shape-of-too-many-dimensions", "lookup"): "slot 0 holds a shape of 9 dimensions",
    ("extent-count-zero", "lookup"):
        "slot 0's extent chain reaches (0, 0) after 0 extents (ready blocks: 16)",
    ("one-extent-past-the-blocks", "evict"):
        "slot 3's extent chain reaches (6, 12) after 0 extents (ready blocks: 16)",
    ("extent-at-the-watermark", "lookup"):
        "slot 0's extent chain reaches (16, 0) after 0 extents (ready blocks: 16)",
    ("hash-chain-slot-in-no-state", "lookup"): "slot 3 is on a hash chain in state 9",
    ("hash-chain-next-at-8", "lookup-missing"):
        "hash chain of bucket 7 reaches slot 8 after 1 hops (slots: 8)",
    ("hash-chain-missing-a-victim", "reserve"):
        "slot 3 is not on its hash chain (it reaches -1 after 0 hops)",
    ("hash-chain-cycle-without-a-victim", "reserve"):  # "abcd", sharing z's bucket, first
        "slot 0 is not on its hash chain (it reaches 1 after 8 hops)",
    ("extent-count-off-by-one", "evict"): "slot 0's extents hold 1 blocks, its count 2",
    ("extent-count-off-by-one", "reserve"): "slot 0's extents hold 1 blocks, its count 2",
    ('pin-list-cycle', 'pin'): "slot 1's pin list reaches record 0 after 4 records (records: 4)",
    ('pin-list-cycle', 'unpin'): "slot 1's pin list reaches record 0 after 4 records (records: 4)",
    ('pin-list-cycle', 'lookup-pin'):
        "slot 1's pin list reaches record 0 after 4 records (records: 4)",
    ('pin-free-list-past-the-records', 'pin'): "the pin free list's head is record 6 of 4",
    ('slot-free-list-past-the-table', 'reserve'): "the slot free list's head is slot 10 of 8",
    ('lru-tail-past-the-table', 'lookup'):
        'LRU links of slot 0 (previous -1, next 1, tail 11) do not link back to it (slots: 8)',
    ('lru-tail-past-the-table', 'commit'):
        'LRU: the tail is slot 11 (head 0, slots: 8), not the last',
    ('extent-chain-cycle', 'entry'):
        "slot 0's extent chain reaches (0, 2) after 16 extents (ready blocks: 16)",
    ('extent-chain-cycle', 'lookup'):
        "slot 0's extent chain reaches (0, 2) after 16 extents (ready blocks: 16)",
    ('extent-chain-cycle', 'evict'):
        "slot 0's extent chain reaches (0, 2) after 16 extents (ready blocks: 16)",
    ('unverified-extent-chain-cycle', 'lookup'):
        "slot 0's extent chain reaches (0, 2) after 16 extents (ready blocks: 16)",
    ('unverified-extent-chain-cycle', 'verify-step'):
        "slot 0's extent chain reaches (0, 2) after 16 extents (ready blocks: 16)",
    ('hash-chain-cycle', 'lookup-missing'):
        'hash chain of bucket 7 reaches slot 3 after 8 hops (slots: 8)',
    ('hash-chain-cycle', 'reserve-same-bucket'):
        'hash chain of bucket 7 reaches slot 3 after 8 hops (slots: 8)',
    ('lru-prev-of-the-tail-at-8', 'evict'):
        'LRU links of slot 3 (previous 8, next -1, tail -1) do not link back to it (slots: 8)',
    ('lru-prev-of-the-head-at-8', 'lookup'):
        'LRU links of slot 0 (previous 8, next 1, tail 3) do not link back to it (slots: 8)',
    ('lru-prev-of-the-head-at-8', 'evict'):
        'LRU links of slot 0 (previous 8, next 1, tail -1) do not link back to it (slots: 8)',
    ('lru-next-of-the-tail-at-8', 'evict'):
        'LRU links of slot 3 (previous 1, next 8, tail -1) do not link back to it (slots: 8)',
    ('lru-next-of-the-head-at-8', 'lookup'):
        'LRU links of slot 0 (previous -1, next 8, tail 3) do not link back to it (slots: 8)',
    ('lru-tail-at-8', 'lookup'):
        'LRU links of slot 0 (previous -1, next 1, tail 8) do not link back to it (slots: 8)',
    ('lru-prev-of-the-tail-at--2', 'evict'):
        'LRU links of slot 3 (previous -2, next -1, tail -1) do not link back to it (slots: 8)',
    ('lru-prev-of-the-head-at--2', 'lookup'):
        'LRU links of slot 0 (previous -2, next 1, tail 3) do not link back to it (slots: 8)',
    ('lru-prev-of-the-head-at--2', 'evict'):
        'LRU links of slot 0 (previous -2, next 1, tail -1) do not link back to it (slots: 8)',
    ('lru-next-of-the-tail-at--2', 'evict'):
        'LRU links of slot 3 (previous 1, next -2, tail -1) do not link back to it (slots: 8)',
    ('lru-next-of-the-head-at--2', 'lookup'):
        'LRU links of slot 0 (previous -1, next -2, tail 3) do not link back to it (slots: 8)',
    ('lru-next-of-the-head-at--2', 'evict'):
        'LRU links of slot 0 (previous -1, next -2, tail -1) do not link back to it (slots: 8)',
    ('lru-tail-at--2', 'commit'): 'LRU: the tail is slot -2 (head 0, slots: 8), not the last',
    ('lru-next-of-the-head-at-slot-0', 'lookup'):
        'LRU links of slot 0 (previous -1, next 0, tail 3) do not link back to it (slots: 8)',
    ('lru-tail-s-successor-slot-0', 'commit'):
        'LRU: the tail is slot 3 (head 0, slots: 8), not the last',
    ('lru-tail-s-successor-slot-0', 'evict'):
        'LRU links of slot 3 (previous 1, next 0, tail -1) do not link back to it (slots: 8)',
    ("lru-tail-at--1", "lookup"): "LRU: slot 0 has successor 1 but the tail is -1",
    ("lru-tail-at--1", "commit"): "LRU: the tail is slot -1 (head 0, slots: 8), not the last",
    ("lru-tail-at-slot-0", "commit"): "LRU: the tail is slot 0 (head 0, slots: 8), not the last",
    ("lru-tail-at-8", "commit"): "LRU: the tail is slot 8 (head 0, slots: 8), not the last",
    **{("foreign-pin-record-cycle", op):
       "slot 1's pin list reaches record 1 after 4 records (records: 4)" for op in PINNERS},
    **{("foreign-pin-record-next-past-the-records", op):
       "slot 1's pin list reaches record 4 after 1 records (records: 4)" for op in PINNERS},
    ("lru-tail-at-8-with-no-next", "commit"):
        "LRU: the tail is slot 8 (head 0, slots: 8), not the last",
    ("lru-tail-at--2", "lookup"):
        "LRU links of slot 0 (previous -1, next 1, tail -2) do not link back to it (slots: 8)",
    ("lru-prev-of-the-tail-at-8-linking-back", "evict"):
        "LRU links of slot 3 (previous 8, next -1, tail -1) do not link back to it (slots: 8)",
    ("lru-next-of-the-head-at-8", "evict"):
        "LRU links of slot 0 (previous -1, next 8, tail -1) do not link back to it (slots: 8)",
    ("lru-next-of-the-head-at--1", "lookup"): "LRU: slot 0 has successor -1 but the tail is 3",
    ("lru-prev-of-the-tail-at-slot-0", "evict"):
        "LRU links of slot 3 (previous 0, next -1, tail -1) do not link back to it (slots: 8)",
    ("lru-prev-of-the-head-s-successor-elsewhere", "evict"):
        "LRU links of slot 0 (previous -1, next 1, tail -1) do not link back to it (slots: 8)",
    ("lru-next-of-the-head-past-the-table", "reserve"):
        "LRU list reaches slot 8 after 1 (slots: 8)",
    ("lru-cycle-at-a-pinned-slot", "reserve"): "LRU list reaches slot 1 after 8 (slots: 8)",
    ("free-extent-class-past-the-blocks", "reserve"):
        "free extent at block 116 of 16: 0 blocks, links -1, -1",
    ("free-extent-next-at-the-block-count", "reserve-8"): "free extents of class 3 reach block 16",
    ("free-extent-next-at-the-block-count", "reserve-9"):
        "free extent at block 7 of 16: 9 blocks, links -1, 16",
    ("free-extent-next-at-the-block-count", "stats"):
        "the longest free extents reach block 16 after 1",
    ("free-extent-next-at--2", "reserve-9"): "free extent at block 7 of 16: 9 blocks, links -1, -2",
    ("free-extent-prev-past-the-blocks", "reserve-8"):
        "free extent at block 7 of 16: 9 blocks, links 16, -1",
    ("free-extent-prev-at--2", "reserve-8"): "free extent at block 7 of 16: 9 blocks, links -2, -1",
    ("free-extent-longer-than-the-blocks", "reserve-8"):
        "free extent at block 7 of 16: 100 blocks, links -1, -1",
    ("free-extent-one-block-past-the-end", "reserve-8"):
        "free extent at block 7 of 16: 10 blocks, links -1, -1",
    ("free-extent-shorter-than-its-class", "reserve-4"):
        "free extent at block 7: 2 blocks, taken for 4",
    ("free-extent-class-head-at-a-used-block", "reserve-8"):
        "free extent at block 0 of 16: 0 blocks, links -1, -1",
    ("free-extent-class-head-at-the-block-count", "reserve-1"):
        "free extent at block 16 of 16: 0 blocks, links -1, -1",
    ("free-extent-mask-cleared", "reserve-4"):
        "no free extent left for 4 blocks, though 9 were counted free",
    ("free-extent-class-1-head-at--2", "evict"):
        "free extents of class 1 start at block -2 (blocks: 16)",
    ("free-extent-class-1-head-at-the-block-count", "evict"):
        "free extents of class 1 start at block 16 (blocks: 16)",
    ("free-extent-top-class-cycle", "stats"): "the longest free extents reach block 7 after 16",
}  # fmt: skip


@pytest.mark.parametrize("native", [True, False], ids=["c-paths", "python"])
@pytest.mark.parametrize(("case", "op"), RUNS, ids=[f"{c}-{o}" for c, o in RUNS])
def test_a_corrupt_word_is_refused_within_the_deadline_and_rebuilt(tmp_path, case, op, native):
    c = healthy(tmp_path / "c", native)
    damage, ops = CASES[case]
    damage(c)
    assert c._w[H_DIRTY] == 0  # nothing tells a locker to rebuild
    recoveries = c._w[H_RECOVERIES]
    # another process's pins (the child's) are what a pin-list walk passes: in a child only
    outcome, message = in_child_with_deadline(ops[op](c), not case.startswith("pin-list"))
    assert outcome == "CatalogCorruptError", message
    assert "rebuilt from its slot table" in message
    assert f": {SAYS[case, op]} (a stray write" in message  # all of what it names
    assert c._w[H_RECOVERIES] == recoveries + 1
    c.check()  # consistent again, dirty clear, nothing lost
    assert c.state("b") is not None and "b" in c  # the live pin kept it
    c.close()


def test_a_corrupt_error_is_a_catalog_error_and_the_operation_can_be_retried(tmp_path, caplog):
    c = healthy(tmp_path / "c", native=False)
    c._w[H_SLOT_FREE] = MAX_ITEMS + 2
    with pytest.raises(CatalogError, match="the slot free list's head is slot 10 of 8"):
        c.reserve("new", B)
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (  # the operator's line: which file, what, what now
        f"catalog {c.path}: the slot free list's head is slot 10 of 8; "
        "rebuilding it from its slot table"
    )
    assert issubclass(CatalogCorruptError, CatalogError)
    assert c.reserve("new", B) is not None  # the rebuilt catalog serves at once
    c.check()
    c.close()


def test_a_slot_free_list_head_one_past_the_table_is_refused_whatever_word_it_reaches(
    tmp_path,
):
    """The head at the slot count reaches the key table's first word; with no key saved
    yet that word is 0, as a FREE slot's state reads: refused by the head's own test,
    never reserved (a reservation there would write the key table)."""
    c = open_shared(tmp_path / "c", BLOCKS, max_key_bytes=4, max_items=MAX_ITEMS)
    assert not any(c._k[:8])  # the word one past the slot table reads FREE
    c._w[H_SLOT_FREE] = MAX_ITEMS
    with pytest.raises(CatalogCorruptError) as err:
        c.reserve("new", B)
    assert "the slot free list's head is slot 8 of 8 (a stray write" in str(err.value)
    assert not any(c._k[:8])  # the key table as it was
    assert c.reserve("new", B) is not None  # rebuilt: the free list is the slots again
    c.check()
    c.close()


def test_the_hash_word_of_a_slot_never_indexes_past_the_buckets(tmp_path):
    """A slot's hash word is masked into the bucket table (a corrupt one picks a wrong
    chain, which the walk then refuses, never a word past the table)."""
    c = healthy(tmp_path / "c", native=False)
    c._w[words(c, "z") + S_HASH] = 2**62 + 5
    outcome, message = in_child_with_deadline(lambda: c.evict("z"))
    assert outcome == "CatalogCorruptError" and "is not on its hash chain" in message, message
    c.check()
    c.close()


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.setenv(shared_catalog_native.ENV_VAR, "1")


@pytest.mark.parametrize("mark", [3, -1, 23, 2**63 - 1], ids=lambda m: f"mark-{m}")
def test_a_ready_item_whose_verification_mark_is_no_mark_is_freed_by_recovery(tmp_path, mark):
    """A READY slot whose S_VERIFY word holds none of VERIFIED, UNVERIFIED, FAILED does
    not parse: recovery frees it (as any slot that does not parse), so the catalog
    checks after (found by the fuzzer damaging the verification words: recovery kept
    the slot and its mark, and the check refused the rebuilt catalog)."""
    c = healthy(tmp_path / "c", native=False)
    c._w[words(c, "abcd") + S_VERIFY] = mark
    c._seen.clear()  # a process that has not seen it READY
    assert c.lookup("abcd") is None  # not served meanwhile: a miss
    c.recover()
    c.check()
    assert "abcd" not in c and c.state("abcd") is None
    assert c.lookup("z") is not None and c.state("b") is not None  # the others kept
    c.close()


def test_a_left_tag_naming_no_free_extent_is_checked_not_followed(tmp_path):
    """A free's left neighbour is found by the end tag of the block below it, a hint
    checked against the neighbour's own size word before the two are merged."""
    c = healthy(tmp_path / "c", native=False)
    c._i[c._fe + 5] = 2  # block 5 ("w") tagged as the end of a free extent from 2 ("b")
    c.evict("z")  # block 6: merged with 7-15 on its right, not with 2-5 on its left
    assert c.allocator.free_blocks == 10 and c.stats().largest_free_extent == 10
    assert [tuple(e) for e in c.reserve("new", 10 * B).extents] == [(6, 10)]
    c.close()


def test_a_pin_behind_another_process_s_record_is_found_and_unlinked(tmp_path):
    c = healthy(tmp_path / "c", native=False)
    r = foreign_pin(c, then=None)  # b: the other process's record, then this one's
    c.check()
    c.unpin("b")  # this process's record, second on the list, unlinked
    assert c._w[words(c, "b") + S_PIN_HEAD] == r and c._w[words(c, "b") + fmt.S_PINS] == 1
    c.check()
    with pytest.raises(CatalogError):
        c.unpin("b")  # none of this process's left
    c.close()


def test_an_unverified_item_dropped_leaves_the_counts_and_its_slot_right(tmp_path):
    """A warm start's UNVERIFIED item evicted: the header's count of items and bytes
    left to verify lose it, and its slot, reused, holds a VERIFIED item."""
    c = healthy(tmp_path / "c", native=False)
    c._w[words(c, "abcd") + S_VERIFY] = UNVERIFIED
    c._w[H_VERIFY_LEFT], c._w[H_VERIFY_LEFT_BYTES] = 1, 2 * B
    c.check()
    s = slot(c, "abcd")
    c.evict("abcd")
    assert (c._w[H_VERIFY_LEFT], c._w[H_VERIFY_LEFT_BYTES]) == (0, 0)
    c.check()
    c.reserve("new", B)
    assert slot(c, "new") == s and c._w[words(c, "new") + S_VERIFY] == VERIFIED
    c.check()
    c.close()
