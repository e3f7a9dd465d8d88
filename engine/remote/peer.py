"""Pulling items between hosts' arenas with NIXL: one agent per arena, one READ per request.

Roles and protocol (the vLLM connector splits them between its producer and
consumer instances)::

    producer (holds the items)                 consumer (wants them)
    --------------------------                 ---------------------
    peer = ArenaPeer(arena, name,              peer = ArenaPeer(arena, name)
                     export_bytes=...,
                     register_arena=False)
    slot = peer.window.put(arena bytes of
           an item): a copy of it, leased
    publish peer.metadata() + each slot's      connect(metadata)        (local: no round trip)
      extents, nbytes, dtype, shape            reserve local blocks in its catalog
                                               h = read(name, [Pull(slot, local, nbytes), ...],
                                                        notify=b"...")  (one NIXL READ)
                                               poll(h) once per step: "pending" | "done" | "error"
                                               "done": verify, commit the reservations
                                               "error": abort them once h.settled
    notifications(): (consumer, b"...")
      -> window.release(slot) (or when the lease expires: a consumer may never read)

Doors (see README "Security"): no NIXL listener ever runs, so nothing answers a
metadata request; a producer's metadata reaches consumers only inside the
params its coordinator forwards. What a peer registers with NIXL:

* a producer: its :class:`~ecoffload.engine.remote.export_window.ExportWindow` only
  (anonymous memory holding copies of the items it announced, zeroed when their
  leases end); :meth:`metadata` describes that registration alone.
* a consumer: its arena's data area, as the local end of its READs. Its
  metadata is never published (it cannot be: :meth:`metadata` without a window
  raises), so no remote agent can name that memory.

UCX, NIXL's transport, still listens (its SysV shared-memory transport is off:
its 0660 segments would be open to the process's group): a TCP socket bound to the address of
``host``'s interface only (UCX's ``NET_DEVICES`` is that interface plus the
host's RDMA ports, which open no TCP port; an operator's own
``UCX_NET_DEVICES`` wins; ``host="*"``: every interface), on a port the OS
picks (``tcp_port_range`` narrows it).

Addresses: a remote item is named by block extents ``(start, count)`` in the
remote window; the byte address is ``card.base + start * card.block_bytes``
(:class:`PeerCard`: name, base, block size, block count of the window). An item
is the first ``nbytes`` of the concatenation of its extents, on each side; the
two sides may use different block sizes and cut the item into different
extents: :meth:`read` walks both lists and emits one descriptor pair per piece
that is contiguous on both sides (only ``nbytes`` move).

Completion: :meth:`poll` never blocks. A transfer ends "done", or "error" when
NIXL reports a failure (the remote died or disconnected: NIXL raises, this
module answers "error") or when its deadline (``timeout_s`` of :meth:`read`)
passes. Abandoning a transfer that is still in flight does not stop it
(measured with UCX over TCP: bytes keep landing after the request is released
and the remote removed), so a handle says whether it is ``settled``: True once
NIXL no longer has the transfer active, i.e. nothing more can be written into
the local blocks. Reuse the local blocks of an "error" handle only once it is
settled; :meth:`poll` keeps checking an abandoned transfer until it is.

Memory: DRAM only here. On a GPU host with RDMA NICs the same registration
serves the NICs (UCX registers, i.e. pins, the region with each NIC: for a
large arena that is a one-time cost at start-up, and tmpfs pages get
allocated by it); not measured on such hardware yet.

NIXL is an optional dependency (``pip install ecoffload[nixl]``); importing
this module works without it, creating a peer raises
:class:`NixlNotInstalledError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base.errors import RemoteExtentError, RemotePeerError
from ..catalog.allocator import Extent
from .export_window import ExportWindow
from .extent_pieces import pieces as _pieces
from .nixl_setup import interface_of, load_nixl, net_devices, outward_ip, rdma_ports
from .records import (
    PeerCard,
    Pull,
    PullHandle,
    TransferState,
    check_extents,
    pack_metadata,
    split_metadata,
)


class ArenaPeer:
    """A NIXL agent over one :class:`~ecoffload.engine.arena.arena.Arena`: it reads items
    from remote peers' export windows into its arena, and (``export_bytes`` > 0)
    exposes its own export window to them. It never listens for metadata.

    Args:
        arena: an open arena; it must outlive the peer (close the peer first).
        name: the NIXL agent name, unique among connected peers (include something
            that changes when the process restarts, e.g. the arena nonce).
        host: this host's address on the network other hosts reach; UCX uses only
            the interface that has it (default: the outward interface). "*": every
            interface (UCX's own default).
        export_bytes: size of the export window (0: none; this peer cannot be read).
        export_block_bytes: its block size (default: the arena's).
        register_arena: register the arena as the local end of reads (a peer that
            only exports passes False: then NIXL cannot touch the arena at all).
        tcp_port_range: (first, last) port for UCX's TCP listener (default: the OS picks).
        backends: NIXL backends to create.
    """

    def __init__(
        self,
        arena: Any,
        name: str,
        *,
        host: str | None = None,
        export_bytes: int = 0,
        export_block_bytes: int | None = None,
        register_arena: bool = True,
        tcp_port_range: tuple[int, int] | None = None,
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        api = load_nixl()
        if arena.closed or arena.host is None:
            raise RemotePeerError(f"ArenaPeer({name!r}): {arena!r} is closed: open it first")
        self.arena, self.name = arena, name
        self._remotes: dict[str, PeerCard] = {}
        self._live: set[PullHandle] = set()  # posted and not settled
        self._read_from: set[str] = set()  # peers read from since their connect
        self._reg = self._window_reg = None
        self.window: ExportWindow | None = None
        self._agent: Any = None  # NIXL's nixl_agent once created
        self.host = host or outward_ip()
        # UCX settings, NIXL's "engine_config" (key=value, comma-separated; an operator's
        # UCX_* environment wins). No SysV shared memory: its segments are mode 0660, so
        # the process's group could attach them (posix shm and CMA stay: owner only).
        ucx = ["TLS=^sysv"]
        devices = None if self.host == "*" else ",".join([interface_of(self.host), *rdma_ports()])
        if tcp_port_range is not None:
            ucx.append(f"TCP_PORT_RANGE={tcp_port_range[0]}-{tcp_port_range[1]}")
        config = api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,  # no metadata service: nothing answers a stranger
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # callable from any thread
        )
        agent = api.nixl_agent(name, config)
        for backend in backends:
            if backend not in agent.get_plugin_list():
                raise RemotePeerError(
                    f"ArenaPeer({name!r}): NIXL has no {backend!r} backend here (plugins: "
                    f"{agent.get_plugin_list()}): pick one of those"
                )
            params = {"engine_config": ",".join(ucx)} if backend == "UCX" else {}
            try:
                with net_devices(devices if backend == "UCX" else None):
                    agent.create_backend(backend, params)
            except Exception as exc:
                raise RemotePeerError(
                    f"ArenaPeer({name!r}): NIXL could not start its {backend} backend with "
                    f"{params} ({exc!r}): check nixl.host is an address of this host"
                ) from None
        self._agent = agent
        self._backends = list(backends)
        self.base = arena.host.data_ptr()
        if register_arena:
            self._reg = self._agent.register_memory([(self.base, arena.nbytes, 0, "")], "DRAM")
        if export_bytes:
            self.window = ExportWindow(export_bytes, export_block_bytes or arena.block_bytes)
            self._window_reg = self._agent.register_memory(
                [(self.window.base, self.window.nbytes, 0, "")], "DRAM"
            )

    def export_window(self) -> ExportWindow:
        """This peer's export window (RemotePeerError without one)."""
        if self.window is None:
            raise RemotePeerError(
                f"{self.name!r} has no export window, so nothing of it can be read: create "
                "it with export_bytes > 0 to announce items"
            )
        return self.window

    def card(self) -> PeerCard:
        """The geometry of this peer's export window (raises without one)."""
        w = self.export_window()
        return PeerCard(self.name, w.base, w.block_bytes, w.num_blocks)

    def metadata(self) -> bytes:
        """Card and NIXL metadata of the export window's registration only (plus UCX's
        connection info), in one blob for :meth:`connect`. The arena's registration,
        if any, is not in it: no remote agent can name the arena."""
        card = self.card()  # RemotePeerError without a window: nothing of the arena leaves
        md = self._agent.get_partial_agent_metadata(self._window_reg, True, self._backends)
        return pack_metadata(card, md)

    @property
    def remotes(self) -> dict[str, PeerCard]:
        return dict(self._remotes)

    def connect(self, peer: bytes) -> str:
        """Make a remote peer readable from its :meth:`metadata` bytes; returns its name.
        Local work only (no network round trip: UCX connects on the first read).
        Connecting again with the same card does nothing; a changed card reconnects."""
        blob = bytes(peer) if isinstance(peer, (bytes, bytearray, memoryview)) else b""
        card, md = split_metadata(blob)
        if self._remotes.get(card.name) == card:
            return card.name
        if card.name in self._remotes:
            self.disconnect(card.name)
        try:
            got = self._agent.add_remote_agent(md)
        except Exception as exc:
            raise RemotePeerError(
                f"connect({card.name!r}): NIXL refused its metadata ({exc!r}): the remote "
                "may run another NIXL version or backend set"
            ) from None
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != card.name:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(got)
            raise RemotePeerError(
                f"connect: the metadata names agent {got!r}, its card {card.name!r}: "
                "the blob was altered or assembled by hand"
            )
        self._remotes[card.name] = card
        return card.name

    def disconnect(self, name: str) -> None:
        """Forget a remote peer; its transfers still pending end "error" (see ``settled``)."""
        if self._remotes.pop(name, None) is None:
            return
        self._read_from.discard(name)
        for h in list(self._live):
            if h.peer == name and h.state == "pending":
                h.state, h.error = "error", f"peer {name!r} was disconnected"
        with contextlib.suppress(Exception):  # already invalidated: NIXL saw the remote go
            self._agent.remove_remote_agent(name)

    def read(
        self,
        peer: str,
        pulls: Sequence[Pull | tuple],
        *,
        notify: bytes = b"",
        timeout_s: float | None = 30.0,
    ) -> PullHandle:
        """Post ONE NIXL READ of every item in ``pulls`` from ``peer`` into this arena.

        Non-blocking: follow with :meth:`poll`. The remote receives ``notify`` once
        the whole read has completed (with no bytes to move, it is sent at once).
        Past ``timeout_s`` (None: never) :meth:`poll` answers "error". Bad extents
        (outside an arena, not the item's block count, two items on one local
        block) raise :class:`RemoteExtentError`; a failure to post returns a
        handle already in "error".
        """
        card = self._remotes.get(peer)
        if card is None:
            raise RemotePeerError(
                f"read from {peer!r}: not connected (connected: {sorted(self._remotes)}): "
                "connect(card or metadata) first"
            )
        lbb, lnb = self.arena.block_bytes, self.arena.num_blocks
        rows: list[tuple[int, int, int]] = []
        taken: list[Extent] = []
        total = 0
        for i, p in enumerate(pulls):
            remote, local, nbytes = p
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise RemoteExtentError(f"pull {i}: nbytes must be an int >= 0, got {nbytes!r}")
            r = check_extents(remote, card.block_bytes, card.num_blocks, nbytes,
                               f"pull {i}, remote {peer!r}")  # fmt: skip
            loc = check_extents(local, lbb, lnb, nbytes, f"pull {i}, local")
            taken += loc
            rows += _pieces(r, card.block_bytes, loc, lbb, nbytes)
            total += nbytes
        taken.sort()
        for a, b in zip(taken, taken[1:], strict=False):
            if a.start + a.count > b.start:
                raise RemoteExtentError(
                    f"read from {peer!r}: local extents {tuple(a)} and {tuple(b)} overlap: "
                    "every item needs blocks of its own"
                )
        now = time.monotonic()
        handle = PullHandle(peer, total, len(rows), bytes(notify), now,
                            None if timeout_s is None else now + timeout_s)  # fmt: skip
        handle.first = peer not in self._read_from
        self._read_from.add(peer)
        if not rows:
            try:
                self._agent.send_notif(peer, bytes(notify))
                handle.state = "done"
            except Exception as exc:
                handle.state, handle.error = "error", f"notification failed: {exc!r}"
            handle.settled = True
            return handle
        arr = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
        zero = np.zeros(len(rows), dtype=np.uint64)
        remote_descs = np.stack([arr[:, 0] + np.uint64(card.base), arr[:, 2], zero], axis=1)
        local_descs = np.stack([arr[:, 1] + np.uint64(self.base), arr[:, 2], zero], axis=1)
        try:
            handle._xfer = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local_descs, "DRAM"),
                self._agent.get_xfer_descs(remote_descs, "DRAM"),
                peer,
                bytes(notify),
            )
            status = self._agent.transfer(handle._xfer)
        except Exception as exc:
            handle.state, handle.error = "error", f"NIXL could not post the read: {exc!r}"
            self._finish(handle)
            return handle
        self._live.add(handle)
        if status == "ERR":
            handle.state, handle.error = "error", "NIXL failed to post the read"
            self._finish(handle)
        elif status == "DONE":
            handle.state = "done"
            self._finish(handle)
        return handle

    def poll(self, handle: PullHandle) -> TransferState:
        """Non-blocking: "pending", "done" or "error" (see ``handle.error``); also
        settles an abandoned transfer once NIXL no longer has it active."""
        if handle.settled:
            return handle.state
        now = time.monotonic()
        last = handle._last_poll if handle.polls else handle.started
        handle.polls += 1
        handle.longest_gap = max(handle.longest_gap, now - last)
        handle._last_poll = now
        try:
            status = self._agent.check_xfer_state(handle._xfer)
            why = "NIXL reported the transfer failed"
        except Exception as exc:  # e.g. nixlRemoteDisconnectError: the remote went away
            status, why = "ERR", f"{type(exc).__name__}: {exc}"
        if status == "PROC":
            if handle.state == "pending" and handle.deadline is not None and now >= handle.deadline:
                limit = handle.deadline - handle.started
                first = "; the first read from this peer" if handle.first else ""
                handle.state = "error"
                handle.error = (
                    f"timed out after {limit:g} s: NIXL still had the read in progress at "
                    f"poll {handle.polls} (longest wait between polls "
                    f"{handle.longest_gap:.2f} s{first})"
                )
            return handle.state
        if handle.state == "pending":
            handle.state = "done" if status == "DONE" else "error"
            if status != "DONE":
                handle.error = why
        self._finish(handle)
        return handle.state

    def wait(self, handle: PullHandle, timeout_s: float | None = None) -> TransferState:
        """Poll until ``handle`` is not pending or ``timeout_s`` passes (then "pending").
        Bounded anyway by the read's own ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 50e-6
        while (state := self.poll(handle)) == "pending":
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
        return state

    def release(self, handle: PullHandle) -> bool:
        """Give up on ``handle`` if still pending (it ends "error") and free NIXL's
        request as soon as NIXL lets go of it. Returns ``handle.settled``: False means
        the transfer may still write into its local blocks; :meth:`poll` it later."""
        if self.poll(handle) == "pending":
            handle.state, handle.error = "error", "released while in flight"
        return handle.settled

    @property
    def unsettled(self) -> list[PullHandle]:
        """Posted transfers NIXL may still be writing (pending or abandoned)."""
        return [h for h in self._live if not h.settled]

    def _finish(self, handle: PullHandle) -> None:
        handle.settled = True
        self._live.discard(handle)
        if handle._xfer is not None:
            with contextlib.suppress(Exception):  # NIXL keeps it and frees it with the agent
                self._agent.release_xfer_handle(handle._xfer)
            handle._xfer = None

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications from remote readers: (their agent name, message), in order."""
        out = []
        for name, msgs in self._agent.get_new_notifs().items():
            name = name.decode() if isinstance(name, bytes) else str(name)
            out += [(name, bytes(m)) for m in msgs]
        return out

    @property
    def closed(self) -> bool:
        return self._agent is None

    def close(self) -> None:
        """Abandon transfers, forget remotes, deregister the arena and the window,
        destroy the agent, unmap the window.
        Idempotent; close before the arena."""
        if self._agent is None:
            return
        for h in list(self._live):
            if h.state == "pending":
                h.state, h.error = "error", "peer closed"
            self._finish(h)
        for name in list(self._remotes):
            self.disconnect(name)
        try:
            for reg in (self._reg, self._window_reg):
                if reg is not None:
                    self._agent.deregister_memory(reg)
        finally:
            self._agent = None
            if self.window is not None:
                self.window.close()

    def __enter__(self) -> ArenaPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_agent", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._remotes)} remotes"
        return f"ArenaPeer({self.name!r}, {self.arena!r}, {state})"
