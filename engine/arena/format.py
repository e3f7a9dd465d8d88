"""The arena file's format: its header, layout key and name rules, and the checks an
opener runs on them.

File layout: a header of ``HEADER_BYTES`` (magic, format version, block size,
block count, data offset, creator pid and start time, nonce, process counts,
key length, catalog owner, at 96 the ready prefix, at 104 the lifetime word,
at 112 and 113 two lock bytes, at 128 the layout key), then the metadata
region (a shared catalog, if any), then the data area of
``num_blocks * block_bytes`` bytes, page aligned. Little endian throughout.

Plain Python, no torch: ``connector/config.py`` imports it at vLLM's argument
parsing; every other reader and writer of the header goes through it.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import stat
import struct
import time
from collections.abc import Mapping
from typing import Literal, NamedTuple

from ..base.errors import ArenaAttachTimeout, ArenaError, ArenaLayoutMismatch, ArenaStaleError
from ..base.liveness import alive

MAGIC = b"ECOFFLD\x01"
FORMAT_VERSION = 3  # 2: the ready prefix at READY_OFFSET; 3: the lifetime word at 104
HEADER_BYTES = 4096
DEFAULT_DIR = "/dev/shm"
UNWRITTEN = b"\0" * 8  # the magic of a file whose creator has not finished it


class Header(NamedTuple):
    """The arena file's first bytes (little endian); the layout key follows at 128."""

    magic: bytes
    version: int
    header_bytes: int
    block_bytes: int
    num_blocks: int
    data_offset: int
    creator_pid: int
    creator_start: int  # the creator's start time in clock ticks: tells a reused pid apart
    nonce: int  # random per file: every process of an instance must see the same one
    processes: int  # unlink the name once this many processes have mapped the file
    attached: int
    key_len: int
    owner_pid: int  # the single catalog owner (see Arena.claim_ownership), 0 if none
    owner_start: int


HEADER = struct.Struct("<8sIIQQQqQQIIIqQ")
KEY_OFFSET = 128
MAX_LAYOUT_KEY_BYTES = HEADER_BYTES - KEY_OFFSET
PROCESSES_OFFSET = struct.calcsize("<8sIIQQQqQQ")
ATTACHED_OFFSET = struct.calcsize("<8sIIQQQqQQI")
OWNER_OFFSET = struct.calcsize("<8sIIQQQqQQIIIq") - 8
OWNER = struct.Struct("<qQ")
_COUNT = struct.Struct("<I")
READY_OFFSET = 96  # uint64 ready_bytes: the faulted prefix of the data area
_READY = struct.Struct("<Q")
LIFETIME_OFFSET = 104  # uint32: 0 (creator / `processes` lifetime) or SHARED_LIFETIME | ...
_LIFETIME = struct.Struct("<I")
SHARED_LIFETIME = 1  # made by open_shared: the name lives while any process holds it open
PERSISTENT = 2  # ... and beyond: the last holder keeps the name (warm restarts)
# Byte-range locks (Linux open-file-description locks: the kernel drops them when
# their holder dies) on header bytes that carry no data.
HOLDERS_BYTE = 112  # a read lock per process holding a shared-lifetime arena open
POPULATOR_BYTE = 113  # a write lock of the one process pre-faulting it

RegisterMode = Literal["auto", "always", "never"]
PopulateMode = Literal["background", "eager", "lazy"]
POPULATE_MODES: tuple[str, ...] = ("background", "eager", "lazy")
REGISTER_MODES: tuple[str, ...] = ("auto", "always", "never")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class _AnyLayout:
    def __repr__(self) -> str:
        return "ANY_LAYOUT"


#: ``Arena.attach(..., layout_key=ANY_LAYOUT)``: map the arena whatever its layout key
#: (tools that inspect any arena). Without it, a missing key only matches an arena
#: made without one: a keyed arena is refused.
ANY_LAYOUT = _AnyLayout()
LayoutKey = str | Mapping[str, object]


def read_header(buf) -> Header:
    """The header at the start of ``buf`` (a mapping or the file's first bytes)."""
    return Header(*HEADER.unpack_from(buf))


def read_lifetime(buf) -> int:
    """The lifetime word: 0, or SHARED_LIFETIME with PERSISTENT or not."""
    return _LIFETIME.unpack_from(buf, LIFETIME_OFFSET)[0]


def write_lifetime(buf, lifetime: int) -> None:
    _LIFETIME.pack_into(buf, LIFETIME_OFFSET, lifetime)


def read_ready(mm: mmap.mmap | bytes, nbytes: int) -> int:
    """The ready prefix in bytes, at most ``nbytes`` (a value read twice alike)."""
    while True:  # the creator may be writing it
        first = _READY.unpack_from(mm, READY_OFFSET)[0]
        if _READY.unpack_from(mm, READY_OFFSET)[0] == first:
            return min(first, nbytes)


def write_ready(mm: mmap.mmap, ready: int) -> None:
    """Publish the ready prefix (monotonic; only the populating process writes it)."""
    _READY.pack_into(mm, READY_OFFSET, ready)


def read_count(mm: mmap.mmap, offset: int) -> int:
    """A uint32 counter of the header (PROCESSES_OFFSET, ATTACHED_OFFSET)."""
    return _COUNT.unpack_from(mm, offset)[0]


def write_count(mm: mmap.mmap, offset: int, value: int) -> None:
    _COUNT.pack_into(mm, offset, value)


def layout_key_text(layout_key: str | Mapping[str, object]) -> str:
    """Canonical text of a layout key (a mapping becomes sorted JSON)."""
    if isinstance(layout_key, Mapping):
        return json.dumps(dict(layout_key), sort_keys=True, separators=(",", ":"), default=str)
    return str(layout_key)


def check_arena_name(name: str) -> str:
    """``name`` if it may name an arena file (no path tricks); ArenaError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise ArenaError(
            f"arena name {name!r} is not allowed: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, with no '/' and no '..'"
        )
    return name


def check_modes(register_cuda: str, populate: str) -> None:
    """Refuse an unknown mode before any file is made (it would silently act as "auto")."""
    if register_cuda not in REGISTER_MODES:
        raise ArenaError(
            f"register_cuda must be one of {list(REGISTER_MODES)}, got {register_cuda!r}"
        )
    if populate not in POPULATE_MODES:
        raise ArenaError(f"populate must be one of {list(POPULATE_MODES)}, got {populate!r}")


def creator_alive(header: Header) -> bool:
    """Whether the process that created the arena still runs (pid reuse excluded)."""
    return alive(header.creator_pid, header.creator_start)


def check_owner(path: str, st: os.stat_result) -> None:
    """Refuse a file that is not ours alone: another user could read or change the cache."""
    if not stat.S_ISREG(st.st_mode):
        raise ArenaError(f"{path} is not a regular file")
    if st.st_uid != os.getuid():
        raise ArenaError(
            f"{path} belongs to uid {st.st_uid}, this process runs as uid {os.getuid()}: "
            "refusing to share memory with another user"
        )
    if st.st_mode & 0o077:
        raise ArenaError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}, expected 600: other users could "
            "read or change cached data; remove the file and let ecoffload create it"
        )


def check_header(
    path: str,
    mm: mmap.mmap,
    block_bytes: int | None,
    num_blocks: int | None,
    layout_key: LayoutKey | _AnyLayout | None,
    file_size: int,
) -> None:
    """Check a written header against the opener's expectations and the file's size
    (:class:`ArenaLayoutMismatch` naming the first field that differs)."""
    h = read_header(mm)
    checks: list[tuple[str, object, object]] = [
        ("format_version", FORMAT_VERSION, h.version),
        ("header_bytes", HEADER_BYTES, h.header_bytes),
    ]
    if block_bytes is not None:
        checks.append(("block_bytes", block_bytes, h.block_bytes))
    if num_blocks is not None:
        checks.append(("num_blocks", num_blocks, h.num_blocks))
    if not isinstance(layout_key, _AnyLayout):  # ANY_LAYOUT, the one instance
        found_key = bytes(mm[KEY_OFFSET : KEY_OFFSET + min(h.key_len, MAX_LAYOUT_KEY_BYTES)])
        checks.append(
            (
                "layout_key",
                layout_key_text("" if layout_key is None else layout_key),
                found_key.decode(errors="replace"),
            )
        )
    for field_name, expected, found in checks:
        if expected != found:
            raise ArenaLayoutMismatch(path, field_name, expected, found)
    if h.block_bytes <= 0 or h.block_bytes % mmap.PAGESIZE:
        raise ArenaLayoutMismatch(
            path, "block_bytes", f"a positive multiple of {mmap.PAGESIZE}", h.block_bytes
        )
    if h.num_blocks <= 0:
        raise ArenaLayoutMismatch(path, "num_blocks", "a positive count", h.num_blocks)
    expected_size = h.data_offset + h.block_bytes * h.num_blocks
    if file_size != expected_size or h.data_offset % mmap.PAGESIZE:
        raise ArenaLayoutMismatch(path, "file_size", expected_size, file_size)


def check_free_space(directory: str, total: int) -> None:
    """Refuse an arena larger than the free space of its directory (tmpfs: memory)."""
    try:
        st = os.statvfs(directory)
    except FileNotFoundError:
        raise ArenaError(f"arena directory {directory} does not exist") from None
    free = st.f_bavail * st.f_frsize
    if total > free:
        raise ArenaError(
            f"arena needs {total} bytes but {directory} has {free} free: "
            "give the arena fewer bytes or free space there"
        )


def wait_for_header(path: str, deadline: float, timeout_s: float) -> tuple[int, mmap.mmap]:
    """Open the file and map its header once the creator has published it."""
    last = "the file does not exist"
    delay = 0.001
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ArenaError(f"{path} is a symbolic link; refusing to follow it") from None
            raise
        if fd is not None:
            try:
                st = os.fstat(fd)
                check_owner(path, st)
                if st.st_size >= HEADER_BYTES:
                    mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED)
                    header = read_header(mm)
                    if header.magic not in (MAGIC, UNWRITTEN):
                        mm.close()
                        raise ArenaLayoutMismatch(path, "magic", MAGIC, header.magic)
                    shared = read_lifetime(mm) & SHARED_LIFETIME
                    if header.magic == MAGIC and shared:
                        return fd, mm  # lives while any holder does, creator or not
                    if header.creator_pid and not creator_alive(header):
                        mm.close()
                        raise ArenaStaleError(path, st.st_ino, header.creator_pid)
                    if header.magic == MAGIC:
                        return fd, mm
                    mm.close()
                    last = "the header is not written yet"
                else:
                    last = f"the file has {st.st_size} bytes, not yet a header"
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        if time.monotonic() >= deadline:
            raise ArenaAttachTimeout(
                f"no valid arena at {path} after {timeout_s:.1f} s ({last}): start the "
                "creating process first, or raise the attach timeout"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
