"""The shared catalog's word layout and sizes (engine/catalog/shared/format.py):
where each part of the region starts, the defaults and refusals of the sizes,
and what a slot stores of an item's shape and dtype."""

import mmap

import pytest
import torch

from ecoffload.engine.base.errors import CatalogCapacityError, InvalidSizeError
from ecoffload.engine.catalog.shared import format as f

B = 4096


def test_each_part_of_the_region_starts_where_the_layout_says():
    # 1000 blocks, 5 items of 3-byte keys, 2 pin records, worked out by hand:
    lay = f.Layout(1000, B, 5, 3, 2)
    assert lay.buckets == 8  # the power of two >= 5
    assert lay.buckets_at == 1024  # past the header
    assert lay.slots_at == 1024 + 8 * 8
    assert lay.keys_at == 1088 + 5 * 32 * 8
    assert lay.pins_at == 2368 + 16  # 15 key bytes, to whole words
    assert lay.blocks_at == 2384 + 2 * 5 * 8
    assert lay.nbytes == 7 * mmap.PAGESIZE  # 2464 + 6 int32 a block = 26464, to pages
    assert f.Layout(1000, B, 8, 3, 2).buckets == 8  # a power of two already
    assert f.Layout(1000, B, 1, 8, 2).buckets == 1
    assert f.Layout(1000, B, 9, 8, 2).buckets == 16
    assert f.Layout(1, B, 1, 8, 1).nbytes == mmap.PAGESIZE  # under a page: one page


def test_the_sizes_default_to_one_item_a_block_and_at_least_64_pin_records():
    assert f.layout_for(10, B, None, 256, None) == f.Layout(10, B, 10, 256, 64)
    assert f.layout_for(100, B, None, 256, None) == f.Layout(100, B, 100, 256, 100)
    assert f.layout_for(100, B, 70, 256, None) == f.Layout(100, B, 70, 256, 70)
    assert f.layout_for(100, B, 70, 32, 7) == f.Layout(100, B, 70, 32, 7)
    assert f.meta_bytes(100, B) == f.Layout(100, B, 100, f.DEFAULT_MAX_KEY_BYTES, 100).nbytes
    assert f.meta_bytes(100, B, 70, 32, 1000) == f.Layout(100, B, 70, 32, 1000).nbytes
    assert f.meta_bytes(100, B, 70, 32, 1000) > f.meta_bytes(100, B, 70, 32)  # pages apart


@pytest.mark.parametrize("name", ["num_blocks", "block_bytes", "max_items", "max_key_bytes",
                                  "max_pins"])  # fmt: skip
@pytest.mark.parametrize("value", [0, -1, 2.0, "8"])
def test_every_size_must_be_a_positive_int(name, value):
    sizes = {"num_blocks": 8, "block_bytes": B, "max_items": 8, "max_key_bytes": 16,
             "max_pins": 8} | {name: value}  # fmt: skip
    with pytest.raises(InvalidSizeError) as err:
        f.layout_for(*sizes.values())
    assert str(err.value) == f"{name} must be a positive int, got {value!r}"


def test_the_blocks_must_be_numbered_by_an_int32():
    assert f.layout_for(2**31 - 1, B, 1, 8, 1).num_blocks == 2**31 - 1
    with pytest.raises(InvalidSizeError) as err:
        f.layout_for(2**31, B, 1, 8, 1)
    assert str(err.value) == "num_blocks must be below 2**31, got 2147483648"


def test_a_slot_stores_up_to_8_dimensions_as_ints():
    assert f.slot_dims(()) == ()
    dims = f.slot_dims(torch.Size([2, 3]))
    assert dims == (2, 3) and all(type(d) is int for d in dims)
    assert f.slot_dims((1,) * 8) == (1,) * 8
    with pytest.raises(CatalogCapacityError) as err:
        f.slot_dims((1,) * 9)
    assert str(err.value) == (
        "shape (1, 1, 1, 1, 1, 1, 1, 1, 1): at most 8 dimensions fit a shared catalog entry"
    )


def words(name: str) -> tuple[int, int]:
    raw = name.encode().ljust(16, b"\0")
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(
        raw[8:], "little", signed=True
    )


def test_a_dtype_is_stored_by_name_in_two_words(monkeypatch):
    monkeypatch.setattr(f, "_DTYPES", {})  # from empty: the test process may have filled it
    assert f.dtype_words("float16") == ("float16", *words("float16"))
    assert f.dtype_words(torch.bfloat16) == ("torch.bfloat16", *words("torch.bfloat16"))
    high = "abcdefgé"  # UTF-8: the first word's top byte is 0xc3, a negative int64
    assert f.dtype_words(high) == (high, *words(high)) and words(high)[0] < 0
    sixteen = "complex128_alike"  # 16 bytes: both words full
    assert f.dtype_words(sixteen) == (sixteen, *words(sixteen))
    assert words(sixteen)[1] != 0
    with pytest.raises(CatalogCapacityError) as err:
        f.dtype_words("x" * 17)
    assert str(err.value) == (
        f"dtype {'x' * 17!r}: a dtype name of at most 16 bytes fits a shared catalog entry"
    )


def test_the_dtype_table_stays_small_and_right(monkeypatch):
    table = {}
    monkeypatch.setattr(f, "_DTYPES", table)
    for n in range(64):
        assert f.dtype_words(f"t{n}") == (f"t{n}", *words(f"t{n}"))
    assert len(table) == 64
    assert f.dtype_words("t0") == ("t0", *words("t0"))  # a hit leaves the table as it is
    assert len(table) == 64
    assert f.dtype_words("t64") == ("t64", *words("t64"))  # full: emptied, then this one
    assert table == {"t64": ("t64", *words("t64"))}
