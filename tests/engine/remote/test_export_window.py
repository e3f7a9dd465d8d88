"""engine/remote/export_window.py: the copies a producer exposes instead of its arena.

Seeded items of odd sizes, fragmented in the source, are copied into the
window and compared bit-for-bit with the source stream; every byte of the
window outside the slots must stay zero (the window is all a params holder
can read); a full window answers None; releasing zeroes and frees exactly the
slot.
"""

import numpy as np
import pytest

from ecoffload.engine.base.errors import InvalidSizeError
from ecoffload.engine.remote.export_window import ExportWindow

BB = 4096


def source(seed, nblocks=32):
    return np.random.default_rng(seed).integers(0, 256, nblocks * BB, dtype=np.uint8)


def stream(src, extents, nbytes):
    return np.concatenate([src[s * BB : (s + c) * BB] for s, c in extents])[:nbytes]


SIZES = {"one-byte": 1, "odd-63": 63, "block-minus-1": BB - 1, "one-block": BB,
         "block-plus-1": BB + 1, "many-blocks-odd": 5 * BB + 17}  # fmt: skip


@pytest.mark.parametrize("nbytes", SIZES.values(), ids=SIZES.keys())
def test_put_copies_the_item_and_nothing_else(nbytes):
    src = source(nbytes)
    extents = [(7, 1), (2, 3), (20, 4)][: 1 + (nbytes > BB) * 2]  # out of block order
    window = ExportWindow(16 * BB, BB)
    slot = window.put(src, extents, BB, nbytes)
    assert slot is not None and sum(c for _, c in slot) == -(-nbytes // BB)
    got = np.concatenate([window.data[s * BB : (s + c) * BB] for s, c in slot])
    assert np.array_equal(got[:nbytes], stream(src, extents, nbytes))
    ((start, _),) = slot  # an empty window: one extent
    outside = np.ones(window.nbytes, dtype=bool)
    outside[start * BB : start * BB + nbytes] = False  # the slot's tail stays zero too
    assert not window.data[outside].any()
    window.release(slot)
    assert not window.data.any() and window.free_blocks == window.num_blocks
    window.close()


def test_a_full_window_refuses_and_a_release_makes_room():
    src = source(1)
    window = ExportWindow(4 * BB, BB)
    a = window.put(src, [(0, 3)], BB, 3 * BB)
    assert window.put(src, [(4, 2)], BB, 2 * BB) is None  # one block left
    b = window.put(src, [(9, 1)], BB, 10)
    assert window.free_blocks == 0
    window.release(a)
    c = window.put(src, [(4, 2)], BB, 2 * BB)
    assert c is not None
    assert np.array_equal(window.data[b[0][0] * BB :][:10], src[9 * BB :][:10])  # untouched
    for slot in (b, c):
        window.release(slot)
    assert not window.data.any()
    window.close()
    window.close()  # idempotent


def test_bad_sizes_are_refused():
    with pytest.raises(InvalidSizeError, match="multiple of 4096"):
        ExportWindow(8192, 1000)
    with pytest.raises(InvalidSizeError, match="at least one block"):
        ExportWindow(100, 4096)
