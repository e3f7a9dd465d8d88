"""Encoder outputs pulled between hosts' arenas with NIXL, through ``ec_transfer_params``.

Enabled by the ``nixl`` key of ``ec_connector_extra_config``; it lives in the
scheduler process, which maps the arena, so a NIXL read lands in the local
arena from there. Workers are unchanged: a pulled item is READY in the local
catalog, and the ordinary path (``has_cache_item`` -> load) serves it.

Protocol, one request::

    producer host                            proxy                  consumer host
    (ec_producer / ec_both)                                         (ec_consumer / ec_both)
    encodes; its worker commits the items
    request_finished(r) -> (False, params):  takes the producer's
      copies r's READY items into its        RequestOutput's
      export window (a lease)
                                             ec_transfer_params,
                                             sends the request to
                                             the consumer with
                                             SamplingParams(extra_args=
                                             {"ec_transfer_params":
                                              params})
                                                                    ensure_cache_available(r):
                                                                      items announced, not local:
                                                                      connect (from the params;
                                                                      no round trip),
                                                                      reserve local blocks, ONE
                                                                      NIXL READ; False (held)
                                                                    each step: poll the reads
                                                                      "done": check CRC-32, commit;
                                                                      next call True, the items
                                                                      load as local hits
                                                                      "error": encode locally
    each step: the consumer's notification  <-- sent by NIXL when the read ends
      or the lease's expiry -> zero and free
      the window slots

``ec_transfer_params``: the JSON of :class:`.transfer_params.TransferParams`
(that module is the wire format, both directions).

Doors: no NIXL listener runs on either side. The producer registers only its
export window (copies of announced items, zeroed when their lease ends), never
the arena; the consumer registers its arena as the local end of its reads and
never publishes its metadata. README "Security" has the whole trust model.

Rules:

* Only READY items are announced (pinned under the catalog lock while they are
  copied into the window): an item still WRITING (its copy not complete), or
  one the window has no room for, is omitted and the consumer encodes it.
* The returned bool is always False. vLLM 0.32 ORs it into the *KV* blocks'
  delay-free flag, and only a KV connector's ``finished_sending`` frees such
  blocks, so True would leak them; the lease (window slots) keeps the items instead.
* A pull never blocks the scheduler: connecting is local work (the params carry
  the producer's metadata), the read is polled once per step
  (``build_connector_meta``), bounded by ``timeout_s`` and by the lease
  (``expires_at`` less a second of clock skew). A pull that fails, times
  out or whose bytes fail the CRC-32 is given up: its reservations are aborted
  once NIXL can no longer write into them (``PullHandle.settled``), and the
  request's items are encoded locally when it carries their inputs (else the
  request is returned by ``take_unavailable_requests``: vLLM aborts it).
* Garbled or foreign ``ec_transfer_params``, or params of another layout
  (model, dtype) or whose rows differ from the request's, are refused (logged,
  counted) and the request falls back the same way; nothing raises into the
  scheduler.
* Leases end on the consumer's notification or after ``lease_s``, checked on
  every step and by a small thread while leases are held (an idle engine does
  not step).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.base.errors import CatalogError
from ..engine.base.items import item_crc32
from ..engine.catalog.allocator import Extent
from ..engine.catalog.catalog import ItemState
from ..engine.remote.peer import ArenaPeer
from ..engine.remote.records import Pull, PullHandle
from .config import NixlConfig
from .transfer_params import AnnouncedItem, TransferParams

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ..engine.arena.arena import Arena
    from ..engine.catalog.shared.catalog import SharedCatalog

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 1.0  # assumed bound on the hosts' wall-clock difference


def open_peer(arena: Arena, config: NixlConfig, *, producer: bool, consumer: bool) -> ArenaPeer:
    """This scheduler's NIXL agent: a producer exports a window (never the arena), a
    consumer registers its arena as the local end of its reads. Nothing listens."""
    name = f"ecoffload-{socket.gethostname()}-{os.getpid()}-{arena.nonce & 0xFFFFFFFF:08x}"
    return ArenaPeer(arena, name, host=config.host,
                     export_bytes=config.window_bytes if producer else 0,
                     register_arena=consumer, tcp_port_range=config.tcp_port_range,
                     backends=config.backends)  # fmt: skip


class RemoteProducer:
    """Announces a finished request's READY items: copies them into the peer's export
    window, where they stay until the consumer's notification or the lease's end.

    :meth:`step` runs on every scheduler step and, while leases are held, on a
    small thread every ``tick_s`` (an idle engine does not step, and its leases
    must still end).
    """

    def __init__(
        self,
        peer: ArenaPeer,
        catalog: SharedCatalog,
        config: NixlConfig,
        counts: Counter,
        *,
        layout: str,
        tick_s: float | None = 0.1,
    ) -> None:
        self.peer, self.catalog, self.config, self._counts = peer, catalog, config, counts
        self.layout = layout
        self._metadata = peer.metadata()  # the same for every request: computed once
        self._leases: dict[str, tuple[list[list[Extent]], float]] = {}  # notify -> (slots, expiry)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if tick_s is not None:
            self._thread = threading.Thread(target=self._tick, args=(tick_s,),
                                            name="ecoffload-leases", daemon=True)  # fmt: skip
            self._thread.start()

    def _tick(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            if self._leases:
                try:
                    self.step()
                except Exception:  # never let the thread die silently
                    log.exception("ecoffload: releasing leases failed")

    def announce(self, request: Request) -> dict[str, Any] | None:
        """``ec_transfer_params`` for ``request``'s READY items (copied into the export
        window now), or None."""
        window = self.peer.export_window()
        items: dict[str, AnnouncedItem] = {}
        slots: list[list[Extent]] = []
        host = self.peer.arena.host_tensor().numpy()
        block = self.peer.arena.block_bytes
        for feature in request.mm_features or ():
            key = feature.identifier
            if key in items:
                continue
            try:
                entry = self.catalog.pin(key)  # READY only: never a WRITING item's bytes
            except CatalogError:
                continue  # absent, still being written or evicted: the consumer encodes it
            try:
                with self._lock:
                    slot = window.put(host, entry.extents, block, entry.nbytes)
            finally:
                self.catalog.unpin(key)
            if slot is None:
                self._counts["remote_items_not_announced_window_full"] += 1
                continue
            slots.append(slot)
            crc = entry.checksum
            if crc is None:
                crc = item_crc32(window.data, slot, window.block_bytes, entry.nbytes)
            items[key] = AnnouncedItem(tuple((int(s), int(c)) for s, c in slot), entry.nbytes,
                                       entry.dtype, tuple(entry.shape), crc)  # fmt: skip
        if not items:
            return None
        with self._lock:
            self._seq += 1
            # unguessable: a holder of one request's params cannot end another's lease
            notify = f"ecoffload:{self._seq}:{secrets.token_hex(8)}:{request.request_id}"
            self._leases[notify] = (slots, time.monotonic() + self.config.lease_s)
        self._counts["remote_items_announced"] += len(items)
        expires_at = time.time() + self.config.lease_s
        params = TransferParams(self.layout, self._metadata, self.config.lease_s, expires_at,
                                notify, items)  # fmt: skip
        return params.to_json()

    @property
    def leases(self) -> int:
        return len(self._leases)

    def step(self) -> None:
        """Free the window slots of leases consumers have read (their notification) or
        that expired."""
        with self._lock:
            if self.peer.closed:
                return
            for _, message in self.peer.notifications():
                lease = self._leases.pop(message.decode(errors="replace"), None)
                if lease is not None:
                    self._release(lease[0])
            now = time.monotonic()
            for notify in [n for n, (_, expiry) in self._leases.items() if expiry <= now]:
                self._release(self._leases.pop(notify)[0])
                self._counts["remote_leases_expired"] += 1

    def _release(self, slots: list[list[Extent]]) -> None:
        for slot in slots:
            self.peer.export_window().release(slot)

    def close(self) -> None:
        """Stop the thread, end every lease (close before the peer)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if not self.peer.closed:
                for slots, _ in self._leases.values():
                    self._release(slots)
            self._leases.clear()


@dataclass(eq=False)
class _Pull:
    """One request's read: "reading" -> "done" | "failed"."""

    request_id: str
    peer: str
    notify: bytes
    expires_at: float
    items: dict[str, AnnouncedItem]
    state: str = "reading"
    handle: PullHandle | None = None
    reserved: dict[str, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)
    fallback: set[str] = field(default_factory=set)  # keys the request must encode itself
    why: str = ""
    orphan: bool = False  # the request finished while its pull ran


class RemoteConsumer:
    """Holds requests whose announced items are not local until one NIXL read each
    brought them into the local arena; falls back to local encoding otherwise."""

    def __init__(
        self,
        peer: ArenaPeer,
        catalog: SharedCatalog,
        config: NixlConfig,
        counts: Counter,
        *,
        layout: str,
    ) -> None:
        self.peer, self.catalog, self.config, self._counts = peer, catalog, config, counts
        self.layout = layout
        self._pulls: dict[str, _Pull] = {}  # request id -> its pull
        self._pulling: dict[str, str] = {}  # key -> request id whose pull reserved it
        self._broken: set[str] = set()  # peers to forget once none of their reads is unsettled
        self._unsettled: list[tuple[PullHandle, dict[str, tuple[int, Any]]]] = []
        self._unavailable: set[str] = set()

    def admit(self, request: Request, num_computed_tokens: int) -> bool:
        """``ensure_cache_available``: False while the request's pull is under way."""
        rid = request.request_id
        pull = self._pulls.get(rid)
        if pull is not None:
            if pull.state == "reading":
                return False
            del self._pulls[rid]
            return self._resolve(request, pull.fallback, pull.why)
        params = getattr(request, "ec_transfer_params", None)
        if not params:
            return True
        try:
            announced = TransferParams.parse(params, self.layout)
        except ValueError as exc:
            self._counts["remote_params_refused"] += 1
            keys = {f.identifier for f in request.mm_features}
            return self._resolve(request, keys, str(exc))
        items, notify = announced.items, announced.notify
        want: dict[str, AnnouncedItem] = {}
        refused: set[str] = set()
        for index, feature in enumerate(request.mm_features):
            key, pos = feature.identifier, feature.mm_position
            if key not in items or pos.offset + pos.length <= num_computed_tokens:
                continue
            rows = request.get_num_encoder_embeds(index)
            if not items[key].shape or items[key].shape[0] != rows:
                refused.add(key)  # not this request's item: encode it
                continue
            if self._pulling.get(key, rid) != rid:
                return False  # another request's pull brings it: wait for that one
            if self.catalog.state(key) is None:
                want[key] = items[key]
        if refused:
            self._counts["remote_params_refused"] += 1
        try:
            name = self.peer.connect(announced.peer)  # local work: no round trip
        except Exception as exc:  # NIXL refusing the metadata...
            self._counts["remote_pull_failures"] += 1
            return self._resolve(request, set(want) | refused, f"cannot use the params: {exc}")
        if not want:  # nothing to pull: release the producer's lease now
            with contextlib.suppress(Exception):
                self.peer.read(name, [], notify=notify.encode())
            return self._resolve(request, refused, "announced with the wrong number of rows")
        pull = _Pull(rid, name, notify.encode(), announced.expires_at, want, fallback=refused)
        self._pulls[rid] = pull
        for key in want:
            self._pulling[key] = rid
        self._start(pull)
        return False

    def _resolve(self, request: Request, fallback: set[str], why: str) -> bool:
        """The request's announcement is settled: admit it, its ``fallback`` items to be
        encoded locally, or (some lacks its input) report it unavailable."""
        request.ec_transfer_params = None
        if not fallback:
            return True
        missing = [
            f.identifier for f in request.mm_features
            if f.identifier in fallback and f.data is None
            and self.catalog.state(f.identifier) is not ItemState.READY
        ]  # fmt: skip
        if missing:
            log.error("ecoffload: request %s cannot obtain %s (%s) and carries no input to "
                      "encode them: vLLM aborts it", request.request_id, missing, why)  # fmt: skip
            self._unavailable.add(request.request_id)
            return False
        log.warning("ecoffload: request %s encodes %d item(s) locally: %s",
                    request.request_id, len(fallback), why)  # fmt: skip
        self._counts["remote_fallbacks"] += 1
        return True

    def _start(self, pull: _Pull) -> None:
        """Reserve local blocks for the pull's items and post its one read."""
        left = min(self.config.timeout_s, pull.expires_at - CLOCK_SKEW_S - time.time())
        if left <= 0:
            return self._fail(pull, "the producer's lease ended before the pull could start")
        pulls = []
        for key, item in pull.items.items():
            try:
                entry = self.catalog.reserve(key, item.nbytes, item.dtype, item.shape)
            except CatalogError:  # saved or pulled meanwhile, or a key this catalog cannot hold
                entry = None
            if entry is None:
                self._counts["remote_pulls_skipped_no_room"] += 1
                pull.fallback.add(key)
                self._pulling.pop(key, None)
                continue
            extents = [(int(s), int(c)) for s, c in entry.extents]
            pull.reserved[key] = (entry.generation, extents)
            pulls.append(Pull(item.extents, extents, item.nbytes))
        try:
            pull.handle = self.peer.read(pull.peer, pulls, notify=pull.notify, timeout_s=left)
        except Exception as exc:  # bad announced extents, peer forgotten meanwhile
            return self._fail(pull, f"read refused: {exc}")
        pull.state = "reading"

    def step(self) -> None:
        """Once per scheduler step: advance reads, settle abandoned ones."""
        for pull in [p for p in self._pulls.values() if p.state == "reading"]:
            handle = pull.handle
            assert handle is not None, "a pull reads once its read is posted"
            state = self.peer.poll(handle)
            if state == "done":
                self._finish(pull)
            elif state == "error":
                self._broken.add(pull.peer)
                self._fail(pull, f"pull from {pull.peer} failed: {handle.error}")
        still = []
        for handle, reserved in self._unsettled:
            self.peer.poll(handle)
            if handle.settled:
                self._abort(reserved)
            else:
                still.append((handle, reserved))
        self._unsettled = still
        for name in list(self._broken):
            active = [p for p in self._pulls.values() if p.state == "reading"]
            if not any(h.peer == name for h, _ in self._unsettled) and not any(
                p.peer == name for p in active
            ):
                self._broken.discard(name)
                with contextlib.suppress(Exception):
                    self.peer.disconnect(name)  # reconnect on the next announcement
        for rid, pull in list(self._pulls.items()):
            if pull.orphan and pull.state in ("done", "failed"):
                del self._pulls[rid]

    def _finish(self, pull: _Pull) -> None:
        """The read completed: publish each item whose bytes match the producer's CRC."""
        host = self.peer.arena.host.numpy()
        block = self.peer.arena.block_bytes
        for key, (generation, extents) in pull.reserved.items():
            item = pull.items[key]
            self._pulling.pop(key, None)
            crc = item_crc32(host, extents, block, item.nbytes)
            if item.crc32 is not None and crc != item.crc32:
                log.warning("ecoffload: pulled %s fails its CRC-32 (the producer's copy changed "
                            "mid-read?): encoding it locally", key)  # fmt: skip
                self._abort({key: (generation, extents)})
                pull.fallback.add(key)
                self._counts["remote_pull_failures"] += 1
                continue
            try:
                self.catalog.commit(key, crc, generation=generation, dtype=item.dtype,
                                    shape=item.shape)  # fmt: skip
            except CatalogError as exc:
                log.warning("ecoffload: not publishing pulled %s: %s", key, exc)
                pull.fallback.add(key)
                continue
            self._counts["remote_items_pulled"] += 1
            self._counts["remote_bytes_pulled"] += item.nbytes
        pull.reserved = {}
        pull.state = "done"

    def _fail(self, pull: _Pull, why: str) -> None:
        self._counts["remote_pull_failures"] += 1
        log.warning("ecoffload: request %s: %s", pull.request_id, why)
        for key in pull.items:
            if self._pulling.get(key) == pull.request_id:
                del self._pulling[key]
        if pull.reserved:
            if pull.handle is None or pull.handle.settled:
                self._abort(pull.reserved)
            else:  # NIXL may still write into these blocks: keep them until it settles
                self._unsettled.append((pull.handle, pull.reserved))
        pull.fallback |= set(pull.items)
        pull.reserved, pull.why, pull.state = {}, why, "failed"

    def _abort(self, reserved: Mapping[str, tuple[int, Any]]) -> None:
        for key, (generation, _) in reserved.items():
            with contextlib.suppress(CatalogError):  # gone, or reserved again
                self.catalog.abort(key, generation=generation)

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted): its pull, if any, runs to its end alone."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return
        if pull.state in ("done", "failed"):
            del self._pulls[request_id]
        else:
            pull.orphan = True
        self._unavailable.discard(request_id)

    def take_unavailable(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    @property
    def busy(self) -> bool:
        """Pulls reading, or abandoned reads not settled yet."""
        return bool(self._unsettled) or any(p.state == "reading" for p in self._pulls.values())

    def close(self, timeout_s: float = 2.0) -> None:
        """Give up every pull; wait (bounded) for NIXL to let go of their blocks."""
        for pull in list(self._pulls.values()):
            if pull.state == "reading":
                if pull.handle is not None:
                    self.peer.release(pull.handle)
                self._fail(pull, "shutting down")
        deadline = time.monotonic() + timeout_s
        while self._unsettled and time.monotonic() < deadline:
            self.step()
            time.sleep(0.01)
        self._pulls.clear()
