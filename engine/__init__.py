"""The offload engine: arena (shared mmap file, CUDA registration, device alias),
block allocator, item catalog, and the batch transfer API.

The allocator and catalog are plain Python; importing them (or this package)
does not import torch. Torch-backed names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base.errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaExistsError,
    ArenaLayoutMismatch,
    ArenaStaleError,
    CatalogCorruptError,
    CatalogError,
    ClusterError,
    ClusterNotInstalledError,
    ConfigError,
    DuplicateItemError,
    ECOffloadError,
    InvalidSizeError,
    ItemStateError,
    ItemTooLargeError,
    NixlNotInstalledError,
    RemoteError,
    RemoteExtentError,
    RemotePeerError,
    UnknownItemError,
)
from .base.sizes import format_bytes, parse_bytes
from .catalog.allocator import BlockAllocator, Extent
from .catalog.catalog import Catalog, CatalogStats, Entry, ItemState

if TYPE_CHECKING:  # the lazy names below, for type checkers and editors
    from .arena.arena import ANY_LAYOUT, Arena
    from .cache import OffloadCache, SaveResult
    from .remote.peer import ArenaPeer
    from .remote.records import PeerCard, Pull, PullHandle
    from .transfer import BlockMover, Completion

_LAZY = {
    "ANY_LAYOUT": ".arena.arena",
    "Arena": ".arena.arena",
    "ArenaPeer": ".remote.peer",
    "BlockMover": ".transfer",
    "Completion": ".transfer",
    "OffloadCache": ".cache",
    "PeerCard": ".remote.records",
    "Pull": ".remote.records",
    "PullHandle": ".remote.records",
    "SaveResult": ".cache",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ANY_LAYOUT",
    "Arena",
    "ArenaAttachTimeout",
    "ArenaError",
    "ArenaExistsError",
    "ArenaLayoutMismatch",
    "ArenaPeer",
    "ArenaStaleError",
    "BlockAllocator",
    "BlockMover",
    "Catalog",
    "CatalogCorruptError",
    "CatalogError",
    "CatalogStats",
    "ClusterError",
    "ClusterNotInstalledError",
    "Completion",
    "ConfigError",
    "DuplicateItemError",
    "ECOffloadError",
    "Entry",
    "Extent",
    "InvalidSizeError",
    "ItemState",
    "ItemStateError",
    "ItemTooLargeError",
    "NixlNotInstalledError",
    "OffloadCache",
    "PeerCard",
    "Pull",
    "PullHandle",
    "RemoteError",
    "RemoteExtentError",
    "RemotePeerError",
    "SaveResult",
    "UnknownItemError",
    "format_bytes",
    "parse_bytes",
]
