"""The catalog protocol (:class:`~ecoffload.engine.catalog.protocol.CatalogProtocol`),
run against both implementations: the in-process :class:`Catalog` and the
:class:`SharedCatalog` in a file's metadata region."""

import inspect

import pytest
from catalogs import B, open_shared

from ecoffload.engine.base.errors import (
    DuplicateItemError,
    InvalidSizeError,
    ItemStateError,
    ItemTooLargeError,
    UnknownItemError,
)
from ecoffload.engine.catalog.allocator import BlockAllocator
from ecoffload.engine.catalog.catalog import Catalog, ItemState
from ecoffload.engine.catalog.protocol import CatalogProtocol


@pytest.fixture(params=["local", "shared"])
def make(request, tmp_path):
    opened = []

    def make_(blocks=10, ready_blocks=None):
        if request.param == "local":
            return Catalog(BlockAllocator(blocks, B, ready_blocks))
        opened.append(open_shared(tmp_path / f"catalog-{len(opened)}", blocks,
                                  ready_blocks=ready_blocks))  # fmt: skip
        return opened[-1]

    yield make_
    for c in opened:
        c.check()
        c.close()


PROTOCOL_METHODS = [
    name for name, value in vars(CatalogProtocol).items()
    if callable(value) and (not name.startswith("_") or name in ("__len__", "__contains__"))
]  # fmt: skip


@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_both_catalogs_accept_every_call_the_protocol_allows(make, method):
    c = make()
    assert isinstance(c, CatalogProtocol)
    want = inspect.signature(getattr(CatalogProtocol, method))
    got = inspect.signature(getattr(type(c), method))
    for name, param in want.parameters.items():  # same names, kinds and defaults
        assert name in got.parameters, f"{type(c).__name__}.{method} lacks {name!r}"
        impl = got.parameters[name]
        assert impl.kind == param.kind and impl.default == param.default, (method, impl)
    extra = [p for n, p in got.parameters.items() if n not in want.parameters]
    assert all(p.default is not p.empty for p in extra), f"{method}: required extras {extra}"


def test_reservations_follow_the_ready_prefix_they_are_given(make):
    c = make(blocks=8, ready_blocks=2)
    ready = [2]
    c.follow_ready(lambda: ready[0])
    assert c.reserve("big", 3 * B) is None  # only 2 blocks are ready: refused, not an error
    ready[0] = 6  # the arena's populate went on: the next reservation sees it
    e = c.reserve("big", 3 * B)
    assert e is not None and all(s + n <= 6 for s, n in e.extents)
    assert c.stats().ready_blocks == 6 and c.allocator.ready_blocks == 6
    c.commit("big")
    c.check()


def test_two_phase_commit_hides_writing_items(make):
    c = make()
    e = c.reserve("a", 3 * B, "bfloat16", (3, 2048))
    assert e.state is ItemState.WRITING and sum(n for _, n in e.extents) == 3
    assert "a" not in c and c.lookup("a") is None
    c.commit("a")
    assert "a" in c and c.lookup("a").extents == e.extents
    e = c.entry("a")
    assert (e.dtype, e.shape) == ("bfloat16", (3, 2048))
    c.check()


def test_abort_frees_blocks(make):
    c = make()
    c.reserve("a", 10 * B)
    c.abort("a")
    assert c.allocator.free_blocks == 10 and c.state("a") is None
    c.check()


def test_script_of_steps_with_lru_eviction(make):
    # Each step: (operation, key, expected outcome); 4 blocks of room.
    c = make(4)
    for key in "abcd":
        c.reserve(key, B)
        c.commit(key)
    assert c.lookup("a") is not None  # a becomes most recently used: b is now oldest
    c.reserve("e", 2 * B)  # evicts b then c
    assert c.state("b") is None and c.state("c") is None
    assert {k for k in "ade" if c.state(k)} == {"a", "d", "e"}
    s = c.stats()
    assert (s.evictions, s.bytes_evicted, s.hits, s.misses) == (2, 2 * B, 1, 0)
    c.check()


def test_pinned_and_writing_items_are_never_evicted(make):
    c = make(4)
    c.reserve("w", B)  # writing
    c.reserve("p", B)
    c.commit("p")
    c.pin("p")
    c.reserve("r", 2 * B)
    c.commit("r")
    assert c.reserve("x", 3 * B) is None  # only r (2 blocks) is evictable
    assert c.state("r") is ItemState.READY  # nothing changed
    assert c.stats().reserve_failures == 1
    assert c.reserve("x", 2 * B) is not None  # evicts r only
    assert c.state("w") is ItemState.WRITING and c.state("p") is ItemState.READY
    c.check()


def test_pins_nest(make):
    c = make()
    c.reserve("a", B)
    c.commit("a")
    c.pin("a")
    c.pin("a")
    c.unpin("a")
    with pytest.raises(ItemStateError, match="pinned 1 time"):
        c.evict("a")
    c.unpin("a")
    c.evict("a")
    assert c.state("a") is None


def test_misses_and_hits_are_counted(make):
    c = make()
    assert c.lookup("nope") is None
    c.reserve("a", B)
    assert c.lookup("a") is None  # still writing: a miss
    c.commit("a")
    c.lookup("a")
    s = c.stats()
    assert (s.hits, s.misses, s.items_stored, s.bytes_stored) == (1, 2, 1, B)
    assert (s.items_resident, s.bytes_resident, s.free_blocks, s.largest_free_extent) == (
        1,
        B,
        9,
        9,
    )


@pytest.mark.parametrize(
    "op,exc,match",
    [
        (lambda c: c.reserve("a", 0), InvalidSizeError, "positive"),
        (lambda c: c.reserve("a", -5), InvalidSizeError, "positive"),
        (lambda c: c.reserve("a", 11 * B), ItemTooLargeError, "arena has 10"),
        (lambda c: c.reserve("r", B), DuplicateItemError, "already in the catalog"),
        (lambda c: c.commit("nope"), UnknownItemError, "not in the catalog"),
        (lambda c: c.commit("r"), ItemStateError, "state 'writing', found 'ready'"),
        (lambda c: c.abort("r"), ItemStateError, "found 'ready'"),
        (lambda c: c.pin("w"), ItemStateError, "found 'writing'"),
        (lambda c: c.unpin("r"), ItemStateError, "not pinned"),
        (lambda c: c.unpin("nope"), UnknownItemError, "nope"),
        (lambda c: c.evict("w"), ItemStateError, "found 'writing'"),
    ],
    ids=[
        "zero-size", "negative-size", "larger-than-arena", "duplicate-reserve", "commit-unknown",
        "double-commit", "abort-ready", "pin-writing", "unpin-unpinned", "unpin-unknown",
        "evict-writing",
    ],
)  # fmt: skip
def test_misuse_raises_specific_errors_and_changes_nothing(make, op, exc, match):
    c = make()
    c.reserve("r", B)
    c.commit("r")
    c.reserve("w", B)
    before = [(e.key, e.state, e.pins, list(e.extents)) for e in c.entries()]
    with pytest.raises(exc, match=match):
        op(c)
    assert [(e.key, e.state, e.pins, list(e.extents)) for e in c.entries()] == before
    c.check()


def test_pin_many_and_unpin_many_are_all_or_nothing(make):
    c = make()
    for key in "abc":
        c.reserve(key, B)
        c.commit(key)
    c.reserve("w", B)
    with pytest.raises(ItemStateError, match="found 'writing'"):
        c.pin_many(["a", "b", "w"])
    assert [c.entry(k).pins for k in "abc"] == [0, 0, 0]
    entries = c.pin_many(["a", "b", "b"])
    assert [e.key for e in entries] == ["a", "b", "b"] and c.entry("b").pins == 2
    with pytest.raises(ItemStateError, match="not pinned"):
        c.unpin_many(["a", "a"])  # a is pinned once only
    assert (c.entry("a").pins, c.entry("b").pins) == (1, 2)
    c.unpin_many(["b", "a", "b"])
    assert [c.entry(k).pins for k in "abc"] == [0, 0, 0]


def test_abort_is_not_an_eviction_and_names_itself(make):
    c = make()
    c.reserve("a", 3 * B)
    c.commit("a")
    with pytest.raises(ItemStateError, match=r"abort\('a'\) needs an item in state 'writing'"):
        c.abort("a")
    c.reserve("b", 2 * B)
    c.abort("b")
    s = c.stats()
    assert (s.evictions, s.bytes_evicted, s.items_stored) == (0, 0, 1)


def test_check_catches_a_negative_pin_count():
    c = Catalog(BlockAllocator(10, B))  # the in-process catalog's internals
    c.reserve("a", B)
    c.commit("a")
    c.check()
    c.entry("a").pins = -1  # as an unbalanced unpin would leave it...
    c._evictable_blocks -= 1  # ...with the evictable count kept consistent
    with pytest.raises(AssertionError):
        c.check()


def test_messages_name_the_operation_and_the_way_out(make):
    c = make()
    c.reserve("w", B)
    c.reserve("r", B)
    c.commit("r")
    for op, key in (("commit", "r"), ("pin", "w"), ("unpin", "w"), ("evict", "w")):
        with pytest.raises(ItemStateError, match=rf"^{op}\('{key}'\) needs an item in state"):
            getattr(c, op)(key)
    for many, op in (("pin_many", "pin"), ("unpin_many", "unpin")):  # each key's own operation
        with pytest.raises(ItemStateError, match=rf"^{op}\('w'\) needs an item in state"):
            getattr(c, many)(["w"])
    with pytest.raises(DuplicateItemError, match="look it up instead of saving it again, or evict"):
        c.reserve("r", B)


def test_stats_report_the_blocks_populate_made_ready():
    c = Catalog(BlockAllocator(10, B, ready_blocks=4))  # the arena still populating
    assert (c.stats().ready_blocks, c.stats().free_blocks) == (4, 4)
    c.allocator.add_ready(7)
    assert (c.stats().ready_blocks, c.stats().free_blocks) == (7, 7)


def test_counters_accumulate(make):
    c = make(blocks=4)
    assert c.reserve("a", 100).dtype == "uint8"  # the default: a plain byte stream
    c.commit("a")
    c.reserve("b", 2 * B)
    c.commit("b")
    c.pin("a")
    c.pin("b")
    assert c.reserve("big", 4 * B) is None and c.reserve("big", 3 * B) is None
    c.unpin("a")
    c.unpin("b")
    c.evict("a")
    c.evict("b")
    s = c.stats()
    assert (s.items_stored, s.bytes_stored, s.reserve_failures) == (2, 100 + 2 * B, 2)
    assert (s.evictions, s.bytes_evicted) == (2, 100 + 2 * B)


def test_nested_pins_release_the_blocks_once(make):
    c = make(blocks=4)
    c.reserve("a", 2 * B)
    c.commit("a")
    c.pin("a")
    c.pin("a")
    c.unpin("a")
    assert c.reserve("x", 3 * B) is None  # still pinned once: not evictable
    c.unpin("a")
    c.check()
    assert c.reserve("x", 3 * B) is not None and c.state("a") is None
    c.check()


def test_item_crc32_covers_every_extent_in_order_and_stops_at_the_item_s_end():
    import zlib

    from ecoffload.engine.base.items import item_crc32

    block = 16
    data = bytearray(range(256)) * 2  # 32 blocks; bytes past an item's end are not zero
    item = bytes(data[5 * block : 7 * block]) + bytes(data[1 * block : 1 * block + 9])
    extents = [(5, 2), (1, 1)]  # stream order, not address order; last block 9 of 16 bytes
    assert item_crc32(data, extents, block, len(item)) == zlib.crc32(item)
    assert item_crc32(data, [(1, 1), (5, 2)], block, len(item)) != zlib.crc32(item)
    three = [(5, 1), (6, 1), (1, 1)]  # the same bytes split differently: the same CRC
    assert item_crc32(data, three, block, len(item)) == zlib.crc32(item)
