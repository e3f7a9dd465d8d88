"""Worker-side delegate: moves bytes, one launch per direction per step.

Per step, inside vLLM's bound-metadata window::

    bind_connector_metadata(meta)
    start_load_caches(encoder_cache)     one unpack of every load into the
                                         encoder cache; the compute stream waits
    save_caches(encoder_cache, key) *    queue each fresh output that has a
                                         reservation (writing rank only)
    build_connector_worker_meta()        one pack of the queued outputs; report
                                         copies that completed, keys never saved
    clear_connector_metadata()

Only the writer rank (rank 0 of the tensor- and prefill-context-parallel
groups, first pipeline stage) writes and reports the worker counters; every
rank loads. Copies run on the mover's stream; the writer commits a save in
the host's shared catalog (making it visible to every instance) only once its
event has completed (with ``nixl`` configured: before the step's report, so
a request's items are READY when it finishes and the scheduler announces
it), and aborts the reservations it will never fill. V2 runs
the same hooks on steps without a forward, which is how copies still in
flight at the end of traffic get committed and reported.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..engine.base.errors import ArenaError, CatalogError
from ..engine.base.items import dtype_from_name, dtype_name, item_crc32
from ..engine.transfer import BlockMover, Completion, split_completed
from ..kernels import PACK_CONFIG, UNPACK_CONFIG, PlanError
from ..kernels.step_table import StepTable
from .compat import is_writer_rank, worker_device
from .config import OffloadConfig
from .metadata import ECOffloadMetadata, ECOffloadWorkerMetadata
from .shared_arena import open_catalog, open_shared_arena
from .stats import WORKER_COUNTERS, ECOffloadStats, delta

if TYPE_CHECKING:  # vLLM's own types for its hooks' arguments (imported by vLLM anyway)
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class _Saved(NamedTuple):
    """A save in flight: what the commit needs once its copy completed."""

    generation: int  # the reservation's, in the shared catalog
    dtype: str
    shape: tuple[int, ...]
    extents: np.ndarray  # int64 [k, 2]: its (start, count) pairs (for the CRC)
    nbytes: int


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, config: OffloadConfig) -> None:
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None, "vLLM makes an EC connector only from ec_transfer_config"
        self.producer, self.consumer = transfer.is_ec_producer, transfer.is_ec_consumer
        self.reports_stats = is_writer_rank()  # one worker per instance counts
        self.writes = self.producer and self.reports_stats
        self.device = worker_device(vllm_config)
        self.arena = open_shared_arena(config, vllm_config, register_cuda="auto")
        self.catalog = open_catalog(self.arena) if self.writes else None  # commits saves
        pack_config, unpack_config = PACK_CONFIG, UNPACK_CONFIG
        if config.num_programs is not None:  # the grid size only; the rest as measured
            pack_config = replace(PACK_CONFIG, num_programs=config.num_programs)
            unpack_config = replace(UNPACK_CONFIG, num_programs=config.num_programs)
        self.mover = BlockMover(
            self.arena, self.device, pack_config=pack_config, unpack_config=unpack_config
        )
        self._meta: ECOffloadMetadata | None = None
        self._unflushed: ECOffloadMetadata | None = None  # bound, saves not launched yet
        self._queued: dict[str, torch.Tensor] = {}
        self._not_saved: dict[str, int] = {}
        self._steps: set[int] = set()
        self._pending_saves: list[tuple[Completion, dict[str, _Saved]]] = []  # until complete
        self._checksums = config.persistent  # a warm restart re-checks them
        # Between hosts (nixl), the scheduler announces a request's items when it
        # finishes, READY ones only: commit a step's saves before reporting it.
        self._publish_in_step = config.nixl is not None and self.writes
        self._pending_loads: list[tuple[Completion, list[str]]] = []
        self._counts: Counter[str] = Counter()
        self._reported: dict[str, int | float] = {}

    def bind_connector_metadata(self, metadata: ECOffloadMetadata) -> None:
        if metadata.arena != self.arena.nonce:
            # Block tables index the scheduler's arena: following them into another
            # file would serve wrong bytes. Stop loudly instead.
            raise ArenaError(
                f"the scheduler's arena (nonce {metadata.arena:#x}) is not the file this "
                f"worker mapped ({self.arena.path}, nonce {self.arena.nonce:#x}): give every "
                "process of the instance the same arena_name and arena_dir"
            )
        self._check_tables(metadata)
        self._meta = self._unflushed = metadata
        self._steps.add(metadata.step)

    def _check_tables(self, meta: ECOffloadMetadata) -> None:
        """The scheduler's tables, checked before any copy (a pickle is data from another
        process): step tables (unpickling checked their arrays), one table per load,
        every save naming one of its table's items, every extent inside this arena (in
        the planner's C pass where built: one pass over the arrays). PlanError otherwise."""
        load_table, save_table = meta.load_table, meta.save_table
        if not (isinstance(load_table, StepTable) and isinstance(save_table, StepTable)):
            raise PlanError(
                f"step {meta.step}: the scheduler's block tables must be StepTables, got "
                f"{type(load_table).__name__} and {type(save_table).__name__}"
            )
        if len(load_table) != len(meta.loads):
            raise PlanError(
                f"step {meta.step}: {len(meta.loads)} loads but {len(load_table)} block "
                "tables for them: the scheduler and this worker disagree (a bug)"
            )
        items = len(save_table)
        for key, spec in meta.saves.items():
            if type(spec.item) is not int or not 0 <= spec.item < items:
                raise PlanError(
                    f"step {meta.step}: save {key!r} names block table {spec.item!r} of "
                    f"{items}: the scheduler and this worker disagree (a bug)"
                )
        num_blocks = self.arena.num_blocks
        load_table.check(num_blocks)
        save_table.check(num_blocks)

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        loads = meta.loads
        specs = [(dtype_from_name(spec.dtype), spec.shape) for spec in loads]
        outputs, done = self.mover.load(meta.load_table, specs)  # the arrays as shipped
        keys = [spec.key for spec in loads]
        self._counts["load_launches"] += 1
        self._counts["items_loaded"] += len(keys)
        self._counts["bytes_loaded"] += sum(spec.nbytes for spec in loads)
        for key, tensor in zip(keys, outputs, strict=True):
            encoder_cache[key] = tensor
        self._pending_loads.append((done, keys))

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._counts["encoder_outputs"] += 1  # vLLM calls this once per encoded item
        if not self.writes:
            return
        tensor = encoder_cache[mm_hash]
        spec = self._meta.saves.get(mm_hash) if self._meta is not None else None
        if spec is None or tensor.nbytes != spec.nbytes or not tensor.is_contiguous():
            # No reservation (or a wrong size guess): report the real size so the
            # scheduler reserves correctly next time; the item is recomputed.
            if spec is not None:
                self._abort(mm_hash, spec.generation)
            self._not_saved[mm_hash] = tensor.nbytes
            return
        self._queued[mm_hash] = tensor

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> ECOffloadWorkerMetadata:
        self._flush_saves()
        report = ECOffloadWorkerMetadata(steps=self._steps, not_saved=self._not_saved)
        self._steps, self._not_saved = set(), {}
        if self._publish_in_step:
            for done, _ in self._pending_saves:
                done.wait()
        saved, self._pending_saves = split_completed(self._pending_saves)
        for batch in saved:
            self._commit(batch, report)
        loaded, self._pending_loads = split_completed(self._pending_loads)
        for keys in loaded:
            report.loaded.update(keys)
        return report

    def _flush_saves(self) -> None:
        """One pack launch for the step's queued outputs, once per step (V2 asks
        for stats before the worker metadata; both must see the launch)."""
        meta, self._unflushed = self._unflushed, None
        queued, self._queued = self._queued, {}
        if self.writes and meta is not None:
            for key, spec in meta.saves.items():
                if key not in queued and key not in self._not_saved:
                    self._abort(key, spec.generation)
                    self._not_saved[key] = -1  # reserved, but never produced this step
        if not queued:
            return
        assert meta is not None, "outputs are queued only under a step's metadata"
        specs = [meta.saves[k] for k in queued]
        table = meta.save_table.select([spec.item for spec in specs])  # array slices
        try:
            done = self.mover.save(list(queued.values()), table)
        except Exception:  # an offload failure must never fail the request
            log.exception("ecoffload: saving %d encoder outputs failed", len(queued))
            for key, spec in zip(queued, specs, strict=True):
                self._abort(key, spec.generation)
                self._not_saved[key] = -1
            return
        saved = {
            k: _Saved(
                spec.generation, dtype_name(t.dtype), tuple(t.shape), table.extents_of(i), t.nbytes
            )  # fmt: skip
            for i, ((k, t), spec) in enumerate(zip(queued.items(), specs, strict=True))
        }
        self._pending_saves.append((done, saved))
        self._counts["save_launches"] += 1
        self._counts["items_saved"] += len(queued)
        self._counts["bytes_saved"] += sum(t.nbytes for t in queued.values())

    def _commit(self, batch: dict[str, _Saved], report: ECOffloadWorkerMetadata) -> None:
        """Publish saves whose copy completed: READY for every instance on the host
        (with the CRC-32 of the bytes on a persistent arena, for a warm restart)."""
        catalog = self.catalog
        assert catalog is not None, "only the writer rank commits"
        host = self.arena.host_tensor().numpy() if self._checksums else None
        for key, item in batch.items():
            crc = None
            if host is not None:
                crc = item_crc32(host, item.extents.tolist(), self.arena.block_bytes,
                                 item.nbytes)  # fmt: skip
            try:
                catalog.commit(key, crc, generation=item.generation, dtype=item.dtype,
                                    shape=item.shape)  # fmt: skip
            except CatalogError as exc:  # the reservation is gone: never serve these bytes
                log.warning("ecoffload: not publishing %s: %s", key, exc)
                report.not_saved[key] = -1  # in this report, beside the saves it holds
                continue
            report.saved.add(key)

    def _abort(self, key: str, generation: int) -> None:
        """Give back reservation ``generation`` of ``key``: it will never be filled."""
        assert self.catalog is not None, "only the writer rank reserves"
        with contextlib.suppress(CatalogError):  # gone, or reserved again
            self.catalog.abort(key, generation=generation)

    def stats(self) -> dict[str, int | float]:
        """This worker's cumulative counters: encoder outputs seen, launches, items
        and bytes copied (copies started, not confirmed: the scheduler counts those);
        gauges: shares of the arena populated, and registered with CUDA by this worker."""
        names = (*WORKER_COUNTERS, "items_saved", "bytes_saved", "items_loaded", "bytes_loaded")
        counts: dict[str, int | float] = {name: self._counts.get(name, 0) for name in names}
        counts["arena_ready_fraction"] = self.arena.ready_fraction
        counts["arena_registered_fraction"] = self.arena.registered_fraction
        return counts

    def get_ec_connector_stats(self) -> ECOffloadStats | None:
        """Increments of :data:`~.stats.WORKER_COUNTERS` since the previous call
        (V2 asks every worker each step; only the writer rank answers, so vLLM's
        merge of all workers' stats counts each event once)."""
        self._flush_saves()
        if not self.reports_stats:
            return None
        now: dict[str, int | float] = {name: self._counts.get(name, 0) for name in WORKER_COUNTERS}
        changed = delta(now, self._reported)
        return ECOffloadStats(data=changed) if changed else None

    def start_worker_services(self) -> None:
        log.info(
            "ecoffload: worker ready on %s: arena %s (%d blocks of %d bytes), %s copy path, %s",
            self.device, self.arena.path, self.arena.num_blocks, self.arena.block_bytes,
            self.mover.path, "writes saves" if self.writes else "loads only",
        )  # fmt: skip

    def shutdown(self) -> None:
        for done, _ in self._pending_saves + self._pending_loads:
            done.wait()
        finished = ECOffloadWorkerMetadata()
        saved, unfinished = split_completed(self._pending_saves)
        for batch in saved:  # complete now: publish them
            self._commit(batch, finished)
        if unfinished:  # never published: their reservations are reaped once we are gone
            log.warning("ecoffload: %d save(s) never completed their copy; not publishing them",
                        sum(len(batch) for _, batch in unfinished))  # fmt: skip
        self._pending_saves, self._pending_loads = [], []
        if self.catalog is not None:
            self.catalog.close()
        self.arena.close()
