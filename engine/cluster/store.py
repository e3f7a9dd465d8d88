"""One Mooncake Store client, connected in the background, every call bounded.

* Loading: ``mooncake.store`` (``pip install ecoffload[cluster]``); its
  libraries need ``libibverbs.so.1`` even over TCP.
* Connecting: a background thread (``ecoffload-cluster-connect``) first checks
  that the master's RPC port and the metadata server accept a TCP connection
  (``setup`` itself takes ~90 s to fail against a missing master), then calls
  ``setup``; until that succeeds the client is unavailable (:attr:`available`
  False), one warning is logged, and it retries every ``retry_s``.
* Calls: each kind of call (``lookup``, ``fetch``, ``publish``) runs on its own
  single thread, so a step never runs Mooncake code itself; :meth:`call` waits
  at most its timeout. A call still running past its timeout (a black-holed
  master) marks the client unavailable and every later call of that kind is
  refused at once (None) until it returns. A result saying the master's RPC
  failed also marks it unavailable; the next good answer marks it available
  again (Mooncake's client reconnects to a restarted master itself). While
  unavailable, calls are tried at most once per ``retry_s`` (the others are
  refused at once), so a dead master costs a step nothing.
* Its address: Mooncake's TCP transport advertises the address of the first
  active network interface it finds, not the ``host`` given to ``setup``; on a
  host with several interfaces other clients then fetch from an address that
  may not reach it (seen: a namespace host on a veth pair was told this host's
  eth0 address and every fetch failed). Before ``setup`` the client sets
  ``MC_TCP_BIND_ADDRESS`` to ``host`` (resolved to an address) unless the
  environment sets it already.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..base.errors import ClusterNotInstalledError
from .master import reachable

log = logging.getLogger("ecoffload.cluster")

# Mooncake's error codes met here (mooncake-store/include/types.h).
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
_MASTER_DOWN = range(-999, -899)  # RPC_FAIL and the other RPC errors
PROBE_NAME = "ecoffload/probe"  # asked, never written: whether the master answers


#: Mooncake's setting of the address its TCP transport listens on and advertises.
TCP_BIND_VAR = "MC_TCP_BIND_ADDRESS"
_bind_set: str | None = None  # the value this process last gave it


def tcp_bind_setting(environ: Any, protocol: str, host: str, ours: str | None = None) -> str | None:
    """The value :data:`TCP_BIND_VAR` should get for a client at ``host``, or None to
    leave it (another protocol, an operator's own setting: one other than ``ours``, the
    value this process set for an earlier client; a name that does not resolve)."""
    if protocol != "tcp" or environ.get(TCP_BIND_VAR, ours) != ours:
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def load_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``; ClusterNotInstalledError without it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ClusterNotInstalledError(
            f"the cluster tier needs Mooncake Store, which is not importable ({exc}): "
            "pip install ecoffload[cluster], and where it names libibverbs.so.1, "
            "apt-get install libibverbs1"
        ) from None
    return MooncakeDistributedStore


def store_missing() -> str | None:
    """Why the store client cannot be loaded here, or None when it can."""
    try:
        load_store_class()
    except ClusterNotInstalledError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class StoreSettings:
    """Where the master is and what this client gives the store.

    ``host``: this client's address, where other clients fetch the values in
    its segment. ``segment_bytes``: the memory it contributes to the store (the
    values published anywhere may land in it). ``local_buffer_bytes``: Mooncake's
    own transfer buffer of this client (unused by ecoffload's calls, kept small).
    """

    master: str
    metadata: str
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    segment_bytes: int = 1 << 30
    local_buffer_bytes: int = 16 << 20
    retry_s: float = 5.0


def endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or of an http URL; None for other metadata kinds."""
    if "://" in address:
        parts = urlsplit(address)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            return None
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    host, _, port = address.rpartition(":")
    return host, int(port)


class StoreClient:
    """A Mooncake Store client that never blocks its caller past a timeout."""

    def __init__(self, settings: StoreSettings, *, connect: bool = True) -> None:
        self.settings = settings
        self._cls = load_store_class()
        self._store: Any = None
        self._available = False
        self._warned = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._lanes: dict[str, cf.ThreadPoolExecutor] = {}
        self._inflight: dict[str, cf.Future] = {}
        self._next_try = 0.0
        self.connect_attempts = 0
        self.timeouts = 0
        self._thread = threading.Thread(
            target=self._connect_loop, name="ecoffload-cluster-connect", daemon=True
        )
        if connect:
            self._thread.start()

    @property
    def available(self) -> bool:
        """True while the store answers (the ``cluster_available`` gauge)."""
        return self._available

    @property
    def connected(self) -> bool:
        return self._store is not None

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._store is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._store is not None

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            why = self._connect_once()
            if why is None:
                return
            if not self._warned:
                self._warned = True
                log.warning(
                    "ecoffload: the cluster tier is unavailable (%s): serving from the arena "
                    "alone, retrying every %.0f s", why, self.settings.retry_s
                )  # fmt: skip
            self._closed.wait(self.settings.retry_s)

    def _connect_once(self) -> str | None:
        s = self.settings
        self.connect_attempts += 1
        for what, address in (("master", s.master), ("metadata server", s.metadata)):
            end = endpoint(address)
            if end is not None and not reachable(*end, timeout_s=1.0):
                return f"the {what} at {address} accepts no connection"
        global _bind_set
        bind = tcp_bind_setting(os.environ, s.protocol, s.host, _bind_set)
        if bind is not None:
            os.environ[TCP_BIND_VAR] = _bind_set = bind  # setup reads it
        store = self._cls()
        rc = store.setup(s.host, s.metadata, s.segment_bytes, s.local_buffer_bytes, s.protocol,
                         "", s.master)  # fmt: skip
        if rc != 0:
            return f"Mooncake setup against {s.master} returned {rc}"
        if self._closed.is_set():
            store.close()
            return None
        self._store = store
        self._available = True
        if self._warned:
            log.warning("ecoffload: the cluster tier is available (master %s)", s.master)
        return None

    def _lane(self, kind: str) -> cf.ThreadPoolExecutor:
        lane = self._lanes.get(kind)
        if lane is None:
            lane = cf.ThreadPoolExecutor(1, thread_name_prefix=f"ecoffload-cluster-{kind}")
            self._lanes[kind] = lane
        return lane

    def submit(self, kind: str, fn: Callable[[Any], Any]) -> cf.Future | None:
        """Run ``fn(store)`` on the ``kind`` lane; None (refused at once) when the
        client is not connected, the lane's last call is still running, or the store
        is unavailable and its next try is not due."""
        with self._lock:
            if self._store is None or self._closed.is_set():
                return None
            busy = self._inflight.get(kind)
            if busy is not None and not busy.done():
                return None
            now = time.monotonic()
            if not self._available and now < self._next_try:
                return None
            if not self._available:
                self._next_try = now + self.settings.retry_s
            store = self._store
            future = self._lane(kind).submit(fn, store)
            self._inflight[kind] = future
            return future

    def call(self, kind: str, fn: Callable[[Any], Any], timeout_s: float) -> Any:
        """``fn(store)``'s result within ``timeout_s``, else None (see :meth:`submit`)."""
        future = self.submit(kind, fn)
        if future is None:
            return None
        try:
            return future.result(timeout=timeout_s)
        except cf.TimeoutError:
            self.timed_out()
            return None
        except Exception as exc:  # a Mooncake binding error: never into the caller's step
            log.warning("ecoffload: cluster %s call failed: %r", kind, exc)
            return None

    def probe(self) -> None:
        """While connected but unavailable: one existence query in the background (at most
        once per ``retry_s``, never waited on); a good answer marks the store available.
        Nothing else asks a store marked unavailable where nothing is published (admission
        looks nothing up meanwhile), so without it such a client would never come back."""
        if self._available or self._store is None:
            return
        future = self.submit("lookup", lambda s: s.batch_is_exist([PROBE_NAME]))
        if future is not None:
            future.add_done_callback(self._probed)

    def _probed(self, future: cf.Future) -> None:
        with contextlib.suppress(Exception):  # no answer: still unavailable
            codes = future.result()
            if codes and all(c in (0, 1) for c in codes):
                self.mark(True)

    def running(self, kind: str) -> cf.Future | None:
        """The ``kind`` lane's last call while it still runs (e.g. one its caller gave
        up on after its bound), else None."""
        with self._lock:
            future = self._inflight.get(kind)
        return future if future is not None and not future.done() else None

    def timed_out(self) -> None:
        self.timeouts += 1
        self.mark(False)

    def mark(self, up: bool) -> None:
        """Record whether the store answered; logs each change."""
        if up != self._available:
            log.warning("ecoffload: the cluster tier is %s", "available" if up else "unavailable")
        self._available = up
        if not up:
            self._next_try = time.monotonic() + self.settings.retry_s

    def note_codes(self, codes: list[int]) -> None:
        """Mark availability from a batch's result codes."""
        self.mark(not any(c in _MASTER_DOWN for c in codes))

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop connecting, let running calls end (at most ``timeout_s``), close the
        store (Mooncake's close waits on a dead master ~10 s: bounded the same way)."""
        self._closed.set()
        self._available = False
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        for future in self._inflight.values():
            with contextlib.suppress(Exception):  # its own failure was counted where it ran
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        store, self._store = self._store, None
        if store is not None:
            closer = threading.Thread(target=store.close, name="ecoffload-cluster-close",
                                      daemon=True)  # fmt: skip
            closer.start()
            closer.join(max(0.0, deadline - time.monotonic()))
