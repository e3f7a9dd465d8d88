"""A shared catalog in a file of its own, for the catalog tests of every folder."""

import os

from ecoffload.engine.catalog.shared import catalog as shared_catalog

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
