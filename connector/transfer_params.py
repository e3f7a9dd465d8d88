"""The wire format of ecoffload's ``ec_transfer_params``: written by a producer, read
by a consumer, in this one module.

A producer's ``request_finished`` returns :meth:`TransferParams.to_json` (a dict
of JSON types); the coordinator (proxy) forwards it untouched in the consumer's
request body (``SamplingParams.extra_args["ec_transfer_params"]``); the consumer
reads it with :meth:`TransferParams.parse`, which refuses anything else with a
ValueError that says what is wrong::

    {"ecoffload": 2,
     "layout": "ecoffload-<hash>",    model and dtype the bytes are for (a consumer
                                      of another model refuses them)
     "peer": "<base64 of zlib>",      ArenaPeer.metadata(): the producer's export
                                      window (name, address, geometry) and NIXL's
                                      metadata of that registration (UCX address, key)
     "lease_s": 30.0,                 the items stay in the window that long at most,
     "expires_at": t,                 i.e. until t (the producer's wall clock)
     "notify": "ecoffload:<n>:<random>:<request_id>",  the consumer's READ notifies
                                      this (unguessable: ends this lease only)
     "items": {mm_hash: {"extents": [[start, count], ...],   in the export window
                         "nbytes": int, "dtype": str, "shape": [int, ...],
                         "crc32": int}}}

Trust: whoever holds these params can read the producer's export window (the
items of the leases live there) until they expire, and nothing else of it; the
consumer serves pulled bytes only if they match ``crc32``. So the params must
travel only through the channel the operator trusts (its coordinator); see
README "Security".
"""

from __future__ import annotations

import base64
import binascii
import functools
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.base.errors import RemoteError
from ..engine.remote.records import PeerCard, split_metadata

FORMAT = 2
MAX_PEER_BYTES = 64 << 10  # a peer's metadata inflates to ~600 bytes; refuse bombs


@functools.lru_cache(maxsize=8)  # a producer sends the same metadata with every request
def pack_peer(metadata: bytes) -> str:
    """``peer`` as sent: base64 of the zlib-compressed metadata (~35% smaller)."""
    return base64.b64encode(zlib.compress(metadata, 9)).decode("ascii")


def unpack_peer(text: Any) -> bytes:
    """Inverse of :func:`pack_peer`, bounded; ValueError for anything else."""
    if not isinstance(text, str):
        raise TypeError(f"peer must be a string, got {type(text).__name__}")
    try:
        inflate = zlib.decompressobj()
        metadata = inflate.decompress(base64.b64decode(text, validate=True), MAX_PEER_BYTES)
    except (binascii.Error, zlib.error) as exc:
        raise ValueError(f"peer is not base64 of zlib data ({exc})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"peer inflates past {MAX_PEER_BYTES} bytes or is cut short")
    return metadata


@dataclass(frozen=True)
class AnnouncedItem:
    """One item of a request, as announced: where it is in the producer's export
    window, and what the consumer must find there."""

    extents: tuple[tuple[int, int], ...]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {
            "extents": [[s, c] for s, c in self.extents],
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "crc32": self.crc32,
        }

    @classmethod
    def parse(cls, key: Any, d: Any) -> AnnouncedItem:
        if not isinstance(key, str) or not isinstance(d, Mapping):
            raise TypeError(f"item {key!r}: keys must be strings and items dicts")
        extents = tuple((int(s), int(c)) for s, c in d["extents"])
        nbytes, shape, crc = int(d["nbytes"]), tuple(int(x) for x in d["shape"]), int(d["crc32"])
        if nbytes <= 0 or not isinstance(d["dtype"], str) or not 0 <= crc < 1 << 32:
            raise ValueError(
                f"item {key!r}: nbytes must be positive, dtype a string, crc32 a 32-bit value"
            )
        return cls(extents, nbytes, d["dtype"], shape, crc)


@dataclass(frozen=True)
class TransferParams:
    """One request's announcement (see the module docstring for the JSON form)."""

    layout: str
    peer: bytes  # ArenaPeer.metadata() of the producer
    lease_s: float
    expires_at: float
    notify: str
    items: dict[str, AnnouncedItem]

    @property
    def card(self) -> PeerCard:
        """The producer's export window (name, address, geometry), from ``peer``."""
        return split_metadata(self.peer)[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "ecoffload": FORMAT,
            "layout": self.layout,
            "peer": pack_peer(self.peer),
            "lease_s": self.lease_s,
            "expires_at": self.expires_at,
            "notify": self.notify,
            "items": {key: item.to_json() for key, item in self.items.items()},
        }

    @classmethod
    def parse(cls, params: Any, layout: str) -> TransferParams:
        """The announcement in ``params`` (as :meth:`to_json` wrote it) if it is
        ecoffload's, of this format and made for ``layout``; ValueError otherwise."""
        if not isinstance(params, Mapping) or params.get("ecoffload") != FORMAT:
            raise ValueError(f"not ecoffload ec_transfer_params (format {FORMAT}): {params!r:.200}")
        if params.get("layout") != layout:
            raise ValueError(
                f"announced for layout {params.get('layout')!r}, this instance serves "
                f"{layout!r}: give producer and consumer the same model and dtype"
            )
        try:
            peer = unpack_peer(params["peer"])
            split_metadata(peer)  # a card we can read, or refused here
            notify, raw = params["notify"], params["items"]
            if not isinstance(notify, str) or not isinstance(raw, Mapping):
                raise TypeError("notify must be a string and items a dict")
            items = {key: AnnouncedItem.parse(key, d) for key, d in raw.items()}
            return cls(layout, peer, float(params["lease_s"]), float(params["expires_at"]),
                       notify, items)  # fmt: skip
        except (AttributeError, KeyError, TypeError, ValueError, binascii.Error,
                RemoteError) as exc:  # fmt: skip
            raise ValueError(f"malformed ecoffload ec_transfer_params ({exc})") from None
