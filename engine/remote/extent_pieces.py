"""Two extent lists over one item, walked together: the pieces contiguous on both sides.

An item is the first ``nbytes`` of the concatenation of its extents
``(start, count)`` of ``block_bytes`` blocks; two copies of it may use different
block sizes and different cuts. :func:`pieces` yields ``(src offset, dst
offset, length)`` byte ranges, merged while contiguous on both sides, covering
exactly ``nbytes`` (the tail of a last block on either side is never touched).
Used for NIXL descriptors (one per piece) and for copies into the export window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def pieces(
    remote: Sequence[tuple[int, int]],
    rbb: int,
    local: Sequence[tuple[int, int]],
    lbb: int,
    nbytes: int,
) -> Iterator[tuple[int, int, int]]:
    """(remote offset, local offset, length) of the pieces contiguous on both sides,
    covering the first ``nbytes`` of each side's extent stream (checked to hold them)."""
    ri = li = 0
    r_off = r_left = l_off = l_left = 0
    left = nbytes
    cur: list[int] | None = None  # [remote offset, local offset, length] being extended
    while left > 0:
        if r_left == 0:
            r_off, r_left = remote[ri][0] * rbb, remote[ri][1] * rbb
            ri += 1
        if l_left == 0:
            l_off, l_left = local[li][0] * lbb, local[li][1] * lbb
            li += 1
        n = min(r_left, l_left, left)
        if cur is not None and cur[0] + cur[2] == r_off and cur[1] + cur[2] == l_off:
            cur[2] += n
        else:
            if cur is not None:
                yield cur[0], cur[1], cur[2]
            cur = [r_off, l_off, n]
        left -= n
        r_off, r_left, l_off, l_left = r_off + n, r_left - n, l_off + n, l_left - n
    if cur is not None:
        yield cur[0], cur[1], cur[2]
