"""The offload engine: arena (shared mmap file, CUDA registration, device alias),
block allocator, item catalog, and the batch transfer API.

The allocator and catalog are plain Python; importing them (or this package)
does not import torch. Torch-backed names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .allocator import BlockAllocator, Extent
from .catalog import Catalog, CatalogStats, Entry, ItemState
from .errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaExistsError,
    ArenaLayoutMismatch,
    ArenaStaleError,
    CatalogError,
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
from .sizes import format_bytes, parse_bytes

_LAZY = {
    "ANY_LAYOUT": ".arena",
    "Arena": ".arena",
    "ArenaPeer": ".remote",
    "BlockMover": ".transfer",
    "Completion": ".transfer",
    "OffloadCache": ".cache",
    "PeerCard": ".remote",
    "Pull": ".remote",
    "PullHandle": ".remote",
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
    "CatalogError",
    "CatalogStats",
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
