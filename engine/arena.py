"""The arena: one shared-memory file of fixed-size blocks, mapped by every process.

Life cycle::

    creator                                   other processes
    -------                                   ---------------
    open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600)
    ftruncate, mmap(MAP_SHARED), pre-fault
    write header fields, then the magic       attach(): wait (bounded) for a valid
                                              header, check every field, count itself
    ... name unlinked when `processes` processes have attached, or at the
        creator's close: a crash can leave no file behind once all have mapped it ...

File layout: a header of ``HEADER_BYTES`` (magic, format version, block size,
block count, data offset, creator pid, process counts, layout key), then the
data area of ``num_blocks * block_bytes`` bytes, page aligned.

With CUDA (and CuPy), the data area is registered with the driver
(Portable | Mapped) and :attr:`Arena.device` is a CUDA tensor aliasing it;
without, :attr:`Arena.device` is None and only :attr:`Arena.host` exists.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch

from .errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaExistsError,
    ArenaLayoutMismatch,
    ArenaStaleError,
)

log = logging.getLogger(__name__)

MAGIC = b"ECOFFLD\x01"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
DEFAULT_DIR = "/dev/shm"


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


_HEADER = struct.Struct("<8sIIQQQqQQIIIqQ")
_KEY_OFFSET = 128
MAX_LAYOUT_KEY_BYTES = HEADER_BYTES - _KEY_OFFSET
_ATTACHED_OFFSET = struct.calcsize("<8sIIQQQqQQI")
_OWNER_OFFSET = struct.calcsize("<8sIIQQQqQQIIIq") - 8
_OWNER = struct.Struct("<qQ")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_POPULATE_CHUNK = 1 << 30
_PARALLEL_POPULATE_BYTES = 4 << 30

RegisterMode = Literal["auto", "always", "never"]


class _AnyLayout:
    def __repr__(self) -> str:
        return "ANY_LAYOUT"


#: ``Arena.attach(..., layout_key=ANY_LAYOUT)``: map the arena whatever its layout key
#: (tools that inspect any arena). Without it, a missing key only matches an arena
#: made without one: a keyed arena is refused.
ANY_LAYOUT = _AnyLayout()
LayoutKey = str | Mapping[str, object]


def layout_key_text(layout_key: str | Mapping[str, object]) -> str:
    """Canonical text of a layout key (a mapping becomes sorted JSON)."""
    if isinstance(layout_key, Mapping):
        return json.dumps(dict(layout_key), sort_keys=True, separators=(",", ":"), default=str)
    return str(layout_key)


def check_arena_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise ArenaError(
            f"arena name {name!r} is not allowed: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, with no '/' and no '..'"
        )
    return name


class Arena:
    """A shared, pre-faulted, optionally CUDA-registered block arena.

    Use :meth:`create`, :meth:`attach` or :meth:`create_or_attach`; close with
    :meth:`close` (idempotent) or a ``with`` block.

    Attributes:
        host: uint8 CPU tensor over the data area, ``(num_blocks * block_bytes,)``.
        device: uint8 CUDA tensor aliasing the same bytes, or None without CUDA.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, *, created: bool) -> None:
        self.path, self.created = path, created
        self._fd, self._mm = fd, mm
        self._unlinked = False
        header = Header(*_HEADER.unpack_from(mm))
        self.block_bytes, self.num_blocks = header.block_bytes, header.num_blocks
        self.nonce = header.nonce
        self.layout_key = bytes(mm[_KEY_OFFSET : _KEY_OFFSET + header.key_len]).decode()
        self.nbytes = header.block_bytes * header.num_blocks
        self.host: torch.Tensor | None = torch.frombuffer(
            mm, dtype=torch.uint8, count=self.nbytes, offset=header.data_offset
        )
        self.device: torch.Tensor | None = None
        self._registration = None

    @classmethod
    def create(
        cls,
        name: str,
        *,
        block_bytes: int,
        num_blocks: int,
        layout_key: str | Mapping[str, object] = "",
        directory: str = DEFAULT_DIR,
        processes: int = 0,
        register_cuda: RegisterMode = "auto",
        populate_threads: int | None = None,
    ) -> Arena:
        """Create a new arena file; fails if one exists at that path.

        Args:
            processes: how many processes will map the arena, this one included;
                the name is unlinked once that many have. 0: unlink at close.
            register_cuda: "auto" registers when CUDA and CuPy are available,
                "always" fails without them, "never" keeps the arena host-only.
            populate_threads: threads that pre-fault pages (default: 1 below
                4 GiB, else up to 8).
        """
        check_arena_name(name)
        if layout_key is ANY_LAYOUT:
            raise ArenaError("ANY_LAYOUT is for attach: give create the arena's real layout key")
        key = layout_key_text(layout_key).encode()
        if len(key) > MAX_LAYOUT_KEY_BYTES:
            raise ArenaError(
                f"layout key is {len(key)} bytes, at most {MAX_LAYOUT_KEY_BYTES} fit the header"
            )
        if block_bytes <= 0 or block_bytes % mmap.PAGESIZE:
            raise ArenaError(
                f"block_bytes must be a positive multiple of the page size ({mmap.PAGESIZE}), "
                f"got {block_bytes}"
            )
        if num_blocks <= 0:
            raise ArenaError(f"num_blocks must be positive, got {num_blocks}")
        if processes < 0:
            raise ArenaError(f"processes must be >= 0, got {processes}")
        path = os.path.join(directory, name)
        data_offset = HEADER_BYTES
        total = data_offset + block_bytes * num_blocks
        _check_free_space(directory, total)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise ArenaExistsError(
                f"{path} already exists: attach to it, pick another arena name, or remove "
                "the file if no process uses it"
            ) from None
        mm = None
        try:
            os.fchmod(fd, 0o600)  # the umask may only narrow it; be explicit anyway
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # Who is creating it goes first, so an attacher can tell a creator that
            # died mid-way from one still pre-faulting; the magic goes last.
            header = Header(
                b"\0" * 8, FORMAT_VERSION, HEADER_BYTES, block_bytes, num_blocks, data_offset,
                os.getpid(), process_start_time(os.getpid()) or 0,
                int.from_bytes(os.urandom(8), "little"), processes, 1, len(key), 0, 0,
            )  # fmt: skip
            _HEADER.pack_into(mm, 0, *header)
            _populate(mm, data_offset, total, populate_threads, path)
            mm[_KEY_OFFSET : _KEY_OFFSET + len(key)] = key
            mm[0:8] = MAGIC  # last: attachers treat the header as valid from here on
            arena = cls(path, fd, mm, created=True)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(path)
            raise
        if processes == 1:
            arena._unlink()
        arena._register(register_cuda)
        log.info("created arena %s: %d blocks of %d bytes", path, num_blocks, block_bytes)
        return arena

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        block_bytes: int | None = None,
        num_blocks: int | None = None,
        layout_key: LayoutKey | _AnyLayout | None = "",
        directory: str = DEFAULT_DIR,
        timeout_s: float = 30.0,
        register_cuda: RegisterMode = "auto",
    ) -> Arena:
        """Map an arena another process created, waiting up to ``timeout_s`` for it.

        Every expectation given (block size, block count) is checked against the
        header, and the layout key always is: no key (``""`` or None) expects an
        arena made without one, so a keyed arena is refused; pass
        :data:`ANY_LAYOUT` to accept any. A mismatch raises
        :class:`ArenaLayoutMismatch`.
        """
        check_arena_name(name)
        path = os.path.join(directory, name)
        deadline = time.monotonic() + timeout_s
        fd, mm = _wait_for_header(path, deadline, timeout_s)
        try:
            _check_header(path, mm, block_bytes, num_blocks, layout_key, os.fstat(fd).st_size)
            arena = cls(path, fd, mm, created=False)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        arena._count_attach()
        arena._register(register_cuda)
        log.info("attached arena %s", path)
        return arena

    @classmethod
    def create_or_attach(cls, name: str, **kwargs) -> Arena:
        """Create the arena, or attach if another process created it first.

        A file left by a creator that died before every process attached
        (its pid and start time no longer match a live process) is reclaimed:
        its name is removed (only if it still names that very file) and a new
        arena is created. ``layout_key`` is written if this call creates the
        file and checked if it attaches (:data:`ANY_LAYOUT`: create without a
        key, attach to any).
        """
        create_only = ("processes", "populate_threads")
        attach_only = ("timeout_s",)
        create_kwargs = {k: v for k, v in kwargs.items() if k not in attach_only}
        if create_kwargs.get("layout_key") is ANY_LAYOUT:
            create_kwargs["layout_key"] = ""
        for _ in range(3):
            try:
                return cls.create(name, **create_kwargs)
            except ArenaExistsError:
                pass
            try:
                return cls.attach(name, **{k: v for k, v in kwargs.items() if k not in create_only})
            except ArenaStaleError as stale:
                log.warning("%s; reclaiming it", stale)
                _unlink_if_inode(stale.path, stale.inode)
        raise ArenaError(f"could not create or attach {name!r}: it keeps changing under us")

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def registered(self) -> bool:
        """True when the data area is registered with CUDA and :attr:`device` is set."""
        return self._registration is not None

    def close(self) -> None:
        """Unregister, drop every view, unmap, and unlink the name if this process created it.

        Idempotent. Tensors the caller still holds on :attr:`host` keep the
        mapping alive until they are freed (no BufferError, no dangling host
        pointer); CUDA aliases become invalid at once.
        """
        if self._mm is None:
            return
        if self.created:
            self._unlink()
        self.device = None
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self.host = None
        mm, self._mm = self._mm, None
        # torch.frombuffer keeps a reference to the mmap, not a buffer export, so
        # mm.close() would unmap under a tensor the caller still holds. Unmap now
        # only if nothing else references it; otherwise the last tensor unmaps it.
        if sys.getrefcount(mm) <= 2:
            mm.close()
        else:
            log.warning(
                "arena %s: tensors created from it are still alive; the mapping is released "
                "when they are freed",
                self.path,
            )
        os.close(self._fd)

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("cuda" if self.registered else "host")
        return (
            f"Arena({self.path!r}, {self.num_blocks} x {self.block_bytes} B, "
            f"{state}, {'creator' if self.created else 'attached'})"
        )

    def device_view(self, device: torch.device) -> torch.Tensor:
        """The CUDA alias of the data area on ``device`` (the arena must be registered)."""
        if self._registration is None:
            raise ArenaError(f"arena {self.path} is not registered with CUDA: no device view")
        if self.device is not None and self.device.device == torch.device(device):
            return self.device
        return self._registration.device_alias(device)

    def attached_processes(self) -> int:
        """How many processes have mapped the arena so far (creator included)."""
        return struct.unpack_from("<I", self._mm, _ATTACHED_OFFSET)[0]

    def claim_ownership(self) -> None:
        """Record this process as the arena's one catalog owner, or refuse.

        Blocks are handed out by a catalog; two catalogs over one arena would
        give the same blocks to different items. The first live claimant
        (vLLM's scheduler) owns the arena; another process claiming it while the
        owner lives gets an ArenaError.
        """
        me = (os.getpid(), process_start_time(os.getpid()) or 0)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            owner = _OWNER.unpack_from(self._mm, _OWNER_OFFSET)
            if owner[0] and owner != me and _alive(*owner):
                raise ArenaError(
                    f"arena {self.path} already has a catalog owner (process {owner[0]}): "
                    "every serving instance, and every data-parallel rank, needs its own "
                    "arena_name"
                )
            _OWNER.pack_into(self._mm, _OWNER_OFFSET, *me)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _count_attach(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # read-modify-write across processes
        try:
            (expected,) = struct.unpack_from("<I", self._mm, _ATTACHED_OFFSET - 4)
            attached = min(self.attached_processes() + 1, 0xFFFFFFFF)  # a counter, saturated
            struct.pack_into("<I", self._mm, _ATTACHED_OFFSET, attached)
            if expected and attached >= expected:
                self._unlink()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _unlink(self) -> None:
        """Remove the name, but only if it still names this very file."""
        if not self._unlinked:
            self._unlinked = True
            _unlink_if_inode(self.path, os.fstat(self._fd).st_ino)

    def _register(self, mode: RegisterMode) -> None:
        if mode == "never":
            return
        if not torch.cuda.is_available():
            if mode == "always":
                raise ArenaError("register_cuda='always' but CUDA is not available")
            return
        from .cuda_host import HostRegistration

        try:
            self._registration = HostRegistration(self.host.data_ptr(), self.nbytes)
            self.device = self._registration.device_alias(
                torch.device("cuda", torch.cuda.current_device())
            )
        except Exception as exc:
            self._registration = None
            if mode == "always":
                raise ArenaError(f"CUDA host registration of {self.path} failed: {exc}") from exc
            log.warning(
                "arena %s: CUDA host registration failed (%s); transfers fall back to "
                "unregistered copies. Install ecoffload[cuda12] or [cuda13] for CuPy.",
                self.path,
                exc,
            )


def _check_free_space(directory: str, total: int) -> None:
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


def _populate(mm: mmap.mmap, start: int, end: int, threads: int | None, path: str) -> None:
    """Pre-fault [start, end) so the first transfer pays no page faults."""
    buf = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(buf)
    del buf  # release the buffer export at once, or mm.close() would fail
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    chunks = [(o, min(_POPULATE_CHUNK, end - o)) for o in range(start, end, _POPULATE_CHUNK)]
    if threads is None:
        threads = 1 if end - start < _PARALLEL_POPULATE_BYTES else min(8, os.cpu_count() or 1)
    done, lock, failures = [0], threading.Lock(), []
    t0 = time.monotonic()

    def work(mine: list[tuple[int, int]]) -> None:
        for offset, size in mine:
            # ctypes drops the GIL during the call, so threads fault pages in parallel.
            if madvise(base + offset, size, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EINVAL, errno.ENOSYS):
                    failures.append(OSError(err, f"pre-faulting {path}: {os.strerror(err)}"))
                    return
                mm[offset : offset + size : mmap.PAGESIZE] = bytes(-(-size // mmap.PAGESIZE))
            with lock:
                done[0] += size
                if len(chunks) > 4:
                    log.info(
                        "pre-faulted %d of %d MiB of %s", done[0] >> 20, (end - start) >> 20, path
                    )

    workers = [threading.Thread(target=work, args=(chunks[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if failures:
        raise ArenaError(f"{failures[0]}; is there enough free memory for the arena?")
    log.debug("pre-faulted %s in %.2f s with %d thread(s)", path, time.monotonic() - t0, threads)


def _wait_for_header(path: str, deadline: float, timeout_s: float) -> tuple[int, mmap.mmap]:
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
                _check_owner(path, st)
                if st.st_size >= HEADER_BYTES:
                    mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED)
                    header = Header(*_HEADER.unpack_from(mm))
                    if header.magic not in (MAGIC, b"\0" * 8):
                        mm.close()
                        raise ArenaLayoutMismatch(path, "magic", MAGIC, header.magic)
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


def _check_owner(path: str, st: os.stat_result) -> None:
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


def _check_header(
    path: str,
    mm: mmap.mmap,
    block_bytes: int | None,
    num_blocks: int | None,
    layout_key: LayoutKey | _AnyLayout | None,
    file_size: int,
) -> None:
    h = Header(*_HEADER.unpack_from(mm))
    checks = [
        ("format_version", FORMAT_VERSION, h.version),
        ("header_bytes", HEADER_BYTES, h.header_bytes),
    ]
    if block_bytes is not None:
        checks.append(("block_bytes", block_bytes, h.block_bytes))
    if num_blocks is not None:
        checks.append(("num_blocks", num_blocks, h.num_blocks))
    if layout_key is not ANY_LAYOUT:
        found_key = bytes(mm[_KEY_OFFSET : _KEY_OFFSET + min(h.key_len, MAX_LAYOUT_KEY_BYTES)])
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


def process_start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    return int(stat_line.rsplit(b")", 1)[1].split()[19])  # field 22: starttime


def creator_alive(header: Header) -> bool:
    """Whether the process that created the arena still runs (pid reuse excluded)."""
    return _alive(header.creator_pid, header.creator_start)


def _alive(pid: int, start_ticks: int) -> bool:
    start = process_start_time(pid)
    return start is not None and (not start_ticks or start == start_ticks)


def _unlink_if_inode(path: str, inode: int) -> None:
    """Remove ``path`` only if it still names the file ``inode`` (never a replacement)."""
    try:
        if os.stat(path, follow_symlinks=False).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
