"""Reading the shared catalog (engine/catalog/shared/reads.py): entries read their
keys from the slot table, an object keeps one entry per item and refreshes it in
place, a CRC of 0 is a checksum like any other, and reads never mark the catalog
dirty (a reader that dies holding the lock costs no rebuild)."""

import zlib

from catalogs import B, open_shared
from test_shared_catalog import reopen, two_ready_items_and_a_counting_reader

from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.engine.catalog.shared import format as f


def test_entries_read_every_key_from_the_slot_table_in_slot_order(tmp_path):
    c = open_shared(tmp_path / "c", 16, max_items=6, max_key_bytes=8)
    for key in ("k", "longkey8", "two", "é"):  # one byte, the maximum, a two-byte character
        c.reserve(key, B, dtype="float16", shape=(2, 3))
    c.commit("longkey8")
    c.abort("two")  # its slot is skipped
    other = reopen(tmp_path / "c")  # has seen no key: reads each from its slot
    got = [(e.key, e.slot, e.state, e.dtype, e.shape) for e in other.entries()]
    assert got == [
        ("k", 0, ItemState.WRITING, "float16", (2, 3)),
        ("longkey8", 1, ItemState.READY, "float16", (2, 3)),
        ("é", 3, ItemState.WRITING, "float16", (2, 3)),
    ]
    assert [e.key for e in other.entries()] == ["k", "longkey8", "é"]  # and again, seen
    other.close()
    c.close()


def test_an_object_keeps_one_entry_per_item_and_refreshes_it_in_place(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    writing = c.reserve("a", B)
    assert c.entry("a") is writing and c.entry("a") is writing  # WRITING: no rebuild
    ready = c.commit("a", 5)
    assert ready.state is ItemState.READY and ready.checksum == 5
    assert c.lookup("a") is ready and c.entry("a") is ready and c.entries() == [ready]
    c.pin("a")
    assert ready.pins == 1  # refreshed in place
    other = reopen(tmp_path / "c")
    seen = other.entry("a")
    assert other.lookup("a") is seen and other.entries()[0] is seen
    other.close()
    c.unpin("a")
    c.close()


def test_a_crc_of_0_is_a_checksum_and_none_is_none(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    for key, crc in (("zero", 0), ("none", None), ("top", 2**32 - 1)):
        c.reserve(key, B)
        c.commit(key, crc)
    other = reopen(tmp_path / "c")
    for reader in (c, other):
        assert [reader.entry(k).checksum for k in ("zero", "none", "top")] == [0, None, 2**32 - 1]
    other.close()
    c.close()


def test_reads_never_mark_the_catalog_dirty(tmp_path, monkeypatch):
    c = open_shared(tmp_path / "c", 8)
    c.reserve("a", B)
    c.commit("a")
    marks = []

    def watch(name):
        inner = getattr(c, name)

        def watched(*args, **kwargs):
            marks.append((name, c._w[f.H_DIRTY]))  # under the lock, inside the read
            return inner(*args, **kwargs)

        monkeypatch.setattr(c, name, watched)

    for name in ("_slot_of", "_snapshot", "_largest_free_extent"):
        watch(name)
    assert c.state("a") is ItemState.READY
    assert c.entry("a").key == "a"
    assert [e.key for e in c.entries()] == ["a"]
    assert c.stats().items_resident == 1
    assert {name for name, _ in marks} == {"_slot_of", "_snapshot", "_largest_free_extent"}
    assert [dirty for _, dirty in marks] == [0] * len(marks)
    c.close()


def test_keys_whose_crc32_collide_are_told_apart_by_their_bytes(tmp_path):
    c = open_shared(tmp_path / "c", 8)
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")  # one hash, one chain
    c.reserve("plumless", B)
    c.commit("plumless")
    other = reopen(tmp_path / "c")  # finds keys through the hash table only
    assert (other.state("buckeroo"), other.lookup("buckeroo")) == (None, None)
    c.reserve("buckeroo", 2 * B)
    c.commit("buckeroo")
    assert [other.entry(k).nbytes for k in ("plumless", "buckeroo")] == [B, 2 * B]
    other.close()
    c.close()


def test_a_key_seen_before_is_found_without_hashing_it(tmp_path, monkeypatch):
    c, other, finds = two_ready_items_and_a_counting_reader(tmp_path / "c", monkeypatch)
    for _ in range(3):
        assert (other.state("a"), other.state("b")) == (ItemState.READY, ItemState.READY)
    assert finds == [b"a", b"b"]  # each once, the first time
    c.evict("a")
    assert other.state("a") is None  # its slot freed: the table asked again
    assert finds == [b"a", b"b", b"a"]
    other.close()
    c.close()


def test_an_object_remembers_at_most_max_items_entries(tmp_path):
    c = open_shared(tmp_path / "c", 8, max_items=3)
    sizes = []
    for n in range(10):
        c.reserve(f"k{n}", B)  # evicts the oldest from the fourth on
        c.commit(f"k{n}")
        sizes.append(len(c._seen))
        c.entry(f"k{n}")  # seen again: no growth
        assert len(c._seen) == sizes[-1]
    assert sizes == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # full: emptied before the next key
    c.close()
