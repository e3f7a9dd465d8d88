"""The bytes of one item in the store: a fixed header, then the item's bytes.

::

    0    magic "ECOCLST\\x01"
    8    flags u32 (bit 0: the MAC below is set), ndim u32
    16   nbytes u64: the item's bytes after the header
    24   dtype name, 16 bytes ASCII, NUL padded ("bfloat16")
    40   shape: 8 x i64 (the first ndim used)
    104  MAC: 32 bytes (zero without a cluster key)
    136  zero up to HEADER_BYTES
    HEADER_BYTES  the item's bytes, nbytes of them

The MAC is HMAC-SHA256 over the header (its MAC field zeroed), the
store key and the item's bytes: a value is bound to its name, so a valid value
copied under another key fails too. A reader holding a cluster key serves only
values whose MAC verifies; one without a key serves only values without one.

Plain Python (no torch): it reads and writes buffers the caller hands it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..base.errors import ClusterError

MAGIC = b"ECOCLST\x01"
HEADER_BYTES = 160
MAX_DIMS = 8
MAC_BYTES = 32
_HEAD = struct.Struct(f"<8sIIQ16s{MAX_DIMS}q{MAC_BYTES}s")
_MAC_AT = _HEAD.size - MAC_BYTES
_FLAG_MAC = 1
_MIN_KEY_BYTES = 16


@dataclass(frozen=True)
class Header:
    """What a value's header says about the item after it."""

    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    mac: bytes | None = None


def load_key(path: str) -> bytes:
    """The cluster key in ``path`` (at least 16 bytes after stripping white space,
    e.g. ``openssl rand -hex 32 > key``), as the 32-byte MAC key derived from it."""
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError as exc:
        raise ClusterError(
            f"cluster key file {path!r} cannot be read ({exc.strerror}): give the path of a "
            "file holding a secret every instance of the cluster shares"
        ) from None
    if len(raw) < _MIN_KEY_BYTES:
        raise ClusterError(
            f"cluster key file {path!r} holds {len(raw)} bytes, at least {_MIN_KEY_BYTES} are "
            "needed: write a random secret into it, e.g. `openssl rand -hex 32 > FILE`"
        )
    return hashlib.blake2b(raw, digest_size=32, person=b"ecoffload-key").digest()


def key_file_exposure(path: str) -> str | None:
    """Why ``path`` exposes the cluster key to other local users (readable or writable
    by its group or by others), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (
        f"cluster key file {path!r} has mode {mode & 0o777:o}: other local users can read "
        "or replace the key and forge values every instance serves; `chmod 600` it"
    )


def pack_header(nbytes: int, dtype: str, shape: Sequence[int]) -> bytearray:
    """A header without its MAC (see :func:`seal`)."""
    name = dtype.encode("ascii")
    if len(name) > 16 or len(shape) > MAX_DIMS:
        raise ClusterError(
            f"an item of dtype {dtype!r} and shape {tuple(shape)} does not fit the value "
            f"header (a dtype name of at most 16 characters, at most {MAX_DIMS} dimensions)"
        )
    dims = [int(d) for d in shape] + [0] * (MAX_DIMS - len(shape))
    out = bytearray(HEADER_BYTES)
    _HEAD.pack_into(out, 0, MAGIC, 0, len(shape), nbytes, name, *dims, bytes(MAC_BYTES))
    return out


def _mac(key: bytes, header: bytes | bytearray, store_key: str, parts: Iterable) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)  # faster than keyed BLAKE2b here (SHA-NI)
    zeroed = bytearray(header)
    zeroed[_MAC_AT : _MAC_AT + MAC_BYTES] = bytes(MAC_BYTES)
    h.update(zeroed)
    h.update(store_key.encode())
    for part in parts:
        h.update(part)  # hashlib releases the GIL on large buffers
    return h.digest()


def seal(header: bytearray, key: bytes | None, store_key: str, parts: Iterable) -> None:
    """Set ``header``'s MAC over it, ``store_key`` and the item's byte ``parts`` (in
    order), or leave it unset without a key."""
    if key is None:
        return
    struct.pack_into("<I", header, 8, _FLAG_MAC)
    header[_MAC_AT : _MAC_AT + MAC_BYTES] = _mac(key, header, store_key, parts)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """The header at the start of ``raw``; ClusterError when it is not one."""
    raw = bytes(raw[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES or not raw.startswith(MAGIC):
        raise ClusterError(f"not an ecoffload value: it starts {raw[:8]!r}, expected {MAGIC!r}")
    _, flags, ndim, nbytes, name, *rest = _HEAD.unpack_from(raw)
    dims, mac = rest[:MAX_DIMS], rest[MAX_DIMS]
    if ndim > MAX_DIMS or any(d < 0 for d in dims):
        raise ClusterError(f"value header has {ndim} dimensions {dims}: corrupt")
    try:
        dtype = name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ClusterError(f"value header's dtype {name!r} is not ASCII: corrupt") from None
    return Header(nbytes, dtype, tuple(dims[:ndim]), mac if flags & _FLAG_MAC else None)


def verify(raw_header: bytes, key: bytes | None, store_key: str, parts: Iterable) -> bool:
    """True when the value's MAC state matches ``key``: with a key, its MAC verifies
    over the header, ``store_key`` and ``parts``; without one, it carries no MAC."""
    header = parse_header(raw_header)
    if key is None:
        return header.mac is None
    if header.mac is None:
        return False
    return hmac.compare_digest(_mac(key, raw_header[:HEADER_BYTES], store_key, parts), header.mac)


def random_key_file(path: str) -> str:
    """Write a fresh random cluster key to ``path`` (mode 600); returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path
