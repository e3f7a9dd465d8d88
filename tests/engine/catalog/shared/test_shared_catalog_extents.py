"""Where the shared catalog places a reservation (engine/catalog/shared/extents.py,
``_alloc``): the smallest fitting free extent among the first 8 of the request's
own size class (an exact fit ends the search), else the head of the nearest
higher class, else the longest extents, split.

Free extents of chosen sizes are made by reserving items with one-block
separators and evicting the items; a class list is most recently freed first.
"""

from catalogs import B, open_shared


def carve(catalog, sizes):
    """Reserve items of ``sizes`` blocks, each followed by a one-block separator; their
    first blocks."""
    starts = []
    for n, size in enumerate(sizes):
        starts.append(catalog.reserve(f"item{n}", size * B).extents[0].start)
        catalog.reserve(f"sep{n}", B)
    return starts


def free(catalog, *numbers):
    for n in numbers:
        catalog.abort(f"item{n}")


def placed(catalog, key, blocks):
    return [tuple(e) for e in catalog.reserve(key, blocks * B).extents]


def test_a_reservation_takes_the_smallest_fit_of_its_class_or_the_next_class_up(tmp_path):
    c = open_shared(tmp_path / "c", 48, max_items=20)
    assert (c.allocator.num_blocks, c.allocator.block_bytes) == (48, B)
    starts = carve(c, [5, 4, 6, 3, 8, 16])
    assert starts == [0, 6, 11, 18, 22, 31]  # one separator after each: all 48 taken
    free(c, 4, 5, 2, 0)  # class 4-7 in scan order: 5 at 0, 6 at 11; 8 at 22; 16 at 31
    assert placed(c, "x", 4) == [(0, 4)]  # 5 fits closer than the 6 after it, at block 0
    free(c, 1)  # class 4-7: 4 at 6, 6 at 11
    assert placed(c, "y", 6) == [(11, 6)]  # the exact fit, past a smaller extent
    assert placed(c, "z", 4) == [(6, 4)]
    free(c, 3)
    assert placed(c, "w", 2) == [(18, 2)]  # class 2-3: 3 at 18, cut
    assert placed(c, "v", 7) == [(22, 7)]  # no 7 in class 4-7: the nearest class up, not 16
    assert placed(c, "t", 16) == [(31, 16)]
    assert c.allocator.free_blocks == 3  # 1 each at 4, 20, 29
    assert placed(c, "u", 3) == [(4, 1), (20, 1), (29, 1)]  # no class fits: split, sorted
    c.check()
    c.close()


def test_the_own_class_search_looks_at_the_first_8_extents_only(tmp_path):
    c = open_shared(tmp_path / "c", 80, max_items=24)
    starts = carve(c, [4, 5, 7, 7, 7, 7, 7, 7, 7])  # a 13-block tail stays free
    free(c, *range(9))  # scan order: the seven 7s, the 5, then the 4 (9th)
    assert placed(c, "x", 4) == [(starts[1], 4)]  # the 5, 8th: the 4 is past the window
    assert starts == [0, 5, 11, 19, 27, 35, 43, 51, 59]
    assert c.allocator.free_blocks == 67  # 4 at 0, 1 at 9, the seven 7s, 13 at 67
    # No class holds 22: the longest first (13 at 67), the newest 7 (59), 2 cut from 51.
    assert placed(c, "y", 22) == [(51, 2), (59, 7), (67, 13)]
    assert c.allocator.free_blocks == 45
    c.check()
    c.close()


def test_the_next_class_up_is_the_nearest_non_empty_one(tmp_path):
    """With the own class empty and the next one too, the class above them."""
    c = open_shared(tmp_path / "c", 12, max_items=8)
    assert carve(c, [2, 8]) == [0, 3]
    free(c, 0, 1)  # a 2 at 0 (class 2-3), an 8 at 3 (class 8-15); classes 1 and 4-7 empty
    assert placed(c, "x", 1) == [(0, 1)]  # the nearest class up is 2-3: the 2, not the 8
    assert placed(c, "y", 2) == [(3, 2)]  # class 2-3 empty now (1 left at 1): the 8
    c.check()
    c.close()


def test_the_longest_free_extent_of_single_blocks_is_one(tmp_path):
    c = open_shared(tmp_path / "c", 4, max_items=4)
    carve(c, [1, 1])
    free(c, 0, 1)
    assert c.allocator.free_blocks == 2 and c.allocator.largest_free_extent == 1
    c.close()
