"""What a NIXL pull passes around: a producer's card and the metadata blob that carries
it, one item of a read, a posted read's handle; and the checks of a pull's extents.

The card and the blob cross hosts inside a request's ``ec_transfer_params``
(connector/transfer_params.py parses them without NIXL), so they live apart from
:class:`~ecoffload.engine.remote.peer.ArenaPeer`, which needs NIXL to run.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from ..base.errors import RemoteExtentError, RemotePeerError
from ..catalog.allocator import Extent, blocks_for

TransferState = Literal["pending", "done", "error"]

_MAGIC = b"ECOFFLOAD-PEER\x01"
_LEN = struct.Struct("<I")


class Pull(NamedTuple):
    """One item of a read: its extents in the remote arena, its reserved local extents,
    and its size (the item is the first ``nbytes`` of the extents, on each side)."""

    remote: Sequence[tuple[int, int]]
    local: Sequence[tuple[int, int]]
    nbytes: int


@dataclass(frozen=True)
class PeerCard:
    """The geometry of a producer's export window, as its :meth:`ArenaPeer.metadata`
    carries it: ``base`` is the window's address in the producer's process."""

    name: str
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
                base=int(d["base"]),
                block_bytes=int(d["block_bytes"]),
                num_blocks=int(d["num_blocks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RemotePeerError(
                f"peer card {dict(d)!r} is malformed ({exc!r}): expected the keys name, base, "
                "block_bytes, num_blocks, as PeerCard.to_dict() writes them"
            ) from None
        if card.block_bytes <= 0 or card.num_blocks <= 0 or card.base <= 0:
            raise RemotePeerError(
                f"peer card {card!r}: base, block_bytes and num_blocks must be positive"
            )
        return card


@dataclass(eq=False)
class PullHandle:
    """One posted READ. ``state`` is what :meth:`ArenaPeer.poll` last answered;
    ``settled`` is True once NIXL can no longer write into the local blocks.
    ``polls`` and ``longest_gap`` (seconds between two polls, or from the post to
    the first) say, when the read timed out, whether its poller was starved or
    the transfer stood still; ``first`` marks the first read from its peer since
    connecting (UCX makes the connection then)."""

    peer: str
    nbytes: int
    descriptors: int
    notify: bytes
    started: float
    deadline: float | None
    state: TransferState = "pending"
    error: str | None = None
    settled: bool = False
    first: bool = False
    polls: int = 0
    longest_gap: float = 0.0
    _last_poll: float = field(default=0.0, repr=False)
    _xfer: Any = field(default=None, repr=False)


def split_metadata(blob: bytes) -> tuple[PeerCard, bytes]:
    """(card, NIXL metadata) of :meth:`ArenaPeer.metadata` bytes; RemotePeerError otherwise."""
    head = len(_MAGIC) + _LEN.size
    if not blob.startswith(_MAGIC) or len(blob) < head:
        raise RemotePeerError(
            f"{len(blob)} bytes that are not ArenaPeer.metadata() output (they start "
            f"{blob[:16]!r}): pass what the remote's metadata() returned"
        )
    (n,) = _LEN.unpack_from(blob, len(_MAGIC))
    try:
        card = PeerCard.from_dict(json.loads(blob[head : head + n]))
    except (ValueError, AttributeError) as exc:
        raise RemotePeerError(f"the peer metadata's card is not a JSON card ({exc})") from None
    return card, blob[head + n :]


def check_extents(
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


def pack_metadata(card: PeerCard, nixl_metadata: bytes) -> bytes:
    """The bytes :func:`split_metadata` reads back: a magic, the card as JSON, NIXL's own."""
    text = json.dumps(card.to_dict()).encode()
    return _MAGIC + _LEN.pack(len(text)) + text + nixl_metadata
