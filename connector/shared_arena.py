"""The arena and catalog every process of every instance on the host maps.

One file per (arena_name, arena_dir): the scheduler and workers of an instance,
data-parallel ranks and other instances of the same model all open it, and the
catalog in its metadata region (:class:`~ecoffload.engine.shared_catalog.SharedCatalog`)
is their one cache. The default name is derived from the layout key, so
instances of one model share by default and other models never meet.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from ..engine.arena import Arena, RegisterMode
from ..engine.shared_catalog import SharedCatalog, meta_bytes
from .config import OffloadConfig

log = logging.getLogger(__name__)


def layout_key(vllm_config: Any) -> dict[str, str]:
    """What an arena's bytes depend on: a file made for another model is refused."""
    model = vllm_config.model_config
    return {
        "format": "ecoffload-encoder-cache",
        "model": str(getattr(model, "model", None)),
        "dtype": str(getattr(model, "dtype", None)),
    }


def default_arena_name(vllm_config: Any) -> str:
    """``ecoffload-<12 hex digits of the layout key's hash>``."""
    text = json.dumps(layout_key(vllm_config), sort_keys=True).encode()
    return f"ecoffload-{hashlib.sha256(text).hexdigest()[:12]}"


def open_shared_arena(
    config: OffloadConfig, vllm_config: Any, *, register_cuda: RegisterMode
) -> Arena:
    """Create the host's arena for this model, or join the one another process made.

    The file stays while any process holds it (or always, ``persistent``); a
    joiner takes the size the first process chose.
    """
    return Arena.open_shared(
        config.arena_name,
        block_bytes=config.block_bytes,
        num_blocks=config.num_blocks,
        layout_key=layout_key(vllm_config),
        directory=config.arena_dir,
        register_cuda=register_cuda,
        populate=config.populate,
        meta_bytes=meta_bytes(config.num_blocks, config.block_bytes),
        persistent=config.persistent,
        on_warm_start=_verify,
    )


def _verify(arena: Arena) -> None:
    """A persistent arena nobody held: check its catalog (and CRCs) before serving."""
    with SharedCatalog.for_arena(arena) as catalog:
        dropped = catalog.verify(arena.host.numpy())
        log.info("ecoffload: warm start from %s: %d items kept, %d dropped by verification",
                 arena.path, len(catalog), dropped)  # fmt: skip


def open_catalog(arena: Arena) -> SharedCatalog:
    """The catalog in ``arena``'s metadata region (closes the arena if it cannot open)."""
    try:
        return SharedCatalog.for_arena(arena)
    except BaseException:
        arena.close()
        raise
