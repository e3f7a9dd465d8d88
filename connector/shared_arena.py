"""The one arena every process of a serving instance maps (scheduler + workers)."""

from __future__ import annotations

from typing import Any

from ..engine.arena import Arena, RegisterMode
from .config import OffloadConfig


def layout_key(vllm_config: Any) -> dict[str, str]:
    """What an arena's bytes depend on: a file made for another model is refused."""
    model = vllm_config.model_config
    return {
        "format": "ecoffload-encoder-cache",
        "model": str(getattr(model, "model", None)),
        "dtype": str(getattr(model, "dtype", None)),
    }


def open_shared_arena(
    config: OffloadConfig, vllm_config: Any, *, processes: int, register_cuda: RegisterMode
) -> Arena:
    """Create the arena, or attach to it if another process of the instance was first.

    ``processes`` counts every process that will map it; once all have, the
    file's name is unlinked, so a crash afterwards leaves nothing in arena_dir.
    """
    return Arena.create_or_attach(
        config.arena_name,
        block_bytes=config.block_bytes,
        num_blocks=config.num_blocks,
        layout_key=layout_key(vllm_config),
        directory=config.arena_dir,
        processes=processes,
        register_cuda=register_cuda,
        populate=config.populate,
    )
