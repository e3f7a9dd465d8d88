"""The cluster tier over one arena: look items up in Mooncake Store, fetch them into
reserved arena blocks, publish the arena's items.

Protocol (every method runs in the thread that owns the catalog, e.g. vLLM's
scheduler; Mooncake calls run on :class:`~.store.StoreClient`'s lanes)::

    sizes = tier.lookup(local_misses)      one batched existence query (and, for
                                           the hits only, one batched size query)
    f = tier.fetch(sizes, expected)        reserve blocks per item; one batched get
                                           scattering each value's header into a
                                           small buffer and its bytes straight
                                           into the item's extents (a value whose
                                           size or rows are not the ones the
                                           requester expects is not fetched /
                                           not committed)
    tier.poll(f) once per step:            "pending" | "done" | "error"
        "done": each item whose header and MAC check out is committed (dtype and
        shape from its header): f.fetched; the others are aborted: f.failed
        "error" (past fetch_timeout_s): every item in f.failed; its blocks stay
        reserved until the get returns (it could still write into them)
    tier.publish(keys)                     after a local commit: pins each READY
                                           key and queues it (a full queue drops
                                           it, counted); the publisher thread
                                           skips keys the store already holds and
                                           puts the others from their extents
    tier.step() once per step              unpins what the publisher finished,
                                           polls every fetch still pending (its
                                           requests may have gone), releases
                                           settled abandoned fetches

Names: ``ecoffload/<namespace>/<item key>``; the namespace is the layout key's
hash (model, dtype), so other models never meet. Values: :mod:`.value`.

Why the arena is not registered with the store client: a registered buffer is
published in the client's segment descriptor and Mooncake's TCP transport
writes any peer's bytes into it, unauthenticated (tests/engine/cluster/test_cluster_tier.py
shows a stranger doing so). Over TCP a get lands in unregistered memory and a
put reads from it, so ecoffload registers nothing: the values' MAC is checked
on the arena's own copy, which nobody else can write.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import math
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..base.errors import CatalogError, ClusterError
from ..base.items import dtype_from_name
from . import value
from .store import OBJECT_NOT_FOUND, StoreClient

log = logging.getLogger("ecoffload.cluster")

FetchState = Literal["pending", "done", "error"]
COUNTERS = (
    "cluster_lookups",
    "cluster_hits",
    "cluster_misses",
    "cluster_items_fetched",
    "cluster_bytes_fetched",
    "cluster_fetch_failures",
    "cluster_publishes",
    "cluster_publish_skipped",
    "cluster_publish_drops",
    "cluster_publish_failures",
    "cluster_mac_failures",
)


@dataclass(eq=False)
class ClusterFetch:
    """One posted batched get. ``fetched``: keys committed; ``failed``: keys to encode."""

    deadline: float
    reserved: dict[str, tuple[int, list[tuple[int, int]], int]] = field(default_factory=dict)
    state: FetchState = "pending"
    fetched: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    future: cf.Future | None = field(default=None, repr=False)
    headers: Any = field(default=None, repr=False)
    rows: dict[str, int] = field(default_factory=dict)  # reserved key -> its expected rows
    times: dict[str, float] = field(default_factory=dict)  # monotonic: posted, got, checked


@dataclass(frozen=True)
class Expected:
    """What the requester knows of an item before fetching it: its rows (vLLM's
    encoder embeds: the value's first dimension) and, where it knows the bytes per
    row, its size. Checked because the store's sizes and the values' headers are
    anyone's to write: a forged size would make the reservation evict the arena's
    items before the MAC refuses the bytes, and a wrong shape would reach vLLM's
    step as an item it cannot use."""

    rows: int
    nbytes: int | None = None


def _pieces(base: int, extents: Iterable[tuple[int, int]], block: int, nbytes: int):
    """(address, size) of each extent of an item, the last cut at ``nbytes``."""
    left = nbytes
    for start, count in extents:
        if left <= 0:
            break
        take = min(count * block, left)
        yield base + start * block, take
        left -= take


class ClusterTier:
    """Mooncake Store behind one arena and its catalog (see the module docstring)."""

    def __init__(
        self,
        arena: Any,
        catalog: Any,
        client: StoreClient,
        *,
        namespace: str,
        key: bytes | None = None,
        fetch_timeout_s: float = 5.0,
        lookup_timeout_s: float = 1.0,
        publish: bool = True,
        queue_items: int = 256,
    ) -> None:
        self.arena, self.catalog, self.client = arena, catalog, client
        self.namespace = namespace
        self._key = key
        self.fetch_timeout_s = fetch_timeout_s
        self.lookup_timeout_s = min(lookup_timeout_s, fetch_timeout_s)
        self.publishing = publish
        self._data = arena.host.numpy()
        self._base = int(arena.host.data_ptr())
        self._block = arena.block_bytes
        self.counts: collections.Counter = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self._unsettled: list[ClusterFetch] = []
        self._posted: list[ClusterFetch] = []  # fetches posted, not yet polled to an end
        self._queue: collections.deque = collections.deque()
        self._queue_items = queue_items
        self._to_unpin: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self._publisher = threading.Thread(
            target=self._publish_loop, name="ecoffload-cluster-publisher", daemon=True
        )
        if publish:
            self._publisher.start()

    @property
    def available(self) -> bool:
        return self.client.available

    def store_key(self, key: str) -> str:
        return f"ecoffload/{self.namespace}/{key}"

    def _view(self, extents: Sequence[tuple[int, int]], nbytes: int) -> list[memoryview]:
        mv = memoryview(self._data).cast("B")
        return [mv[a - self._base : a - self._base + n]
                for a, n in _pieces(self._base, extents, self._block, nbytes)]  # fmt: skip

    # lookup -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> dict[str, int]:
        """``{key: item bytes}`` of those of ``keys`` the store holds now: one batched
        existence query, plus one size query for the hits. Empty when unavailable."""
        if not keys:
            return {}
        self.counts["cluster_lookups"] += 1
        names = [self.store_key(k) for k in keys]
        got = self.client.call("lookup", lambda s: _exist_and_sizes(s, names),
                               self.lookup_timeout_s)  # fmt: skip
        if got is None:
            self.counts["cluster_misses"] += len(keys)
            return {}
        codes, sizes = got
        self.client.note_codes(codes)
        out = {}
        for key, name in zip(keys, names, strict=True):
            size = sizes.get(name)
            if size is not None and size >= value.HEADER_BYTES:
                out[key] = size - value.HEADER_BYTES
        self.counts["cluster_hits"] += len(out)
        self.counts["cluster_misses"] += len(keys) - len(out)
        return out

    # fetch --------------------------------------------------------------------------

    def fetch(
        self, sizes: Mapping[str, int], expected: Mapping[str, Expected] | None = None
    ) -> ClusterFetch:
        """Reserve blocks for each item and post one batched get into them. An item of
        ``expected`` is fetched only if its stored size is the expected one (where
        known) and committed only if its header's rows are."""
        f = ClusterFetch(deadline=time.monotonic() + self.fetch_timeout_s)
        expected = expected or {}
        for key, nbytes in sizes.items():
            want = expected.get(key)
            if want is not None and want.nbytes is not None and nbytes != want.nbytes:
                self.counts["cluster_fetch_failures"] += 1
                log.warning(
                    "ecoffload: cluster value of %s holds %d bytes, its request expects %d "
                    "(%d rows): not fetched, encoded locally (a value not made by this "
                    "model's instances: forged, or another build's)", key, nbytes,
                    want.nbytes, want.rows,
                )  # fmt: skip
                f.failed.add(key)
                continue
            try:
                entry = self.catalog.reserve(key, nbytes, "uint8", (nbytes,))
            except CatalogError:  # saved or fetched meanwhile, or a size it cannot hold
                entry = None
            if entry is None:
                f.failed.add(key)
                continue
            extents = [(int(s), int(c)) for s, c in entry.extents]
            f.reserved[key] = (entry.generation, extents, nbytes)
        if not f.reserved:
            f.state = "done"
            return f
        f.headers = np.zeros((len(f.reserved), value.HEADER_BYTES), np.uint8)
        names, ptrs, lens = [], [], []
        for i, (key, (_, extents, nbytes)) in enumerate(f.reserved.items()):
            pieces = list(_pieces(self._base, extents, self._block, nbytes))
            names.append(self.store_key(key))
            ptrs.append([int(f.headers[i].ctypes.data)] + [a for a, _ in pieces])
            lens.append([value.HEADER_BYTES] + [n for _, n in pieces])
        views = {k: self._view(e, n) for k, (_, e, n) in f.reserved.items()}
        f.rows = {k: expected[k].rows for k in f.reserved if k in expected}
        f.times["posted"] = time.monotonic()
        f.future = self.client.submit(
            "fetch",
            lambda s: self._get_and_check(s, names, ptrs, lens, f.headers, views, f.rows, f.times),
        )
        if f.future is None:
            self._abort(f.reserved)
            self.counts["cluster_fetch_failures"] += len(f.reserved)  # items, as everywhere
            f.failed |= set(f.reserved)
            f.reserved = {}
            f.state = "error"
        else:
            self._posted.append(f)
        return f

    def _get_and_check(self, store, names, ptrs, lens, headers, views, rows, times) -> list:
        """Fetch lane: the batched get, then each value's header (its rows against
        ``rows``), MAC and CRC-32."""
        times["started"] = time.monotonic()
        codes = store.batch_get_into_multi_buffers(names, ptrs, lens)
        times["got"] = time.monotonic()
        out = []
        prefix = len(self.store_key(""))
        for i, (name, code) in enumerate(zip(names, codes, strict=True)):
            key = name[prefix:]
            want = sum(lens[i])
            if code != want:
                out.append((code, None, None))
                continue
            raw = headers[i].tobytes()
            parts = views[key]
            try:
                header = value.parse_header(raw)
                ok = value.verify(raw, self._key, name, parts)
            except ClusterError:
                header, ok = None, False
            if not ok or header is None:
                out.append(("mac", header, None))
                continue
            if (
                header.nbytes != want - value.HEADER_BYTES
                or not _fits(header)
                or (key in rows and header.shape[:1] != (rows[key],))
            ):
                out.append(("header", header, None))
                continue
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            out.append((code, header, crc))
        times["checked"] = time.monotonic()
        return out

    def poll(self, f: ClusterFetch) -> FetchState:
        """Advance a fetch (never blocks): commit what arrived intact once the get returned."""
        if f.state != "pending":
            return f.state
        assert f.future is not None, "a pending fetch is posted with its future"
        if not f.future.done():
            if time.monotonic() < f.deadline:
                return "pending"
            self.client.timed_out()
            self.counts["cluster_fetch_failures"] += len(f.reserved)
            log.warning("ecoffload: a cluster fetch of %d item(s) passed its %.1f s bound: "
                        "encoding them locally", len(f.reserved), self.fetch_timeout_s)  # fmt: skip
            f.failed |= set(f.reserved)
            f.state = "error"
            self._unsettled.append(f)  # its get may still write into the blocks
            return f.state
        try:
            results = f.future.result()
        except Exception as exc:
            log.warning("ecoffload: cluster fetch failed: %r", exc)
            results = [("error", None, None)] * len(f.reserved)
        self._settle(f, results)
        f.times["committed"] = time.monotonic()
        f.state = "done"
        return f.state

    def _settle(self, f: ClusterFetch, results: list) -> None:
        codes = [r[0] for r in results if isinstance(r[0], int)]
        if codes:
            self.client.note_codes(codes)
        for (key, (generation, _, nbytes)), (code, header, crc) in zip(
            f.reserved.items(), results, strict=True
        ):
            if crc is None:
                if code == "mac":
                    self.counts["cluster_mac_failures"] += 1
                    log.warning(
                        "ecoffload: cluster value of %s fails its MAC check (this instance %s): "
                        "not served, encoded locally; if every value fails, give every "
                        "instance the same cluster.key_file", key,
                        "accepts only values sealed with its cluster key" if self._key
                        else "has no cluster key: it refuses sealed values and unparsable ones",
                    )  # fmt: skip
                elif code != OBJECT_NOT_FOUND:  # evicted since the lookup: a plain miss
                    self.counts["cluster_fetch_failures"] += 1
                    if code == "header":
                        log.warning(
                            "ecoffload: cluster value of %s: its header says %s %s (%d bytes); "
                            "%d bytes were stored and its request expects %s rows: not "
                            "served, encoded locally", key, header.dtype, header.shape,
                            header.nbytes, nbytes, f.rows.get(key, "any"),
                        )  # fmt: skip
                self._abort({key: (generation, None, nbytes)})
                f.failed.add(key)
                continue
            try:
                self.catalog.commit(key, crc, generation=generation, dtype=header.dtype,
                                    shape=header.shape)  # fmt: skip
            except CatalogError as exc:
                log.warning("ecoffload: not publishing fetched %s: %s", key, exc)
                f.failed.add(key)
                continue
            f.fetched.add(key)
            self.counts["cluster_items_fetched"] += 1
            self.counts["cluster_bytes_fetched"] += nbytes
        f.reserved = {}

    def _abort(self, reserved: Mapping[str, tuple]) -> None:
        for key, (generation, *_) in reserved.items():
            with contextlib.suppress(CatalogError):  # gone, or reserved again
                self.catalog.abort(key, generation=generation)

    # publish ------------------------------------------------------------------------

    def publish(self, keys: Iterable[str]) -> None:
        """Queue READY items for publishing (pinned until put); a full queue drops."""
        if not self.publishing:
            return
        for key in keys:
            if len(self._queue) >= self._queue_items:
                self.counts["cluster_publish_drops"] += 1
                continue
            try:
                entry = self.catalog.pin(key)
            except CatalogError:  # evicted, or not READY
                continue
            self._queue.append(entry)
        with self._wake:
            self._wake.notify()

    def _publish_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
            batch = []
            while self._queue and len(batch) < 64:
                batch.append(self._queue.popleft())
            try:
                self._publish_batch(batch)
            except Exception as exc:  # never let the thread die: count and go on
                log.warning("ecoffload: cluster publish failed: %r", exc)
                self.counts["cluster_publish_failures"] += len(batch)
            finally:
                self._to_unpin.extend(e.key for e in batch)

    def _publish_batch(self, batch: list) -> None:
        names = [self.store_key(e.key) for e in batch]
        codes = self.client.call("publish", lambda s: s.batch_is_exist(names),
                                 self.fetch_timeout_s)  # fmt: skip
        if codes is None:
            self.counts["cluster_publish_failures"] += len(batch)
            return
        self.client.note_codes(codes)
        todo = [(e, n) for e, n, c in zip(batch, names, codes, strict=True) if c == 0]
        self.counts["cluster_publish_skipped"] += sum(1 for c in codes if c == 1)
        self.counts["cluster_publish_failures"] += sum(1 for c in codes if c < 0)
        if not todo:
            return
        headers, ptrs, lens = [], [], []
        for e, name in todo:
            extents = [(int(s), int(c)) for s, c in e.extents]
            header = value.pack_header(e.nbytes, e.dtype, tuple(e.shape))
            value.seal(header, self._key, name, self._view(extents, e.nbytes))
            hb = np.frombuffer(header, np.uint8)
            headers.append(hb)
            pieces = list(_pieces(self._base, extents, self._block, e.nbytes))
            ptrs.append([int(hb.ctypes.data)] + [a for a, _ in pieces])
            lens.append([value.HEADER_BYTES] + [n for _, n in pieces])
        put = [n for _, n in todo]
        codes = self.client.call(
            "publish", lambda s: s.batch_put_from_multi_buffers(put, ptrs, lens),
            self.fetch_timeout_s,
        )  # fmt: skip
        if codes is None:
            self.counts["cluster_publish_failures"] += len(todo)
            self._wait_put()  # past its bound, it may still read the headers and blocks
            return
        self.client.note_codes(codes)
        self.counts["cluster_publishes"] += sum(1 for c in codes if c == 0)
        self.counts["cluster_publish_failures"] += sum(1 for c in codes if c != 0)
        del headers  # kept alive until the put returned

    def _wait_put(self) -> None:
        """Publisher thread: wait until the publish lane's last call returned (until
        close), so its items stay pinned and its header buffers alive while it reads."""
        future = self.client.running("publish")
        while future is not None and not future.done() and not self._stop:
            with contextlib.suppress(cf.TimeoutError):
                future.exception(timeout=0.1)

    # every step ---------------------------------------------------------------------

    def step(self) -> None:
        """Unpin what the publisher finished; release abandoned fetches once settled;
        while the store is unavailable, ask it (in the background) whether it is back."""
        if not self._stop:
            self.client.probe()
        if self._to_unpin:  # (each test first: most steps have nothing to do here)
            done = []
            while self._to_unpin:
                done.append(self._to_unpin.popleft())
            with contextlib.suppress(CatalogError):
                self.catalog.unpin_many(done)
        if self._posted:  # each fetch is polled to its end, whether or not anyone waits
            self._posted = [f for f in self._posted if self.poll(f) == "pending"]
        if self._unsettled:
            still = []
            for f in self._unsettled:
                if f.future is None or f.future.done():  # nothing of it can still write
                    self._abort(f.reserved)
                    f.reserved = {}
                else:
                    still.append(f)
            self._unsettled = still

    def idle(self) -> bool:
        """True when nothing is queued, being published or waiting to be unpinned."""
        return not self._queue and not self._to_unpin and not self._publishing_now()

    def _publishing_now(self) -> bool:
        future = self.client._inflight.get("publish")
        return future is not None and not future.done()

    def stats(self) -> dict[str, int]:
        out = dict(self.counts)
        out["cluster_available"] = int(self.client.available)
        return out

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop publishing (queued items are dropped, unpinned), wait for fetches still
        running (bounded), release their blocks, close the client."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._publisher.is_alive():
            self._publisher.join(timeout_s)
        while self._queue:
            self._to_unpin.append(self._queue.popleft().key)
        for f in self._posted:  # never polled to its end (its requests went): release it
            if f.state == "pending":
                f.failed |= set(f.reserved)
                f.state = "error"
                self._unsettled.append(f)
        self._posted = []
        deadline = time.monotonic() + timeout_s
        for f in self._unsettled:
            with contextlib.suppress(Exception):
                if f.future is not None:
                    f.future.result(timeout=max(0.0, deadline - time.monotonic()))
        # The client first: its close waits (bounded) for calls still running, so a put
        # past its bound stops reading the blocks before step() unpins them.
        self.client.close(max(0.0, deadline - time.monotonic()))
        self.step()


def _exist_and_sizes(store, names: list[str]) -> tuple[list[int], dict[str, int]]:
    """Lookup lane: existence of every name; the stored size of those that exist."""
    codes = store.batch_is_exist(names)
    hits = [n for n, c in zip(names, codes, strict=True) if c == 1]
    sizes = {}
    if hits:
        for name, replicas in store.batch_get_replica_desc(hits).items():
            for r in replicas:
                if r.is_memory_replica() and r.status.name == "COMPLETE":
                    sizes[name] = int(r.get_memory_descriptor().buffer_descriptor.size)
                    break
    return codes, sizes


def _fits(header: value.Header) -> bool:
    """The header's dtype and shape describe exactly its nbytes."""
    try:
        itemsize = dtype_from_name(header.dtype).itemsize
    except ValueError:
        return False
    return math.prod(header.shape) * itemsize == header.nbytes
