"""Pulling items between hosts' arenas with NIXL: one agent per arena, one READ per request.

Roles and protocol (the vLLM connector splits them between its producer and
consumer instances)::

    producer (holds the items)                 consumer (wants them)
    --------------------------                 ---------------------
    peer = ArenaPeer(arena, name,              peer = ArenaPeer(arena, name,
                     listen_port=0)                             listen_port=0)
    pin the items in its catalog
    publish peer.card() + each item's          connect(card)            (once per producer)
      extents, nbytes, dtype, shape            reserve local blocks in its catalog
                                               h = read(name, [Pull(remote, local, nbytes), ...],
                                                        notify=b"...")  (one NIXL READ)
                                               poll(h) once per step: "pending" | "done" | "error"
                                               "done": commit the reservations
                                               "error": abort them once h.settled
    notifications(): (consumer, b"...")
      -> unpin what was read (or unpin when a lease expires: a consumer may never read)

Addresses: each peer registers its arena's whole data area (one DRAM region,
the mapped file, at ``arena.host.data_ptr()``) with NIXL. A remote item is
named by block extents ``(start, count)`` in the remote arena; the byte
address is ``card.base + start * card.block_bytes``, so the consumer needs the
producer's :class:`PeerCard` (name, listener address, base, block size, block
count), which is small and JSON-serialisable. An item is the first ``nbytes``
of the concatenation of its extents, on each side; the two sides may use
different block sizes and cut the item into different extents: :meth:`read`
walks both lists and emits one descriptor pair per piece that is contiguous on
both sides (only ``nbytes`` move: the tail of an item's last block on either
side is neither read nor written).

Connecting: by :meth:`ArenaPeer.metadata` bytes (passed out of band; nothing
listens), or by card through NIXL's listener (the remote's ``listen_port``;
this peer must listen too, since the answer comes back to its own listener):
:meth:`connect` waits for the answer, :meth:`begin_connect` /
:meth:`connect_done` let a caller that must never block (vLLM's scheduler)
poll for it.

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
import importlib
import json
import socket
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from .allocator import Extent, blocks_for
from .errors import NixlNotInstalledError, RemoteExtentError, RemotePeerError

TransferState = Literal["pending", "done", "error"]

_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_MAGIC = b"ECOFFLOAD-PEER\x01"
_LEN = struct.Struct("<I")


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl``, else ``nixl_cu12``, else ``nixl_cu13``)."""
    tried = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            tried.append(f"{name}: {exc}")
    raise NixlNotInstalledError(
        "remote arena transfers need NIXL, which is not importable ("
        + "; ".join(tried)
        + "): install it with `pip install ecoffload[nixl]` (nixl-cu12), or the nixl "
        "package your vLLM uses"
    )


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlNotInstalledError:
        return False
    return True


class Pull(NamedTuple):
    """One item of a read: its extents in the remote arena, its reserved local extents,
    and its size (the item is the first ``nbytes`` of the extents, on each side)."""

    remote: Sequence[tuple[int, int]]
    local: Sequence[tuple[int, int]]
    nbytes: int


@dataclass(frozen=True)
class PeerCard:
    """What a consumer needs to reach a producer's arena; JSON-serialisable (``to_dict``).

    ``base`` is the address of the data area in the producer's process;
    ``host``/``port`` its NIXL listener (None when it does not listen).
    """

    name: str
    host: str | None
    port: int | None
    base: int
    block_bytes: int
    num_blocks: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerCard:
        try:
            card = cls(
                name=str(d["name"]),
                host=None if d.get("host") is None else str(d["host"]),
                port=None if d.get("port") is None else int(d["port"]),
                base=int(d["base"]),
                block_bytes=int(d["block_bytes"]),
                num_blocks=int(d["num_blocks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RemotePeerError(
                f"peer card {dict(d)!r} is malformed ({exc!r}): expected the keys name, host, "
                "port, base, block_bytes, num_blocks, as PeerCard.to_dict() writes them"
            ) from None
        if card.block_bytes <= 0 or card.num_blocks <= 0 or card.base <= 0:
            raise RemotePeerError(
                f"peer card {card!r}: base, block_bytes and num_blocks must be positive"
            )
        return card


@dataclass(eq=False)
class PullHandle:
    """One posted READ. ``state`` is what :meth:`ArenaPeer.poll` last answered;
    ``settled`` is True once NIXL can no longer write into the local blocks."""

    peer: str
    nbytes: int
    descriptors: int
    notify: bytes
    started: float
    deadline: float | None
    state: TransferState = "pending"
    error: str | None = None
    settled: bool = False
    _xfer: Any = field(default=None, repr=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _local_ip() -> str:
    """The address of the interface that routes outwards (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _check_extents(
    extents: Sequence[tuple[int, int]], block_bytes: int, num_blocks: int, nbytes: int, where: str
) -> list[Extent]:
    out = []
    for e in extents:
        start, count = (int(v) for v in e)
        if start < 0 or count <= 0 or start + count > num_blocks:
            raise RemoteExtentError(
                f"{where}: extent {tuple(e)} is outside the arena's {num_blocks} blocks or empty: "
                "give (start, count) with count >= 1 and start + count <= num_blocks"
            )
        out.append(Extent(start, count))
    need = blocks_for(nbytes, block_bytes)
    have = sum(e.count for e in out)
    if have != need:
        raise RemoteExtentError(
            f"{where}: an item of {nbytes} bytes takes {need} blocks of {block_bytes} bytes, "
            f"its extents hold {have}: pass the extents the catalog gave for this very item"
        )
    return out


def _pieces(
    remote: Sequence[tuple[int, int]],
    rbb: int,
    local: Sequence[tuple[int, int]],
    lbb: int,
    nbytes: int,
) -> Iterator[tuple[int, int, int]]:
    """(remote offset, local offset, length) of the pieces contiguous on both sides,
    covering the first ``nbytes`` of each side's extent stream (checked to hold them)."""
    ri = li = 0
    r_off = r_left = l_off = l_left = 0
    left = nbytes
    cur: list[int] | None = None  # [remote offset, local offset, length] being extended
    while left > 0:
        if r_left == 0:
            r_off, r_left = remote[ri][0] * rbb, remote[ri][1] * rbb
            ri += 1
        if l_left == 0:
            l_off, l_left = local[li][0] * lbb, local[li][1] * lbb
            li += 1
        n = min(r_left, l_left, left)
        if cur is not None and cur[0] + cur[2] == r_off and cur[1] + cur[2] == l_off:
            cur[2] += n
        else:
            if cur is not None:
                yield cur[0], cur[1], cur[2]
            cur = [r_off, l_off, n]
        left -= n
        r_off, r_left, l_off, l_left = r_off + n, r_left - n, l_off + n, l_left - n
    if cur is not None:
        yield cur[0], cur[1], cur[2]


class ArenaPeer:
    """A NIXL agent over one :class:`~ecoffload.engine.arena.Arena`: it serves its data
    area to remote peers and reads items from theirs into it.

    Args:
        arena: an open arena; it must outlive the peer (close the peer first).
        name: the NIXL agent name, unique among connected peers (include something
            that changes when the process restarts, e.g. the arena nonce).
        listen_port: None: no listener (connect only by metadata bytes); 0: a free
            port; else that port. Peers connecting by card need a listener on both sides.
        host: the address other hosts reach this one at (default: the outward interface).
        backends: NIXL backends to create.
    """

    def __init__(
        self,
        arena: Any,
        name: str,
        *,
        listen_port: int | None = None,
        host: str | None = None,
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        api = load_nixl()
        if arena.closed or arena.host is None:
            raise RemotePeerError(f"ArenaPeer({name!r}): {arena!r} is closed: open it first")
        self.arena, self.name = arena, name
        self.port = None if listen_port is None else (listen_port or _free_port())
        self.host = host or (_local_ip() if self.port is not None else None)
        config = api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=self.port is not None,
            listen_port=self.port or 0,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # callable from any thread
        )
        self._agent = api.nixl_agent(name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RemotePeerError(
                f"ArenaPeer({name!r}): NIXL has no {missing} backend here (plugins: "
                f"{self._agent.get_plugin_list()}): pick one of those"
            )
        self.base = arena.host.data_ptr()
        self._reg = self._agent.register_memory([(self.base, arena.nbytes, 0, "")], "DRAM")
        self._remotes: dict[str, PeerCard] = {}
        self._connecting: dict[str, PeerCard] = {}  # begin_connect, metadata not here yet
        self._live: set[PullHandle] = set()  # posted and not settled

    def card(self) -> PeerCard:
        """This peer's card, for consumers (``card().to_dict()`` is JSON)."""
        return PeerCard(
            self.name, self.host, self.port, self.base,
            self.arena.block_bytes, self.arena.num_blocks,
        )  # fmt: skip

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) of this peer's NIXL listener, None without one."""
        return None if self.port is None else (self.host, self.port)

    def metadata(self) -> bytes:
        """Card and NIXL agent metadata in one blob, for :meth:`connect` without a listener."""
        card = json.dumps(self.card().to_dict()).encode()
        return _MAGIC + _LEN.pack(len(card)) + card + self._agent.get_agent_metadata()

    @property
    def remotes(self) -> dict[str, PeerCard]:
        return dict(self._remotes)

    def connect(
        self, peer: bytes | PeerCard | Mapping[str, Any], *, timeout_s: float = 10.0
    ) -> str:
        """Make a remote peer readable; returns its name. ``peer``: its :meth:`metadata`
        bytes, or its card (fetched through both listeners, waiting up to ``timeout_s``).
        Connecting again with the same card does nothing; a changed card reconnects."""
        md = None
        if isinstance(peer, (bytes, bytearray, memoryview)):
            blob = bytes(peer)
            if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _LEN.size:
                raise RemotePeerError(
                    f"connect: {len(blob)} bytes that are not ArenaPeer.metadata() output "
                    f"(they start {blob[:16]!r}): pass what the remote's metadata() returned"
                )
            (n,) = _LEN.unpack_from(blob, len(_MAGIC))
            head = len(_MAGIC) + _LEN.size
            card = PeerCard.from_dict(json.loads(blob[head : head + n]))
            md = blob[head + n :]
        else:
            card = peer if isinstance(peer, PeerCard) else PeerCard.from_dict(peer)
        if self._remotes.get(card.name) == card:
            return card.name
        if card.name in self._remotes:
            self.disconnect(card.name)
        if md is not None:
            try:
                got = self._agent.add_remote_agent(md)
            except Exception as exc:
                raise RemotePeerError(
                    f"connect({card.name!r}): NIXL refused its metadata ({exc!r}): the remote "
                    "may run another NIXL version or backend set"
                ) from None
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != card.name:
                raise RemotePeerError(
                    f"connect: the metadata names agent {got!r}, its card {card.name!r}: "
                    "the blob was altered or assembled by hand"
                )
        else:
            self._fetch(card, timeout_s)
        self._remotes[card.name] = card
        return card.name

    def _check_listeners(self, card: PeerCard) -> None:
        if card.host is None or card.port is None:
            raise RemotePeerError(
                f"connect({card.name!r}): its card has no listener address: pass its "
                "metadata() bytes instead, or create it with listen_port"
            )
        if self.port is None:
            raise RemotePeerError(
                f"connect({card.name!r}) by address: NIXL answers to this peer's own listener, "
                f"and {self.name!r} has none: create it with listen_port=0 (or a port)"
            )

    def _fetch(self, card: PeerCard, timeout_s: float) -> None:
        self._check_listeners(card)
        self._agent.fetch_remote_metadata(card.name, card.host, card.port)
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while not self._agent.check_remote_metadata(card.name):
            if time.monotonic() >= deadline:
                raise RemotePeerError(
                    f"connect({card.name!r}): no metadata from {card.host}:{card.port} within "
                    f"{timeout_s} s: check the peer runs and listens there, and that this "
                    f"host's listener ({self.host}:{self.port}) is reachable from it"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def begin_connect(self, peer: PeerCard | Mapping[str, Any]) -> str:
        """Start connecting by card without waiting (a scheduler must never block);
        returns the remote's name: poll :meth:`connect_done` until True. Already
        connected with this card: nothing to do; a changed card reconnects."""
        card = peer if isinstance(peer, PeerCard) else PeerCard.from_dict(peer)
        if self._remotes.get(card.name) == card:
            return card.name
        if card.name in self._remotes:
            self.disconnect(card.name)
        if self._connecting.get(card.name) == card:
            return card.name
        self._check_listeners(card)
        self._agent.fetch_remote_metadata(card.name, card.host, card.port)
        self._connecting[card.name] = card
        return card.name

    def connect_done(self, name: str) -> bool:
        """Non-blocking: whether :meth:`begin_connect`'s remote ``name`` is readable now."""
        if name in self._remotes:
            return True
        card = self._connecting.get(name)
        if card is None:
            raise RemotePeerError(f"connect_done({name!r}): begin_connect(card) it first")
        if not self._agent.check_remote_metadata(name):
            return False
        del self._connecting[name]
        self._remotes[name] = card
        return True

    def disconnect(self, name: str) -> None:
        """Forget a remote peer; its transfers still pending end "error" (see ``settled``)."""
        self._connecting.pop(name, None)
        if self._remotes.pop(name, None) is None:
            return
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
            r = _check_extents(remote, card.block_bytes, card.num_blocks, nbytes,
                               f"pull {i}, remote {peer!r}")  # fmt: skip
            loc = _check_extents(local, lbb, lnb, nbytes, f"pull {i}, local")
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
        try:
            status = self._agent.check_xfer_state(handle._xfer)
            why = "NIXL reported the transfer failed"
        except Exception as exc:  # e.g. nixlRemoteDisconnectError: the remote went away
            status, why = "ERR", f"{type(exc).__name__}: {exc}"
        if status == "PROC":
            if (
                handle.state == "pending"
                and handle.deadline is not None
                and time.monotonic() >= handle.deadline
            ):
                limit = handle.deadline - handle.started
                handle.state, handle.error = "error", f"timed out after {limit:g} s"
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
        """Abandon transfers, forget remotes, deregister the arena, destroy the agent.
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
            self._agent.deregister_memory(self._reg)
        finally:
            self._agent = None

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
