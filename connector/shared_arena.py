"""The arena and catalog every process of every instance on the host maps.

One file per (arena_name, arena_dir): the scheduler and workers of an instance,
data-parallel ranks and other instances of the same model all open it, and the
catalog in its metadata region (:class:`~ecoffload.engine.catalog.shared.catalog.SharedCatalog`)
is their one cache. The default name is derived from the layout key, so
instances of one model share by default and other models never meet.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from ..engine import shared_cache
from ..engine.arena.arena import Arena, RegisterMode
from ..engine.catalog.shared.catalog import SharedCatalog
from .config import OffloadConfig

if TYPE_CHECKING:  # vLLM's own type (imported by vLLM anyway)
    from vllm.config import VllmConfig


def layout_key(vllm_config: VllmConfig) -> dict[str, str]:
    """What an arena's bytes depend on: a file made for another model is refused."""
    model = vllm_config.model_config
    return {
        "format": "ecoffload-encoder-cache",
        "model": str(getattr(model, "model", None)),
        "dtype": str(getattr(model, "dtype", None)),
    }


def default_arena_name(vllm_config: VllmConfig) -> str:
    """``ecoffload-<12 hex digits of the layout key's hash>``."""
    text = json.dumps(layout_key(vllm_config), sort_keys=True).encode()
    return f"ecoffload-{hashlib.sha256(text).hexdigest()[:12]}"


def open_shared_arena(
    config: OffloadConfig, vllm_config: VllmConfig, *, register_cuda: RegisterMode
) -> Arena:
    """Create the host's arena for this model, or join the one another process made
    (:func:`ecoffload.engine.shared_cache.open_shared_arena` with this config).

    The file stays while any process holds it (or always, ``persistent``); a
    joiner takes the size the first process chose.
    """
    return shared_cache.open_shared_arena(
        config.arena_name,
        block_bytes=config.block_bytes,
        num_blocks=config.num_blocks,
        layout_key=layout_key(vllm_config),
        directory=config.arena_dir,
        register_cuda=register_cuda,
        populate=config.populate,
        persistent=config.persistent,
    )


def open_catalog(arena: Arena) -> SharedCatalog:
    """The catalog in ``arena``'s metadata region (closes the arena if it cannot open)."""
    return shared_cache.open_catalog(arena)
