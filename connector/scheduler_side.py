"""Scheduler-side delegate: plans each step's copies against the host's shared catalog.

Per step (all on the scheduler's thread)::

    has_cache_item(key)              READY (saved by any instance)? pin it now
                                     (a promise: nothing may evict it before
                                     the step's metadata ships)
    update_state_after_alloc(r, i)   promised key -> load this step;
                                     else (producer) reserve blocks -> save
    build_connector_meta()           release unused promises, ship loads + saves
    update_connector_output(out)     worker reports: count saves the worker
                                     committed, unpin items every rank loaded

The catalog lives in the arena file (:mod:`.shared_arena`), so every instance
on the host that maps it sees every item. The writing worker commits a saved
item itself, once its copy event has completed (or aborts it), so an item
becomes visible only with its bytes in place, and an encode-only instance
publishes items even where vLLM never passes worker reports to its scheduler
(0.32's V1 runner). A loaded item is unpinned only when every tensor-parallel
rank has reported its unpack complete. Steps whose metadata vLLM dropped
(never echoed by the worker) have their reservations aborted and their pins
released. Reservations and pins belong to this process: if it dies, the
catalog releases them for the other instances.

Between hosts (``nixl`` configured, :mod:`.remote_pull`): ``request_finished``
returns ``ec_transfer_params`` announcing the request's READY items (copied into
the export window for a lease; never delays KV freeing), ``ensure_cache_available`` holds a request
while one NIXL read pulls its announced items into the local arena (then they
load as ordinary hits), ``take_unavailable_requests`` returns requests whose
items could neither be pulled nor encoded locally; each step
(``build_connector_meta``) advances reads and releases leases.

The cluster tier (``cluster`` configured, :mod:`.cluster_tier`):
``ensure_cache_available`` holds a request (without params) whose items are
not in the arena while one batched lookup per step and one batched fetch bring
them from Mooncake Store; ``update_connector_output`` publishes the items the
worker committed.

Without ``nixl`` or ``cluster``, hooks with nothing to do, answered on purpose (see the README's
hook table): ``ensure_cache_available`` (every promised item is already in the
local arena, pinned), ``take_unavailable_requests`` (a pinned item cannot become
unavailable), ``update_state_after_free`` (vLLM dropping its GPU copy changes
nothing in the arena), ``request_finished`` (pins belong to steps, not to
requests; KV freeing is never delayed).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..engine.base.errors import CatalogError, DuplicateItemError
from ..engine.base.liveness import ProcessId
from ..engine.catalog.shared.format import SharedEntry
from ..kernels.nvtx import nvtx_range
from ..kernels.step_table import StepTable
from .cluster_tier import ClusterConsumer
from .compat import (
    encoder_row_bytes,
    idle_steps_reach_worker,
    load_reports_per_step,
    worker_meta_reaches_scheduler,
)
from .config import OffloadConfig
from .metadata import ECOffloadMetadata, ECOffloadWorkerMetadata, LoadSpec, SaveSpec
from .remote_pull import RemoteConsumer, RemoteProducer, open_peer
from .shared_arena import default_arena_name, open_catalog, open_shared_arena
from .stats import COUNTERS, ECOffloadStats, delta

if TYPE_CHECKING:  # vLLM's own types for its hooks' arguments (imported by vLLM anyway)
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: OffloadConfig) -> None:
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None, "vLLM makes an EC connector only from ec_transfer_config"
        self.producer, self.consumer = transfer.is_ec_producer, transfer.is_ec_consumer
        self._vllm_config = vllm_config
        self._load_ranks = load_reports_per_step(vllm_config)  # reports that free a load
        self._idle_reports = idle_steps_reach_worker(vllm_config)
        # Where worker reports never arrive (an encode-only instance on 0.32's V1
        # runner) the worker still commits what it saved; the scheduler just
        # cannot follow (or count) its saves, so it keeps no records of them.
        self._reports = worker_meta_reaches_scheduler(vllm_config)
        self.arena = open_shared_arena(config, vllm_config, register_cuda="never")
        self.catalog = open_catalog(self.arena)
        self._counts: Counter[str] = Counter()
        self.peer = self.remote_producer = self.remote_consumer = None
        if config.nixl is not None:  # pulls between hosts (remote_pull.py)
            try:
                self.peer = open_peer(
                    self.arena, config.nixl, producer=self.producer, consumer=self.consumer
                )
            except BaseException:
                self.catalog.close()
                self.arena.close()
                raise
            layout = default_arena_name(vllm_config)  # hashes model and dtype
            if self.producer:
                self.remote_producer = RemoteProducer(self.peer, self.catalog, config.nixl,
                                                      self._counts, layout=layout)  # fmt: skip
            if self.consumer:
                self.remote_consumer = RemoteConsumer(self.peer, self.catalog, config.nixl,
                                                      self._counts, layout=layout)  # fmt: skip
        self.cluster = None
        if config.cluster is not None:  # the cluster tier (cluster_tier.py)
            try:
                self.cluster = ClusterConsumer(
                    self.arena, self.catalog, config.cluster,
                    layout=default_arena_name(vllm_config), publish=self.producer,
                    item_bytes=self._item_bytes,
                )  # fmt: skip
            except BaseException:
                self.shutdown()
                raise
        self._me = ProcessId.of_this_process()
        self._step = 0
        # Pinned hits not yet scheduled: the entry the pinning lookup returned (pinned, so
        # it stays as read: nothing asks the catalog again for it).
        self._promised: dict[str, Any] = {}
        self._missed_at_admission: set[str] = set()  # cluster tier: local misses counted
        self._loads: dict[str, tuple[LoadSpec, Any]] = {}  # key -> (spec, entry)
        self._saves: dict[str, SharedEntry] = {}  # key -> its reservation this step
        self._shipped: dict[int, tuple[list[str], list[str]]] = {}  # step -> (saves, loads)
        self._sizes: dict[str, tuple[str, int]] = {}  # key -> (modality, rows) asked to save
        self._row_bytes: dict[str, int] = {}  # modality -> bytes per output row (learned)
        self._row_bytes_of_config: dict[str, int | None] = {}  # modality -> from the config
        self._load_reports: Counter[str] = Counter()  # rank reports not yet turned into unpins
        # Shipped loads still holding a pin: key -> how many (a dict, not a Counter: its
        # Python-level __delitem__ showed in the per-hit profile).
        self._loading: dict[str, int] = {}
        self._load_nbytes: dict[str, int] = {}  # shipped load -> its bytes (for the counters)
        self._writing: dict[str, tuple[int, int]] = {}  # shipped save -> (nbytes, generation)
        self._reported: dict[str, int | float] = {}

    def has_cache_item(self, identifier: str) -> bool:
        if not self.consumer:
            return False
        if identifier in self._promised or identifier in self._loads:
            return True
        if self._missed_at_admission and identifier in self._missed_at_admission:
            self._missed_at_admission.discard(identifier)
            if not self._local(identifier, admission=False):
                self.catalog.local.misses -= 1  # counted once already, at admission
                return False
            return True
        return self._local(identifier, admission=False)

    def _admit_local(self, identifier: str) -> bool:
        """The cluster tier's admission asking for one item: an item already promised or
        loading this step is local (a second pin would never be released)."""
        if identifier in self._promised or identifier in self._loads:
            return True
        return self._local(identifier)

    def _local(self, identifier: str, admission: bool = True) -> bool:
        """In this host's arena? A hit is pinned and promised to the step (as
        :meth:`has_cache_item` does; the cluster tier's admission asks the same way,
        so the promise serves both and a local hit costs one lookup)."""
        entry = self.catalog.lookup(identifier, pin=True)
        if entry is None:
            if admission:
                if len(self._missed_at_admission) > 1 << 16:  # keys never scheduled
                    self._missed_at_admission.clear()
                self._missed_at_admission.add(identifier)
            return False
        if entry.producer != self._me:
            self._counts["hits_from_other_instances"] += 1
        self._promised[identifier] = entry
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        key = feature.identifier
        entry = self._promised.pop(key, None)
        if entry is not None:  # the pinned entry has_cache_item read: no second round trip
            self._loads[key] = (LoadSpec(key, entry.nbytes, entry.dtype, entry.shape), entry)
            return
        if key in self._loads or not self.producer:
            return  # loading, or not ours to save
        rows = request.get_num_encoder_embeds(index)
        nbytes = self._item_bytes(feature.modality, rows)
        if nbytes is None:
            # Size unknown yet: the worker's report of this item teaches it (unless some
            # instance is saving it already), and the next item is saved.
            if self._reports and self.catalog.state(key) is None:
                self._sizes[key] = (feature.modality, rows)
            return
        try:  # one lock round trip: reserve refuses a key any instance saved or is saving
            with nvtx_range("ecoffload.reserve"):
                entry = self.catalog.reserve(key, nbytes)
        except DuplicateItemError:
            return
        if entry is None:
            self._counts["saves_skipped_no_room"] += 1
            return
        self._saves[key] = entry
        if self._reports:  # a worker report settles it (and its size, if refused), then drops it
            self._sizes[key] = (feature.modality, rows)
            self._writing[key] = (entry.nbytes, entry.generation)

    def _item_bytes(self, modality: str, rows: int) -> int | None:
        """An item's size: its rows times the bytes per row (learned from the worker's
        reports, else from the config), or None where either is unknown."""
        row_bytes = self._row_bytes.get(modality) or self._config_row_bytes(modality)
        return rows * row_bytes if row_bytes and rows else None

    def _config_row_bytes(self, modality: str) -> int | None:
        """Bytes per encoder output row as the model config gives them (read once per
        modality: the config does not change, and reading it costs vLLM attribute lookups)."""
        if modality not in self._row_bytes_of_config:
            self._row_bytes_of_config[modality] = encoder_row_bytes(self._vllm_config, modality)
        return self._row_bytes_of_config[modality]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECOffloadMetadata:
        if self.remote_producer is not None:  # once per step: leases read or expired
            self.remote_producer.step()
        if self.remote_consumer is not None:  # once per step: connections, reads
            self.remote_consumer.step()
        if self.cluster is not None:  # once per step: the lookup, the fetch, publish unpins
            self.cluster.step()
        if self._promised:  # promised, but vLLM did not schedule them: one lock round trip
            promised, self._promised = self._promised, {}
            self.catalog.unpin_many(list(promised))
            # Not served (yet): their hits are uncounted, the lookup that schedules them
            # counts them (a held request's items would otherwise count at each admission).
            self.catalog.local.hits -= len(promised)
            others = sum(1 for entry in promised.values() if entry.producer != self._me)
            if others:
                self._counts["hits_from_other_instances"] -= others
        self._step += 1
        loads, saves = self._loads, self._saves
        meta = ECOffloadMetadata(
            self._step,
            self.arena.nonce,
            loads=[spec for spec, _ in loads.values()],
            saves={key: SaveSpec(i, entry.nbytes, entry.generation)
                   for i, (key, entry) in enumerate(saves.items())},
            load_table=StepTable.of_entries([entry for _, entry in loads.values()]),
            # fresh reservations, shipped once: one pass, not an array made per entry
            save_table=StepTable.from_tables([entry.extents for entry in saves.values()]),
        )  # fmt: skip
        if loads or (saves and self._reports):
            self._shipped[self._step] = (list(saves), list(loads))
        loading, load_nbytes = self._loading, self._load_nbytes
        for key, (spec, _) in loads.items():  # one pin per shipped load
            loading[key] = loading.get(key, 0) + 1
            load_nbytes[key] = spec.nbytes
        self._loads, self._saves = {}, {}
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        report = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(report, ECOffloadWorkerMetadata):
            return
        self._settle_steps(report.steps)
        for key in report.saved:  # the worker committed them
            shipped = self._writing.pop(key, None)
            if shipped is None:
                self._counts["unexpected_reports"] += 1
            else:
                self._counts["items_saved"] += 1
                self._counts["bytes_saved"] += shipped[0]
            self._sizes.pop(key, None)
        for key, nbytes in report.not_saved.items():  # the worker aborted them
            if self._writing.pop(key, None) is not None:
                self._counts["saves_failed"] += 1
            modality, rows = self._sizes.pop(key, (None, 0))
            if modality is not None and rows and nbytes > 0 and nbytes % rows == 0:
                self._row_bytes[modality] = nbytes // rows
        if report.loaded:
            self._loads_reported(report.loaded)
        if self.cluster is not None and report.saved:
            self.cluster.publish(list(report.saved))

    def _loads_reported(self, loaded: dict[str, int]) -> None:
        """Turn the ranks' load reports into unpins: one per shipped load every rank
        reported, all in one lock round trip."""
        finished: list[str] = []
        loading, pending, per_load = self._loading, self._load_reports, self._load_ranks
        unexpected = count = nbytes = 0
        for key, ranks in loaded.items():
            held = loading.get(key, 0)
            if not held or ranks <= 0:
                unexpected += 1  # not a load we shipped: ignore
                continue
            reports = (pending.pop(key, 0) if pending else 0) + ranks
            done = min(reports // per_load, held)
            if done:
                reports -= done * per_load
                count += done
                nbytes += done * self._load_nbytes[key]
                held -= done
                if held:
                    loading[key] = held
                else:  # this key's last shipped load: forget it (as _forget_load does)
                    del loading[key]
                    del self._load_nbytes[key]
                finished += [key] * done
            if reports and held:
                pending[key] = reports
        counts = self._counts
        if unexpected:
            counts["unexpected_reports"] += unexpected
        if count:
            counts["items_loaded"] += count
            counts["bytes_loaded"] += nbytes
        if finished:
            self.catalog.unpin_many(finished)

    def _settle_steps(self, processed: set[int]) -> None:
        """Forget echoed steps; undo the ones vLLM dropped before the newest echoed one."""
        if not processed:
            return
        newest = max(processed)
        for step in [s for s in self._shipped if s in processed or s < newest]:
            saves, loads = self._shipped.pop(step)
            if step in processed:
                continue
            log.debug("ecoffload: step %d metadata was never processed; undoing it", step)
            for key in saves:  # no worker saw them: nothing writes these blocks
                self._sizes.pop(key, None)
                shipped = self._writing.pop(key, None)
                if shipped is not None:
                    self._abort(key, shipped[1])
            released = []
            for key in loads:
                if self._loading.get(key):  # not already released by a (stray) report
                    self._forget_load(key)
                    released.append(key)
            if released:
                self.catalog.unpin_many(released)

    def _abort(self, key: str, generation: int) -> None:
        """Abort our reservation ``generation`` of ``key`` if it is still WRITING."""
        with contextlib.suppress(CatalogError):  # gone, or reserved again
            self.catalog.abort(key, generation=generation)

    def _forget_load(self, key: str) -> None:
        """One shipped load of ``key`` done with (the caller unpins it)."""
        held = self._loading[key] - 1
        if held:
            self._loading[key] = held
        else:
            del self._loading[key]
            del self._load_nbytes[key]

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        # Pins and reservations of steps are released by worker reports; a remote
        # announcement's pins by the consumer's notification or the lease. vLLM
        # ORs the bool into the KV blocks' delay-free flag, which only a KV
        # connector can clear: never delay KV freeing.
        if self.remote_consumer is not None:
            self.remote_consumer.forget(request.request_id)
        if self.cluster is not None:
            self.cluster.forget(request.request_id)
        if self.remote_producer is None:
            return False, None
        return False, self.remote_producer.announce(request)

    def has_pending_push_work(self) -> bool:
        """Keep an idle engine stepping while a shipped save or load awaits its report.

        Only where idle steps reach the worker (V2): there each step collects the
        reports of copies that completed since. V1 never calls the worker hooks
        on idle steps, so asking it to step would spin without progress; its
        copies settle on the next step with work (CPU copies on the same step).
        """
        return self._idle_reports and bool(self._writing or self._loading)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if (
            self.cluster is not None
            and self.consumer
            and not getattr(request, "ec_transfer_params", None)
        ):
            try:
                return self.cluster.admit(request, num_computed_tokens, self._admit_local)
            except Exception:  # the tier must never fail the scheduler: encode locally
                log.exception("ecoffload: cluster lookup of %s failed; encoding locally",
                              request.request_id)  # fmt: skip
                return True
        if self.remote_consumer is None:
            return True  # promised items are already in the local arena, pinned
        try:
            return self.remote_consumer.admit(request, num_computed_tokens)
        except Exception:  # a pull must never fail the scheduler: encode locally instead
            log.exception("ecoffload: admitting %s failed; its items are encoded locally",
                          request.request_id)  # fmt: skip
            request.ec_transfer_params = None
            return True

    def take_unavailable_requests(self) -> set[str]:
        if self.remote_consumer is None:
            return set()  # a pinned local item cannot become unavailable
        return self.remote_consumer.take_unavailable()

    def update_state_after_free(self, request: Request, index: int) -> None:
        return None  # vLLM freeing its GPU copy changes nothing in the arena

    def stats(self) -> dict[str, int | float]:
        """Cumulative counters of this instance (its hits, misses, items/bytes saved
        and loaded...; ``evictions`` counts the whole shared arena's) and the
        arena's occupancy and populate progress now (:data:`~.stats.GAUGES`)."""
        catalog = self.catalog.stats()
        counts: dict[str, int | float] = {name: self._counts.get(name, 0) for name in COUNTERS}
        counts.update(
            hits=self.catalog.local.hits,
            misses=self.catalog.local.misses,
            evictions=catalog.evictions,
            items_resident=catalog.items_resident,
            bytes_resident=catalog.bytes_resident,
            blocks_free=catalog.free_blocks,
            blocks_total=self.catalog.allocator.num_blocks,
            arena_ready_fraction=self.arena.ready_fraction,
            arena_verified_fraction=self.catalog.verification().fraction,
        )
        if self.cluster is not None:
            counts.update(self.cluster.stats())
        return counts

    def get_ec_connector_stats(self) -> ECOffloadStats | None:
        """Counter increments and changed gauges since the previous call."""
        changed = delta(self.stats(), self._reported)
        return ECOffloadStats(data=changed) if changed else None

    def shutdown(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close()
            self.cluster = None
        if self.remote_consumer is not None:
            self.remote_consumer.close()
        if self.remote_producer is not None:
            self.remote_producer.close()
        if self.peer is not None:
            self.peer.close()
        self.catalog.close()
        self.arena.close()
