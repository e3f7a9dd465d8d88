"""The export window: the only memory a producer lets NIXL peers reach.

Why: a NIXL registration is readable *and writable* by whoever holds its
metadata (NIXL's UCX backend maps memory with no protection flags, so UCX
grants remote write wherever it grants remote read), and the metadata travels
in every ``ec_transfer_params``. The arena, which every instance on the host
serves from, is therefore never registered by a producer. Instead, announcing
an item copies its bytes from the arena into a slot of this window; consumers
read the slot; the slot is zeroed and freed when the lease ends (the
consumer's notification, or ``lease_s``).

Invariants:

* The window is anonymous memory of this process (no file: nothing another
  process can open; shared, not copy-on-write, so a later fork cannot split
  pages a NIC has pinned); only :class:`~ecoffload.engine.remote.peer.ArenaPeer`
  registers it.
* A slot holds exactly one announced item's bytes from :meth:`put` until
  :meth:`release`; every other byte of the window is zero. So what a holder of
  the window's metadata can read is exactly the items whose leases are live.
* Nothing is ever served from the window: a write into it (by a params holder)
  can only make a consumer's CRC-32 check fail, and the consumer then encodes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import numpy as np

from ..base.errors import InvalidSizeError
from ..catalog.allocator import BlockAllocator, Extent
from .extent_pieces import pieces


class ExportWindow:
    """``num_blocks`` blocks of ``block_bytes`` bytes of anonymous memory, handed out
    per announced item (:meth:`put`) and zeroed when given back (:meth:`release`)."""

    def __init__(self, nbytes: int, block_bytes: int) -> None:
        if block_bytes <= 0 or block_bytes % 4096 or nbytes < block_bytes:
            raise InvalidSizeError(
                f"export window of {nbytes} bytes in blocks of {block_bytes}: give at least "
                "one block, and a block size that is a positive multiple of 4096"
            )
        self.block_bytes = block_bytes
        self.num_blocks = nbytes // block_bytes
        self.nbytes = self.num_blocks * block_bytes
        self._map = mmap.mmap(-1, self.nbytes)  # anonymous (MAP_SHARED): no file to open
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self.data.ctypes.data
        self._alloc = BlockAllocator(self.num_blocks, block_bytes)

    @property
    def free_blocks(self) -> int:
        return self._alloc.free_blocks

    def put(
        self, src: np.ndarray, src_extents: Sequence[tuple[int, int]], src_block_bytes: int,
        nbytes: int,
    ) -> list[Extent] | None:  # fmt: skip
        """Copy an item (the first ``nbytes`` of ``src_extents`` of ``src``, a uint8
        view of an arena's data area) into a free slot; its window extents, or None
        when the window has no room (the caller does not announce the item)."""
        slot = self._alloc.alloc(nbytes) if nbytes > 0 else []
        if slot is None:
            return None
        for s, d, n in pieces(src_extents, src_block_bytes, slot, self.block_bytes, nbytes):
            self.data[d : d + n] = src[s : s + n]
        return slot

    def release(self, slot: Sequence[tuple[int, int]]) -> None:
        """Zero a slot and give it back (its lease ended: nobody may read it any more)."""
        bb = self.block_bytes
        for start, count in slot:
            self.data[start * bb : (start + count) * bb] = 0
        if slot:
            self._alloc.free([Extent(int(s), int(c)) for s, c in slot])

    def close(self) -> None:
        """Unmap (deregister it from NIXL first). Idempotent."""
        if self._map is not None:
            del self.data
            with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps
                self._map.close()
            self._map = None

    def __repr__(self) -> str:
        return (
            f"ExportWindow({self.num_blocks} x {self.block_bytes} B, "
            f"{self._alloc.free_blocks} free)"
        )
