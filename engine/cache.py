"""OffloadCache: the whole engine in one process (catalog + arena + mover).

This is the engine-level API for code that owns both sides (tests, the demo,
users outside vLLM; the vLLM connector splits the same steps between its
scheduler and worker processes)::

    cache = OffloadCache.create("my-cache", arena_bytes="8GiB", layout_key=...)
    result = cache.save({"img-1": t1, "img-2": t2})  # reserve, one pack launch
    ...                                               # committed once the copy is done
    hits = cache.load(["img-1", "img-3"])            # pin, one unpack launch
    hits["img-1"]                                     # tensor on the cache's device
    cache.close()

Saved items become visible (``ready``) only after their copy has completed:
``poll`` commits finished saves and unpins finished loads; ``load`` and
``flush`` poll first. A partially written item is never served.

Shared mode (``shared=True``): the catalog lives in the arena file
(:class:`~ecoffload.engine.catalog.shared.catalog.SharedCatalog`), the arena is created
or attached by name, and every OffloadCache opened on the same name, in any
process, sees the same items::

    a = OffloadCache.create("host-cache", arena_bytes="8GiB", shared=True)   # process 1
    b = OffloadCache.create("host-cache", arena_bytes="8GiB", shared=True)   # process 2
    a.save({"img-1": t1}); a.flush()
    b.load(["img-1"])                                                        # a hit

The arena has a shared lifetime (:meth:`Arena.open_shared`): its name stays
while any cache holds it open, whichever created it, and goes with the last
close. ``persistent=True`` keeps it after the last close too; the next cache to
open it, finding nobody else holding it, validates the catalog first
(:meth:`SharedCatalog.verify`: structure, dead processes' reservations, and the
CRC-32 of every item saved with one, i.e. in integrity mode).

Integrity mode (``integrity=True``, off by default): when a save completes,
the CRC-32 of the item's bytes in the arena is recorded; ``load`` waits for
its copy, recomputes the CRC of every loaded tensor (on the host) and drops,
evicts and counts any item that does not match. It catches corruption of the
arena after the save (stray writes, a broken pin) and of the load path; it
costs a host read of every saved byte and, on CUDA, a device-to-host copy of
every loaded one.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..kernels import planner
from ..kernels.nvtx import nvtx_range
from ..kernels.step_table import StepTable
from .arena.arena import DEFAULT_DIR, Arena, PopulateMode, RegisterMode
from .base.errors import DuplicateItemError, ItemStateError, UnknownItemError
from .base.items import dtype_from_name, dtype_name, item_crc32
from .base.sizes import parse_bytes
from .catalog.allocator import BlockAllocator
from .catalog.catalog import Catalog, CatalogStats
from .catalog.protocol import CatalogProtocol
from .catalog.shared.catalog import SharedCatalog
from .shared_cache import open_catalog, open_shared_arena
from .transfer import BlockMover, Completion, split_completed

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 64 << 10


@dataclass
class SaveResult:
    """What one ``save`` call did with each key."""

    saved: list[str] = field(default_factory=list)
    already_cached: list[str] = field(default_factory=list)
    no_room: list[str] = field(default_factory=list)  # arena full of pinned/in-flight items


STEP_TABLE_FROM = 64  # extents per step from which one StepTable beats the entries' tuples


def step_tables(entries: list, *, fresh: bool = False) -> StepTable:
    """The block tables of a step's catalog entries, as the planner reads them fastest.

    Over the entries' own ``Extent`` lists for a few extents (the C pass reads a few
    tuples in less time than numpy takes to make arrays), and for ``fresh``
    reservations (a save's, planned once) whenever the C pass is loaded: it reads the
    tuples faster than Python could flatten them into arrays (BENCHMARKS.md, "The save
    path's last cuts"). Otherwise the entries' int64 arrays, each made once and kept by
    its entry (a load's entries live on in the catalog), concatenated; for fresh
    reservations without the C pass (the numpy pass reads the arrays), one pass over
    their extents."""
    tables = [e.extents for e in entries]
    few = sum(map(len, tables)) < STEP_TABLE_FROM  # map: no bytecode per entry
    if few or (fresh and planner.plans_pairs_in_c()):
        return StepTable.of_pairs(tables)
    return StepTable.from_tables(tables) if fresh else StepTable.of_entries(entries)


class OffloadCache:
    """An arena, its catalog and a mover, in one process."""

    def __init__(
        self,
        arena: Arena,
        device: torch.device | str | None = None,
        *,
        integrity: bool = False,
        catalog: CatalogProtocol | None = None,
    ) -> None:
        self.arena = arena
        self.integrity = integrity
        self.integrity_failures = 0
        if catalog is None:
            catalog = Catalog(
                BlockAllocator(arena.num_blocks, arena.block_bytes, arena.ready_blocks)
            )
        catalog.follow_ready(lambda: arena.ready_blocks)  # reservations see populate's progress
        self.catalog = catalog
        self.mover = BlockMover(arena, device)
        self.device = self.mover.device
        self._pending_saves: list[tuple[Completion, list[str]]] = []
        self._pending_loads: list[tuple[Completion, list[str]]] = []

    @classmethod
    def create(
        cls,
        name: str,
        *,
        arena_bytes: int | str,
        block_bytes: int | str = DEFAULT_BLOCK_BYTES,
        layout_key: str | Mapping[str, object] = "",
        directory: str = DEFAULT_DIR,
        device: torch.device | str | None = None,
        register_cuda: RegisterMode = "auto",
        integrity: bool = False,
        populate: PopulateMode = "eager",
        shared: bool = False,
        max_items: int | None = None,
        persistent: bool = False,
    ) -> OffloadCache:
        """A new cache over a new arena of (at most) ``arena_bytes`` bytes.

        ``populate="background"`` returns at once; saves use the blocks populated
        so far (see :class:`~ecoffload.engine.arena.arena.Arena`).

        ``shared=True``: create the arena, or join the one another cache opened
        under this name (same block size and layout key; the first one decides
        the size), with the catalog in the arena file (``max_items``: its item
        table, default one per block). The catalog hands out ready blocks only,
        so every populate mode works. ``persistent``: keep the arena after the
        last cache closes (every cache on the name must agree); a cache that
        opens it with nobody else holding it verifies the catalog first.
        """
        block = parse_bytes(block_bytes, name="block_bytes")
        total = parse_bytes(arena_bytes, name="arena_bytes")
        if persistent and not shared:
            raise ValueError("persistent=True needs shared=True: only a shared arena outlives it")
        if shared:
            arena = open_shared_arena(
                name, block_bytes=block, num_blocks=max(1, total // block),
                layout_key=layout_key, directory=directory, register_cuda=register_cuda,
                populate=populate, persistent=persistent, max_items=max_items,
            )  # fmt: skip
            catalog = open_catalog(arena, max_items=max_items)
            return cls(arena, device, integrity=integrity, catalog=catalog)
        arena = Arena.create(
            name,
            block_bytes=block,
            num_blocks=max(1, total // block),
            layout_key=layout_key,
            directory=directory,
            processes=1,  # nobody else attaches: unlink the name at once
            register_cuda=register_cuda,
            populate=populate,
        )
        return cls(arena, device, integrity=integrity)

    def save(self, items: Mapping[str, torch.Tensor]) -> SaveResult:
        """Reserve blocks for every new key and copy them in one launch.

        Keys already cached (or being saved) are skipped, and stay cached: the
        batch's own reservations never evict them. Keys that find no room even
        after eviction are skipped and reported: an offload cache never fails
        the caller for lack of space. On a shared arena another process may
        save, evict or start saving a key at any moment: a key it reserved
        first counts as already cached, one it evicted is simply not protected.
        """
        with nvtx_range("ecoffload.cache.save"):
            self.poll()
            result, sources, entries = SaveResult(), [], []
            result.already_cached = [k for k in items if self.catalog.state(k) is not None]
            pinned = self._pin_ready(result.already_cached)  # protected while the batch reserves
            try:
                self._reserve_batch(items, result, sources, entries)
            finally:
                if pinned:
                    self.catalog.unpin_many(pinned)
            if not sources:
                return result
            try:
                done = self.mover.save(sources, step_tables(entries, fresh=True))
            except BaseException:
                for key in result.saved:
                    self.catalog.abort(key)
                raise
            self._pending_saves.append((done, result.saved))
            self.poll()
            return result

    def _pin_ready(self, keys: list[str]) -> list[str]:
        """Pin those of ``keys`` that are READY now; the ones pinned. (Asking first and
        pinning after would race another process's eviction on a shared arena.)"""
        pinned = []
        for key in keys:
            try:
                self.catalog.pin(key)
            except (UnknownItemError, ItemStateError):  # gone, or still being written
                continue
            pinned.append(key)
        return pinned

    def _reserve_batch(
        self,
        items: Mapping[str, torch.Tensor],
        result: SaveResult,
        sources: list[torch.Tensor],
        entries: list,
    ) -> None:
        skip = set(result.already_cached)
        for key, tensor in items.items():
            if key in skip:
                continue
            try:
                with nvtx_range("ecoffload.reserve"):
                    entry = self.catalog.reserve(
                        key, tensor.nbytes, dtype_name(tensor.dtype), tensor.shape
                    )
            except DuplicateItemError:  # another process reserved it since the state check
                result.already_cached.append(key)
                continue
            if entry is None:
                result.no_room.append(key)
                continue
            result.saved.append(key)
            sources.append(tensor)
            entries.append(entry)

    def load(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Tensors of the ready keys among ``keys`` (misses are left out), in one launch."""
        with nvtx_range("ecoffload.cache.load"):
            self.poll()
            # Found and pinned in one call: between a lookup and a pin another process
            # could evict the item (the shared catalog does both under one lock).
            lookup = self.catalog.lookup
            entries = [e for e in (lookup(k, pin=True) for k in keys) if e is not None]
            if not entries:
                return {}
            specs = [(dtype_from_name(e.dtype), e.shape) for e in entries]
            try:
                outputs, done = self.mover.load(step_tables(entries), specs)
            except BaseException:
                self.catalog.unpin_many([e.key for e in entries])
                raise
            keys_loaded = [e.key for e in entries]
            self._pending_loads.append((done, keys_loaded))
            loaded = dict(zip(keys_loaded, outputs, strict=True))
            if self.integrity:
                done.wait()
            self.poll()
            if self.integrity:
                loaded = {k: t for k, t in loaded.items() if self._verified(k, t)}
            return loaded

    def poll(self) -> None:
        """Commit saves and unpin loads whose copies have completed."""
        self._pending_saves = self._finish(self._pending_saves, self._commit_all)
        self._pending_loads = self._finish(self._pending_loads, self.catalog.unpin_many)

    def flush(self) -> None:
        """Wait for every copy in flight, then poll."""
        for done, _ in self._pending_saves + self._pending_loads:
            done.wait()
        self.poll()

    def _commit_all(self, keys: list[str]) -> None:
        for key in keys:
            self._commit(key)

    def _commit(self, key: str) -> None:
        crc = None
        if self.integrity:  # recorded with the commit: a READY item always has its CRC
            entry = self.catalog.entry(key)
            data = self.arena.host_tensor().numpy()
            crc = item_crc32(data, entry.extents, self.arena.block_bytes, entry.nbytes)
        self.catalog.commit(key, crc)

    def _verified(self, key: str, tensor: torch.Tensor) -> bool:
        data = tensor.reshape(-1).view(torch.uint8).cpu().numpy()
        entry = self.catalog.entry(key) if self.catalog.state(key) is not None else None
        if entry is not None and zlib.crc32(data.data) == entry.checksum:
            return True
        self.integrity_failures += 1
        log.error("ecoffload: %s failed its integrity check; dropping it", key)
        if entry is not None and entry.pins == 0:
            self.catalog.evict(key)
        return False

    def stats(self) -> CatalogStats:
        return self.catalog.stats()

    def close(self) -> None:
        """Finish copies in flight, then close the arena (idempotent)."""
        if not self.arena.closed:
            self.flush()
            if isinstance(self.catalog, SharedCatalog):
                self.catalog.close()
            self.arena.close()

    def __enter__(self) -> OffloadCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _finish(pending: list[tuple[Completion, list[str]]], apply) -> list:
        finished, still = split_completed(pending)
        for keys in finished:
            apply(keys)
        return still
