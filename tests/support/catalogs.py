"""A shared catalog in a file of its own, for the catalog tests of every folder."""

import os

from ecoffload.engine.catalog.shared import catalog as shared_catalog
from ecoffload.engine.catalog.shared.format import S_HASH, S_HNEXT, SLOT_WORDS

B = 4096


def open_shared(path, blocks, ready_blocks=None, **layout) -> shared_catalog.SharedCatalog:
    """A shared catalog in a fresh file of its own (metadata region only)."""
    size = shared_catalog.meta_bytes(blocks, B, **layout)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return shared_catalog.SharedCatalog(fd, 0, size, num_blocks=blocks, block_bytes=B,
                                            path=str(path), ready_blocks=ready_blocks,
                                            **layout)  # fmt: skip
    finally:
        os.close(fd)


def unhash(c: shared_catalog.SharedCatalog, s: int) -> None:
    """Take slot ``s`` out of its hash chain: its key is no longer found (damage a test
    makes by hand)."""
    w, b = c._w, c._sl + s * SLOT_WORDS
    at = c._bk + (w[b + S_HASH] & c._hmask)
    while w[at] != s:
        at = c._sl + w[at] * SLOT_WORDS + S_HNEXT
    w[at] = w[b + S_HNEXT]
