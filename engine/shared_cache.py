"""Opening a shared cache: the arena every process of the host maps, with its catalog.

One sequence, used by ``OffloadCache.create(shared=True)`` and by the vLLM
connector's scheduler and workers alike:

1. :func:`open_shared_arena`: create the arena, or join the one another process
   opened under that name (``Arena.open_shared``), with a metadata region sized
   for the catalog. A persistent arena that nobody held is *verified* before
   anyone else can finish opening it: the catalog's structure, dead processes'
   reservations and pins, and every item saved with a CRC-32 marked UNVERIFIED
   (``SharedCatalog.begin_verify``: no item byte read, so it serves at once).
   While items are left to verify, every opener checks them in a background
   thread (:mod:`.background_verify`); until then they are misses.
2. :func:`open_catalog`: the catalog in that region (the arena is closed if the
   catalog cannot open, so a failed open leaks nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .arena.arena import Arena
from .arena.format import PopulateMode, RegisterMode
from .background_verify import start_verifier
from .base.sizes import format_bytes
from .catalog.shared.catalog import SharedCatalog, meta_bytes

log = logging.getLogger(__name__)


def open_shared_arena(
    name: str,
    *,
    block_bytes: int,
    num_blocks: int,
    layout_key: str | Mapping[str, object],
    directory: str,
    register_cuda: RegisterMode,
    populate: PopulateMode,
    persistent: bool,
    max_items: int | None = None,
) -> Arena:
    """Create or join the shared arena ``name`` (the first opener decides its size);
    a warm-started persistent one has its catalog recovered first and its items
    verified in the background."""

    def recover(arena: Arena) -> None:  # runs while no other process can open it
        with SharedCatalog.for_arena(arena, max_items=max_items) as catalog:
            items, nbytes, unchecked = catalog.begin_verify()
            log.info("ecoffload: warm start from %s: %d items kept; %d (%s) to verify in "
                     "the background, misses until then; %d without a CRC-32",
                     arena.path, len(catalog), items, format_bytes(nbytes),
                     unchecked)  # fmt: skip

    arena = Arena.open_shared(
        name,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        layout_key=layout_key,
        directory=directory,
        register_cuda=register_cuda,
        populate=populate,
        meta_bytes=meta_bytes(num_blocks, block_bytes, max_items),
        persistent=persistent,
        on_warm_start=recover,
    )
    try:
        start_verifier(arena, max_items=max_items)
    except BaseException:
        arena.close()
        raise
    return arena


def open_catalog(arena: Arena, *, max_items: int | None = None) -> SharedCatalog:
    """The catalog in ``arena``'s metadata region; closes the arena if it cannot open."""
    try:
        return SharedCatalog.for_arena(arena, max_items=max_items)
    except BaseException:
        arena.close()
        raise
