"""The catalog protocol: what the cache, the connector and the remote pull ask of a
catalog, implemented by the in-process :class:`~ecoffload.engine.catalog.catalog.Catalog`
and the arena-resident :class:`~ecoffload.engine.catalog.shared.catalog.SharedCatalog`.

States and transitions (two-phase commit, so a partially written item is
never served)::

    reserve(key, nbytes, dtype, shape) -> Entry | None   state WRITING, blocks owned
        ... the caller copies the bytes into entry.extents ...
    commit(key, checksum)                                WRITING -> READY (visible)
    abort(key)                                           WRITING -> gone, blocks freed
    lookup(key, pin=False) -> Entry | None
                                     READY only; a hit becomes most recently used;
                                     pin=True pins it in the same step (between a
                                     lookup and a pin another process could evict it)
    pin(key) / unpin(key)            nest; a pinned item is never evicted or freed
    pin_many(keys) / unpin_many(keys)   the same, all of them or none
    evict(key)                       READY, unpinned -> gone

``reserve`` makes room by evicting least-recently-used READY unpinned items,
and only if that is enough: otherwise it returns None and changes nothing.
Only ready blocks count as room; :meth:`CatalogProtocol.follow_ready` lets a
catalog raise them itself from the arena's populate progress. Misuse (unknown
key, wrong state, unbalanced unpin, impossible size) raises a specific
:class:`~ecoffload.engine.base.errors.CatalogError` and changes nothing.

``tests/engine/catalog/test_catalog.py`` runs this contract against both implementations and
checks that their signatures accept every call the protocol allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from .catalog import CatalogStats, Entry, ItemState


class AllocatorView(Protocol):
    """What callers read of a catalog's blocks (``catalog.allocator``)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def ready_blocks(self) -> int: ...

    def add_ready(self, ready_blocks: int) -> int: ...

    def blocks_for(self, nbytes: int) -> int: ...


@runtime_checkable
class CatalogProtocol(Protocol):
    """An index of the items in one arena: states, pins, LRU eviction (see the module)."""

    @property
    def allocator(self) -> AllocatorView: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: str) -> bool: ...

    def state(self, key: str) -> ItemState | None: ...

    def entry(self, key: str) -> Entry: ...

    def entries(self) -> Sequence[Entry]: ...

    def reserve(
        self, key: str, nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] = ()
    ) -> Entry | None: ...

    def commit(self, key: str, checksum: int | None = None) -> Entry: ...

    def abort(self, key: str) -> None: ...

    def lookup(self, key: str, *, pin: bool = False) -> Entry | None: ...

    def pin(self, key: str) -> Entry: ...

    def unpin(self, key: str) -> None: ...

    def pin_many(self, keys: list[str]) -> Sequence[Entry]: ...

    def unpin_many(self, keys: list[str]) -> None: ...

    def evict(self, key: str) -> None: ...

    def stats(self) -> CatalogStats: ...

    def check(self) -> None: ...

    def follow_ready(self, ready_of: Callable[[], int]) -> None: ...
