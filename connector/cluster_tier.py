"""The connector's side of the cluster tier (``cluster`` configured): hold a request
while its local misses are looked up and fetched from Mooncake Store, publish
what the worker saved.

Per step, on the scheduler's thread::

    ensure_cache_available(r)   -> admit(r): items of r neither in the arena nor
                                   being fetched are noted and r is held (False);
                                   r is admitted once its lookup found nothing or
                                   its fetch ended (fetched items are then READY
                                   in the arena and load as ordinary hits; the
                                   others are encoded locally); r's fetch still
                                   in flight is waited for here (within the
                                   step's bound below), and a fetch that has
                                   ended is polled (its items committed) here,
                                   so r is admitted in this step, not the next
    build_connector_meta()      -> step(): the tier's step (unpins what the
                                   publisher finished, polls every pending
                                   fetch); then ONE batched lookup of every
                                   item noted this step, and ONE batched get of
                                   the hits into reserved arena blocks
    update_connector_output()   -> publish(report.saved): the worker committed
                                   them; the tier puts them asynchronously

A request is held at most one step for its lookup plus the fetch's bound
(``fetch_timeout_s``); the master unreachable makes every lookup a miss at once.
While a request waits on a fetch, its admission (and then step(), for what is
left) waits for it at most :data:`HOLD_YIELD_S` per step: vLLM steps again at
once while a request is held, and a scheduler thread that never sleeps hands the
GIL to the fetch lane (whose header, MAC and CRC-32 checks are Python) only every
switch interval (5 ms). The wait sits in the admission so that a fetch ending
during it admits its request in that step: waited for in step() (after the
step's admissions), it was admitted one engine iteration later.

Each request admitted after a fetch logs one INFO line (``vllm.ecoffload_cluster_hold``)
with its hold phase by phase, in ms after admission first held it: the lookup's
start and end, the fetch posted, the get's start and end on the fetch lane, the
MAC and CRC-32 done, the commit, the admission, and the steps it was held.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine.cluster.store import StoreClient, StoreSettings
from ..engine.cluster.tier import COUNTERS as TIER_COUNTERS
from ..engine.cluster.tier import ClusterFetch, ClusterTier, Expected
from ..engine.cluster.value import load_key
from ..engine.remote.nixl_setup import outward_ip
from .config import ClusterConfig

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ..engine.arena.arena import Arena
    from ..engine.catalog.shared.catalog import SharedCatalog

log = logging.getLogger(__name__)
#: One line per request admitted after a cluster fetch: its hold, phase by phase
#: (under vLLM's logger, so ``vllm serve`` prints it at its default INFO level).
hold_log = logging.getLogger("vllm.ecoffload_cluster_hold")

COUNTERS = TIER_COUNTERS
GAUGES = ("cluster_available",)
HOLD_YIELD_S = 0.002  # longest wait of a step for a fetch a held request needs


class ClusterConsumer:
    """Lookups, fetches and publishes of one scheduler (see the module docstring)."""

    def __init__(self, arena: Arena, catalog: SharedCatalog, config: ClusterConfig, *, layout: str,
                 publish: bool, item_bytes: Callable[[str, int], int | None]) -> None:  # fmt: skip
        """``item_bytes(modality, rows)``: an item's size as the scheduler knows it, or
        None (checked against the store's size before a fetch reserves anything)."""
        settings = StoreSettings(
            master=config.master,
            metadata=config.metadata,
            host=config.host or outward_ip(),
            protocol=config.protocol,
            segment_bytes=config.segment_bytes,
        )
        self.catalog = catalog
        self.tier = ClusterTier(
            arena,
            catalog,
            StoreClient(settings),
            namespace=layout,
            key=load_key(config.key_file) if config.key_file else None,
            fetch_timeout_s=config.fetch_timeout_s,
            publish=publish and config.publish,
            queue_items=config.publish_queue,
        )
        self._item_bytes = item_bytes
        self._asked: dict[str, dict[str, Expected]] = {}  # request -> its local misses, this step
        self._fetching: dict[str, ClusterFetch] = {}  # request -> the fetch bringing its items
        self._inflight: dict[str, ClusterFetch] = {}  # key -> the fetch bringing it
        self._ready: set[str] = set()  # requests whose lookup or fetch ended
        self._holds: dict[str, dict[str, float]] = {}  # request -> monotonic times, steps
        self._hold_fetch: dict[str, ClusterFetch] = {}  # request -> its fetch (its times)
        self._yield_until: float | None = None  # this step's waits end by then
        # Requests admitted once: vLLM asks again every step while they run (with the tokens
        # computed so far); their items were settled at that admission (local, fetched, or
        # encoded by vLLM, whose encoder cache holds them), so they are never held again.
        self._admitted: set[str] = set()

    def admit(
        self, request: Request, num_computed_tokens: int, is_local: Callable[[str], bool]
    ) -> bool:
        """``ensure_cache_available``; ``is_local(key)``: the scheduler's own lookup (a hit
        is pinned and promised to the step, so it costs no second lookup later)."""
        rid = request.request_id
        if rid in self._admitted:
            return True
        f = self._fetching.get(rid)
        if f is not None and f.future is not None:
            if not f.future.done():
                self._yield([f.future])
            if f.future.done():
                self.tier.poll(f)  # ended: commit now, admit this step
            if f.state != "pending":
                del self._fetching[rid]
                self._ready.add(rid)
        if rid in self._ready:
            self._ready.discard(rid)
            self._log_hold(rid)
            self._admitted.add(rid)
            return True
        if rid in self._fetching or rid in self._asked:
            return False
        features = request.mm_features
        if self._inflight and any(
            f.identifier in self._inflight
            and f.mm_position.offset + f.mm_position.length > num_computed_tokens
            for f in features
        ):
            # Another request's fetch brings one: wait for that one (before asking the
            # catalog about any item: each step's asking would count its hits again).
            return False
        misses: dict[str, Expected] = {}
        for index, feature in enumerate(features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already computed: not needed
            key = feature.identifier
            if not is_local(key):
                rows = request.get_num_encoder_embeds(index)
                misses[key] = Expected(rows, self._item_bytes(feature.modality, rows))
        if not misses or not self.tier.available:
            self._admitted.add(rid)
            return True
        self._asked[rid] = misses
        self._holds[rid] = {"noted": time.monotonic(), "steps": 0}
        return False

    def _log_hold(self, rid: str) -> None:
        hold, f = self._holds.pop(rid, None), self._hold_fetch.pop(rid, None)
        if hold is None or f is None:
            return
        hold = {**hold, **f.times}
        now = time.monotonic()
        ms = {k: (v - hold["noted"]) * 1e3 for k, v in hold.items() if k != "steps"}
        hold_log.info(
            "ecoffload: cluster hold of %s, ms after admission noted it: lookup %.2f-%.2f, "
            "fetch posted %.2f, get %.2f-%.2f, MAC+CRC done %.2f, committed %.2f, "
            "admitted %.2f (%d steps)", rid, ms.get("lookup", -1), ms.get("looked", -1),
            ms.get("posted", -1), ms.get("started", -1), ms.get("got", -1), ms.get("checked", -1),
            ms.get("committed", -1), (now - hold["noted"]) * 1e3, hold["steps"],
        )  # fmt: skip

    def _yield(self, futures: list[cf.Future]) -> None:
        """Wait for any of ``futures``, at most what is left of this step's
        :data:`HOLD_YIELD_S` (admissions and :meth:`step` share it)."""
        now = time.monotonic()
        if self._yield_until is None:
            self._yield_until = now + HOLD_YIELD_S
        if futures and self._yield_until > now:
            cf.wait(futures, timeout=self._yield_until - now, return_when=cf.FIRST_COMPLETED)

    def step(self) -> None:
        tier = self.tier
        for hold in self._holds.values():
            hold["steps"] += 1
        if self._fetching:
            self._yield([f.future for f in self._fetching.values() if f.future is not None])
        self._yield_until = None  # the next admission belongs to the next step
        tier.step()  # polls every pending fetch, whether or not a request waits on it
        if self._fetching:  # (each test first: most steps have nothing in flight)
            for rid, f in list(self._fetching.items()):
                if f.state != "pending":
                    del self._fetching[rid]
                    self._ready.add(rid)
        if self._inflight:
            self._inflight = {k: f for k, f in self._inflight.items() if f.state == "pending"}
        if not self._asked:
            return
        asked, self._asked = self._asked, {}
        expected = {k: e for ks in asked.values() for k, e in ks.items()}
        keys = sorted(expected)
        looked = [time.monotonic()]
        sizes = tier.lookup(keys)  # the step's one existence query
        looked.append(time.monotonic())
        if not sizes:
            self._ready.update(asked)
            return
        f = tier.fetch(sizes, expected)  # the step's one batched get
        for rid in asked:
            if rid in self._holds:
                self._holds[rid].update(lookup=looked[0], looked=looked[1])
                self._hold_fetch[rid] = f
        for rid, ks in asked.items():
            if f.state == "pending" and any(k in sizes for k in ks):
                self._fetching[rid] = f
            else:
                self._ready.add(rid)
        if f.state == "pending":
            self._inflight.update(dict.fromkeys(f.reserved, f))

    def publish(self, keys: list[str]) -> None:
        if keys:
            self.tier.publish(keys)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its fetch, if any, runs to its end alone."""
        self._asked.pop(request_id, None)
        self._fetching.pop(request_id, None)
        self._ready.discard(request_id)
        self._holds.pop(request_id, None)
        self._hold_fetch.pop(request_id, None)
        self._admitted.discard(request_id)

    def stats(self) -> dict[str, int]:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()
