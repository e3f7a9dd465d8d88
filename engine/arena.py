"""The arena: one shared-memory file of fixed-size blocks, mapped by every process.

Life cycle::

    creator                                   other processes
    -------                                   ---------------
    open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600)
    ftruncate, mmap(MAP_SHARED)
    write header fields, then the magic       attach(): wait (bounded) for a valid
    populate (see below)                      header, check every field, count itself
    ... name unlinked when `processes` processes have attached, or at the
        creator's close: a crash can leave no file behind once all have mapped it ...

File layout: a header of ``HEADER_BYTES`` (magic, format version, block size,
block count, data offset, creator pid, process counts, catalog owner, at 96 the
ready prefix, at 128 the layout key), then the data area of
``num_blocks * block_bytes`` bytes, page aligned.

Populate (pre-faulting the data area, so no transfer pays page faults), by mode:

* ``background``: the creator returns as soon as the header is written; bounded
  threads fault the data area in chunks, in order (``madvise`` releases the
  GIL), and publish the *ready prefix*: the header's ``ready_bytes`` (a
  monotonic uint64 only the creator writes) is the length of the longest fully
  faulted prefix. Any process reads it (:attr:`Arena.ready_blocks`); the
  catalog owner hands out blocks below it only. Progress is logged (percent,
  GiB/s, ETA). ``close`` stops the threads within one chunk.
* ``eager``: the same work, finished before the magic is written.
* ``lazy``: nothing is faulted; every block is ready at once and pages fault
  on first touch (tmpfs may then run out of memory mid-serving: SIGBUS).

If the creator dies mid-populate its pid no longer runs, so the file is stale
(:class:`ArenaStaleError`) and reclaimed by the next ``create_or_attach``.

Shared lifetime (:meth:`Arena.open_shared`, several instances on one host)::

    any process                                   the kernel
    -----------                                   ----------
    open: create (O_EXCL) or open by name,        one OFD read lock on header byte
      then an OFD lock on header byte 112         112 per process holding the file;
      (a joiner then checks the name still        dropped when it dies
      names its file, else starts over)
    close: non-blocking write lock on byte 112:
      granted = last holder: remove the name
      (unless persistent); then release
    janitor (non-persistent; started by the       its write lock on byte 112 is
      creator in a session of its own): waits    granted once every holder
      for a write lock on byte 112, removes      closed *or died*
      the name if it still names the file

The header's lifetime word (at 104) records the mode and ``persistent`` for
every process. The janitor makes "removed when the last holder is gone"
true even when every holder is killed (vLLM's shutdown may SIGKILL its engine
processes): nothing is left in /dev/shm. A file nobody holds anyway (the
janitor was killed too) is reclaimed (not persistent) or *warm started*
(persistent: validated while the opener holds it exclusively); a creator
that died before the magic is stale as above. One process populates at a
time (a write lock on byte 113); whoever opens the arena after its
populator died resumes from the ready prefix. Plain
``attach`` maps a shared-lifetime arena without holding it and never calls it
stale.

With CUDA (and CuPy), each process registers the data area with the driver
(Portable | Mapped) for itself, chunk by chunk as the ready prefix grows (in a
background thread; at once for ``eager``), and :meth:`Arena.device_view` is a
CUDA tensor aliasing it. :meth:`Arena.covers` says whether blocks may be
copied through the alias; others go through :attr:`Arena.host`. A chunk whose
registration fails stays host-only (one warning). Without CUDA,
:attr:`Arena.device` is None and only :attr:`Arena.host` exists.
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
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import torch

from .cuda_host import REGISTER_CHUNK_BYTES
from .errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaExistsError,
    ArenaLayoutMismatch,
    ArenaStaleError,
)

log = logging.getLogger(__name__)

MAGIC = b"ECOFFLD\x01"
FORMAT_VERSION = 3  # 2: the ready prefix at _READY_OFFSET; 3: the lifetime word at 104
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

_READY_OFFSET = 96  # uint64 ready_bytes: the faulted prefix of the data area
_READY = struct.Struct("<Q")
_LIFETIME_OFFSET = 104  # uint32: 0 (creator / `processes` lifetime) or SHARED_LIFETIME | ...
_LIFETIME = struct.Struct("<I")
SHARED_LIFETIME = 1  # made by open_shared: the name lives while any process holds it open
PERSISTENT = 2  # ... and beyond: the last holder keeps the name (warm restarts)
# Byte-range locks (Linux open-file-description locks: the kernel drops them when
# their holder dies) on header bytes that carry no data.
_HOLDERS_BYTE = 112  # a read lock per process holding a shared-lifetime arena open
_POPULATOR_BYTE = 113  # a write lock of the one process pre-faulting it
_FLOCK = struct.Struct("hhqqi4x")

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_POPULATE_CHUNK = 128 << 20  # ~0.1 s of faulting: the first blocks are ready at once
_PARALLEL_POPULATE_BYTES = 4 << 30
_PROGRESS_EVERY_S = 1.0
_REGISTER_SPAN = 1 << 30  # largest single cudaHostRegister while following the prefix

RegisterMode = Literal["auto", "always", "never"]
PopulateMode = Literal["background", "eager", "lazy"]
POPULATE_MODES: tuple[str, ...] = ("background", "eager", "lazy")
REGISTER_MODES: tuple[str, ...] = ("auto", "always", "never")


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
        self.meta_offset = HEADER_BYTES  # metadata region: [meta_offset, data offset)
        self.meta_bytes = header.data_offset - HEADER_BYTES
        self._creator = (header.creator_pid, header.creator_start)
        self.layout_key = bytes(mm[_KEY_OFFSET : _KEY_OFFSET + header.key_len]).decode()
        self.nbytes = header.block_bytes * header.num_blocks
        self._data_offset = header.data_offset
        self.lifetime = _LIFETIME.unpack_from(mm, _LIFETIME_OFFSET)[0]
        self.warm_started = False  # open_shared: this process found it held by nobody
        self._opener = os.getpid()  # a forked child shares the description, not the hold
        self.host: torch.Tensor | None = torch.frombuffer(
            mm, dtype=torch.uint8, count=self.nbytes, offset=header.data_offset
        )
        self.device: torch.Tensor | None = None
        self._registration = None
        self._registrar: _Registrar | None = None
        self._populator: _Populator | None = None

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
        populate: PopulateMode = "eager",
        populate_threads: int | None = None,
        meta_bytes: int = 0,
    ) -> Arena:
        """Create a new arena file; fails if one exists at that path.

        Args:
            processes: how many processes will map the arena, this one included;
                the name is unlinked once that many have. 0: unlink at close.
            register_cuda: "auto" registers when CUDA and CuPy are available,
                "always" fails without them, "never" keeps the arena host-only.
            populate: "background" (return once the header is written; blocks
                become ready as threads fault them), "eager" (fault everything
                first) or "lazy" (never fault; pages fault on first touch).
            populate_threads: threads that pre-fault pages (default: 1 below
                4 GiB, else up to 8).
            meta_bytes: a zeroed metadata region of this many bytes (rounded up to
                pages) between the header and the data area, for a shared
                catalog (``shared_catalog.meta_bytes``); the header's data offset
                records it, so attach finds it.
        """
        return cls._new(
            name, block_bytes=block_bytes, num_blocks=num_blocks, layout_key=layout_key,
            directory=directory, processes=processes, register_cuda=register_cuda,
            populate=populate, populate_threads=populate_threads, meta_bytes=meta_bytes,
            lifetime=0,
        )  # fmt: skip

    @classmethod
    def _new(
        cls,
        name: str,
        *,
        block_bytes: int,
        num_blocks: int,
        layout_key: str | Mapping[str, object],
        directory: str,
        processes: int,
        register_cuda: RegisterMode,
        populate: PopulateMode,
        populate_threads: int | None,
        meta_bytes: int,
        lifetime: int,
    ) -> Arena:
        check_arena_name(name)
        _check_modes(register_cuda, populate)
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
        if meta_bytes < 0:
            raise ArenaError(f"meta_bytes must be >= 0, got {meta_bytes}")
        path = os.path.join(directory, name)
        data_offset = HEADER_BYTES + -(-meta_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
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
            if lifetime:  # held until close; a joiner that opens it now waits for the header
                _ofd_lock(fd, fcntl.F_RDLCK, _HOLDERS_BYTE, wait=True)
                if populate == "background":  # whoever takes over a dead populator needs it
                    _ofd_lock(fd, fcntl.F_WRLCK, _POPULATOR_BYTE, wait=False)
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
            _LIFETIME.pack_into(mm, _LIFETIME_OFFSET, lifetime)
            populator = _Populator(mm, data_offset, total, populate_threads, path)
            if populate == "eager":
                populator.run()
            elif populate == "background":
                populator.run_first()  # ~0.1 s: some blocks are ready when attachers look
            if populate == "lazy":
                _READY.pack_into(mm, _READY_OFFSET, total - data_offset)
            mm[_KEY_OFFSET : _KEY_OFFSET + len(key)] = key
            mm[0:8] = MAGIC  # last: attachers treat the header as valid from here on
            arena = cls(path, fd, mm, created=True)
            if populate == "background":
                arena._populator = populator
                populator.start()
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(path)
            raise
        if processes == 1:
            arena._unlink()
        if lifetime and not lifetime & PERSISTENT:
            _start_janitor(path, os.fstat(fd).st_ino)
        try:
            arena._register(register_cuda, populate)
        except BaseException:
            arena.close()  # stops the populate threads and removes the file
            raise
        log.info(
            "created arena %s: %d blocks of %d bytes, populate %s",
            path, num_blocks, block_bytes, populate,
        )  # fmt: skip
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
        populate: PopulateMode = "eager",
    ) -> Arena:
        """Map an arena another process created, waiting up to ``timeout_s`` for it.

        Every expectation given (block size, block count) is checked against the
        header, and the layout key always is: no key (``""`` or None) expects an
        arena made without one, so a keyed arena is refused; pass
        :data:`ANY_LAYOUT` to accept any. A mismatch raises
        :class:`ArenaLayoutMismatch`. ``populate`` "eager" registers with CUDA
        before returning (waiting for the creator's populate); otherwise
        registration follows the ready prefix in the background.
        """
        check_arena_name(name)
        _check_modes(register_cuda, populate)
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
        arena._register(register_cuda, populate)
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
        create_only = ("processes", "populate_threads", "meta_bytes")
        attach_only = ("timeout_s",)  # populate goes to both
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

    @classmethod
    def open_shared(
        cls,
        name: str,
        *,
        block_bytes: int,
        num_blocks: int | None = None,
        layout_key: str | Mapping[str, object] = "",
        directory: str = DEFAULT_DIR,
        register_cuda: RegisterMode = "auto",
        populate: PopulateMode = "eager",
        populate_threads: int | None = None,
        meta_bytes: int = 0,
        persistent: bool = False,
        timeout_s: float = 30.0,
        on_warm_start: Callable[[Arena], object] | None = None,
    ) -> Arena:
        """Create or join a *shared-lifetime* arena: one cache for several instances.

        Its name lives while any process holds it open (creator or not), so an
        instance may come and go while others keep the cache. Every process that
        opens it holds an OFD read lock on a header byte until :meth:`close` (or
        its death: the kernel drops it); the last one to close removes the name,
        unless ``persistent``. A joiner that finds the name removed under it, or
        a file nobody holds, starts over:

        * magic not written and its creator dead (died mid-creation or mid eager
          populate): stale, reclaimed (name removed, a new arena created);
        * written, nobody holds it, not persistent: every holder crashed; the
          leftover is reclaimed (warning) and a new arena created;
        * written, nobody holds it, persistent: a *warm start*: the header is
          checked, then ``on_warm_start(arena)`` runs while this process still
          holds the arena exclusively (no other process can finish opening it):
          validate the catalog there (:meth:`SharedCatalog.verify`).
          :attr:`warm_started` is then True.

        A populate whose process died is resumed by the next opener (see
        :meth:`resume_populate`).

        Args:
            num_blocks: the size if this call creates the file. None only joins
                (waits up to ``timeout_s`` for a creator); a joiner accepts the
                existing size whatever it asks (logged at info if it differs).
            block_bytes, layout_key: must match an existing file
                (:class:`ArenaLayoutMismatch` naming both values).
            meta_bytes: the metadata region if this call creates the file.
            persistent: recorded in the header at creation; a joiner asking
                otherwise gets an :class:`ArenaError` (every instance must agree).
            timeout_s: how long to wait for a creator to publish the header.

        Processes that fork after opening share its hold with their parent
        (one open file description): open it after the fork instead.
        """
        check_arena_name(name)
        _check_modes(register_cuda, populate)
        if layout_key is ANY_LAYOUT:
            raise ArenaError("open_shared needs the arena's real layout key, not ANY_LAYOUT")
        if num_blocks is not None and num_blocks <= 0:
            raise ArenaError(f"num_blocks must be positive or None (join only), got {num_blocks}")
        path = os.path.join(directory, name)
        lifetime = SHARED_LIFETIME | (PERSISTENT if persistent else 0)
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            if num_blocks is not None:
                try:
                    return cls._new(
                        name, block_bytes=block_bytes, num_blocks=num_blocks,
                        layout_key=layout_key, directory=directory, processes=0,
                        register_cuda=register_cuda, populate=populate,
                        populate_threads=populate_threads, meta_bytes=meta_bytes,
                        lifetime=lifetime,
                    )  # fmt: skip
                except ArenaExistsError:
                    pass
            arena, last = cls._join_shared(
                path, block_bytes, num_blocks, layout_key, lifetime, register_cuda, populate,
                populate_threads, on_warm_start,
            )  # fmt: skip
            if arena is not None:
                return arena
            if time.monotonic() >= deadline:
                raise ArenaAttachTimeout(
                    f"no valid shared arena at {path} after {timeout_s:.1f} s ({last}): "
                    "give num_blocks so this process may create it, start the creating "
                    "process first, or raise the timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @classmethod
    def _join_shared(
        cls, path, block_bytes, num_blocks, layout_key, lifetime, register_cuda, populate,
        populate_threads, on_warm_start,
    ) -> tuple[Arena | None, str]:  # fmt: skip
        """One try at joining the file at ``path``: the arena, or None and why not."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None, "the file does not exist"
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ArenaError(f"{path} is a symbolic link; refusing to follow it") from None
            raise
        mm = arena = None
        try:
            st = os.fstat(fd)
            _check_owner(path, st)
            # Nobody else holds it (write lock granted)? Then this process decides what
            # the file is, and joiners wait for that (their read locks block).
            alone = _ofd_lock(fd, fcntl.F_WRLCK, _HOLDERS_BYTE, wait=False)
            if not alone:  # blocks only while a last holder closes or a warm start validates
                _ofd_lock(fd, fcntl.F_RDLCK, _HOLDERS_BYTE, wait=True)
            if not _names(path, st.st_ino):  # the last holder removed it meanwhile
                os.close(fd)
                return None, "its last holder removed the name meanwhile"
            if not alone:  # the holders may all have gone (or died) meanwhile
                alone = _ofd_lock(fd, fcntl.F_WRLCK, _HOLDERS_BYTE, wait=False)
            size = os.fstat(fd).st_size
            raw = os.pread(fd, HEADER_BYTES, 0) if size >= HEADER_BYTES else bytes(HEADER_BYTES)
            h = Header(*_HEADER.unpack_from(raw))
            found = _LIFETIME.unpack_from(raw, _LIFETIME_OFFSET)[0]
            if h.magic not in (MAGIC, b"\0" * 8):
                raise ArenaLayoutMismatch(path, "magic", MAGIC, h.magic)
            if h.magic != MAGIC:
                if alone and h.creator_pid and not creator_alive(h):
                    log.warning(
                        "arena %s: its creator (process %d) died before finishing it; "
                        "reclaiming it", path, h.creator_pid,
                    )  # fmt: skip
                    _unlink_if_inode(path, st.st_ino)
                os.close(fd)
                return None, "the header is not written yet"
            if not found & SHARED_LIFETIME:
                raise ArenaError(
                    f"{path} was made by Arena.create (its name lives as long as its creator "
                    "or `processes` count), not by open_shared: use another arena name, or "
                    "stop the processes using it and remove the file"
                )
            if alone and not found & PERSISTENT:
                log.warning(
                    "arena %s: no process holds it (every holder crashed) and it is not "
                    "persistent; reclaiming it", path,
                )  # fmt: skip
                _unlink_if_inode(path, st.st_ino)
                os.close(fd)
                return None, "a leftover nobody held was reclaimed"
            if (found & PERSISTENT) != (lifetime & PERSISTENT):
                raise ArenaError(
                    f"arena {path} is persistent={bool(found & PERSISTENT)} (set by the "
                    f"instance that created it), this process asked persistent="
                    f"{bool(lifetime & PERSISTENT)}: give every instance the same setting, "
                    "or use another arena name"
                )
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
            _check_header(path, mm, block_bytes, None, layout_key, size)
            if num_blocks is not None and num_blocks != h.num_blocks:
                log.info(
                    "arena %s has %d blocks, this process asked for %d: the first instance "
                    "decides; using %d", path, h.num_blocks, num_blocks, h.num_blocks,
                )  # fmt: skip
            arena = cls(path, fd, mm, created=False)
        except BaseException:
            if arena is None:
                if mm is not None:
                    mm.close()
                os.close(fd)
            raise
        try:
            arena.warm_started = alone
            if alone:
                log.info("arena %s: warm start of a persistent arena nobody held", path)
                if on_warm_start is not None:
                    on_warm_start(arena)
            arena.resume_populate(populate, populate_threads)
            if alone:  # a conversion: never waits
                _ofd_lock(fd, fcntl.F_RDLCK, _HOLDERS_BYTE, wait=True)
            arena._count_attach()
            arena._register(register_cuda, populate)
        except BaseException:
            arena.close()
            raise
        log.info("joined shared arena %s", path)
        return arena, ""

    @staticmethod
    def remove_shared(name: str, *, directory: str = DEFAULT_DIR) -> bool:
        """Remove the name of a shared-lifetime arena (a persistent one, say) that no
        process holds open; False if there is none. ArenaError while one is held."""
        path = os.path.join(directory, check_arena_name(name))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            _check_owner(path, os.fstat(fd))
            if not _ofd_lock(fd, fcntl.F_WRLCK, _HOLDERS_BYTE, wait=False):
                raise ArenaError(f"arena {path} is held open by live processes: close them first")
            raw = os.pread(fd, HEADER_BYTES, 0)
            if (
                len(raw) == HEADER_BYTES
                and raw[:8] == MAGIC
                and not (_LIFETIME.unpack_from(raw, _LIFETIME_OFFSET)[0] & SHARED_LIFETIME)
            ):
                raise ArenaError(
                    f"{path} is not a shared-lifetime arena (made by Arena.create): its "
                    "creator removes it; remove the file by hand if no process uses it"
                )
            _unlink_if_inode(path, os.fstat(fd).st_ino)
        finally:
            os.close(fd)
        return True

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def registered(self) -> bool:
        """True when this process registers the data area with CUDA (all of it, or
        chunk by chunk as it becomes ready: see :meth:`covers`)."""
        return self._registration is not None

    @property
    def ready_bytes(self) -> int:
        """Bytes of the data area faulted so far, a prefix (published by the creator)."""
        return 0 if self._mm is None else _read_ready(self._mm, self.nbytes)

    @property
    def ready_blocks(self) -> int:
        """Blocks the catalog may hand out: those wholly inside the ready prefix."""
        return self.ready_bytes // self.block_bytes

    @property
    def ready_fraction(self) -> float:
        return self.ready_bytes / self.nbytes

    @property
    def registered_fraction(self) -> float:
        """Share of the data area this process has registered with CUDA (0.0 without)."""
        r = self._registrar
        return 0.0 if r is None else r.registered_bytes / self.nbytes

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every block is ready (and, if registering, registered or failed);
        False on timeout, close, a failed populate or a creator that died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.001
        while self.ready_bytes < self.nbytes or (
            self._registrar is not None and self._registrar.end < self.nbytes
        ):
            if self._mm is None or (deadline is not None and time.monotonic() >= deadline):
                return False
            if self._populator is not None and self._populator.failure is not None:
                return False
            if self.ready_bytes < self.nbytes and not self._populator_alive():
                return False  # its populator died mid-populate: the rest never comes
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return True

    def _populator_alive(self) -> bool:
        if self._populator is not None:
            return self._populator.failure is None
        if self.lifetime:  # any process may have taken over: whoever holds the lock
            return _ofd_locked(self._fd, _POPULATOR_BYTE)
        return _alive(*self._creator)

    def resume_populate(self, populate: PopulateMode = "background",
                        threads: int | None = None) -> bool:  # fmt: skip
        """Take over the pre-faulting of a shared-lifetime arena whose populating
        process died; True if this process now populates it.

        Only one process populates at a time (a write lock on a header byte that
        the kernel releases with its holder). ``populate`` "eager" finishes it
        before returning, otherwise threads continue from the ready prefix.
        """
        if not self.lifetime or self._mm is None or self._populator is not None:
            return False
        if self.ready_bytes >= self.nbytes:
            return False
        if not _ofd_lock(self._fd, fcntl.F_WRLCK, _POPULATOR_BYTE, wait=False):
            return False  # its populator lives
        done = self.ready_bytes  # again: it may have finished before dying
        if done >= self.nbytes:
            return False
        log.warning(
            "arena %s: its populate stopped at %.1f of %.1f MiB (that process is gone); "
            "this process resumes it", self.path, done / 2**20, self.nbytes / 2**20,
        )  # fmt: skip
        start = self._data_offset
        populator = _Populator(self._mm, start, start + self.nbytes, threads, self.path, done)
        if populate == "eager":
            populator.run()
        else:
            self._populator = populator
            populator.start()
        return True

    def covers(self, extents: Sequence[tuple[int, int]]) -> bool:
        """Whether the device alias may touch every block of ``extents`` in this process
        (every block lies in a chunk it registered); else copy them through :attr:`host`."""
        r = self._registrar
        return r is not None and r.covers(extents, self.block_bytes)

    def close(self) -> None:
        """Stop populate and registration, unregister, drop every view, unmap, and
        unlink the name if this process created it.

        Idempotent. Returns within about one populate chunk (~0.1 s) even mid-
        populate. Tensors the caller still holds on :attr:`host` keep the
        mapping alive until they are freed (no BufferError, no dangling host
        pointer); CUDA aliases become invalid at once.
        """
        if self._mm is None:
            return
        if self.created and not self.lifetime:
            self._unlink()
        self.device = None
        self._stop_workers()  # before unregistering or unmapping what they touch
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
        if self.lifetime and os.getpid() == self._opener:
            self._release_hold()
        os.close(self._fd)  # drops this process's locks

    def _release_hold(self) -> None:
        """The last holder (no other read lock on the holders byte) removes the name,
        unless the arena is persistent; joiners waiting meanwhile see it gone and retry."""
        last = _ofd_lock(self._fd, fcntl.F_WRLCK, _HOLDERS_BYTE, wait=False)
        if last and not self.lifetime & PERSISTENT:
            self._unlink()
        # Explicitly: a mapping that outlives close (a tensor still viewing it) keeps
        # the file description, and so its locks, alive.
        for byte in (_HOLDERS_BYTE, _POPULATOR_BYTE):
            _ofd_lock(self._fd, fcntl.F_UNLCK, byte, wait=True)
        if last:
            kept = self.lifetime & PERSISTENT
            log.debug("arena %s: closed by its last holder, %s", self.path,
                      "kept (persistent)" if kept else "name removed")  # fmt: skip

    def _stop_workers(self) -> None:
        workers = (self._registrar, self._populator)
        self._registrar = self._populator = None  # they reference the mapping too
        for worker in workers:
            if worker is not None:
                worker.stop()

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
        """The CUDA alias of the data area on ``device`` (once a first chunk is
        registered; copy only blocks :meth:`covers` accepts through it)."""
        r = self._registrar
        if self._registration is None or r is None or r.alias is None:
            raise ArenaError(f"arena {self.path} is not registered with CUDA: no device view")
        if r.alias.device == torch.device(device):
            self.device = r.alias
            return r.alias
        return self._registration.device_alias(device)

    def fileno(self) -> int:
        """The arena file's descriptor (the shared catalog opens its own description)."""
        return self._fd

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

    def _register(self, mode: RegisterMode, populate: PopulateMode) -> None:
        if mode == "never":
            return
        if not torch.cuda.is_available():
            if mode == "always":
                raise ArenaError("register_cuda='always' but CUDA is not available")
            return
        from .cuda_host import HostRegistration

        try:
            self._registration = HostRegistration(
                self.host.data_ptr(), self.nbytes, defer=True,
                device_index=torch.cuda.current_device(),  # torch's, for background threads too
            )  # fmt: skip
        except Exception as exc:
            self._registration_failed(mode, exc)
            return
        mm, nbytes = self._mm, self.nbytes
        if mode != "always" and populate != "eager":
            self._registrar = _Registrar(self._registration, nbytes, self.path, _REGISTER_SPAN)
            self._registrar.start(lambda: _read_ready(mm, nbytes))
            return
        registrar = _Registrar(self._registration, nbytes, self.path, REGISTER_CHUNK_BYTES)
        try:  # synchronous: the caller gets an arena registered as far as it can be
            while registrar.end < nbytes:
                registrar.step(_read_ready(mm, nbytes))
                if registrar.end < nbytes:
                    if not self._populator_alive():  # its populate will never finish
                        raise ArenaError("the populating process died before populating it")
                    time.sleep(0.005)
            if mode == "always" and registrar.first_error is not None:
                raise registrar.first_error
        except Exception as exc:
            self._registration.close()
            self._registration_failed(mode, exc)
            return
        if registrar.alias is None:  # nothing usable (and said so): plain host copies
            self._registration.close()
            self._registration = None
            return
        self._registrar, self.device = registrar, registrar.alias

    def _registration_failed(self, mode: RegisterMode, exc: Exception) -> None:
        self._registration = None
        if mode == "always":
            raise ArenaError(f"CUDA host registration of {self.path} failed: {exc}") from exc
        log.warning(
            "arena %s: CUDA host registration failed (%s); transfers fall back to "
            "unregistered copies. Install ecoffload[cuda12] or [cuda13] for CuPy.",
            self.path,
            exc,
        )


class _Populator:
    """Faults a data area chunk by chunk, in order, with bounded threads (``madvise``
    drops the GIL), publishing the ready prefix into the header as it grows."""

    def __init__(
        self, mm: mmap.mmap, start: int, end: int, threads: int | None, path: str, done: int = 0
    ) -> None:
        self._mm, self._start, self._end, self._path = mm, start, end, path
        self._done = done  # resumed: bytes [start, start + done) were faulted already
        step = _POPULATE_CHUNK
        self._chunks = [(o, min(step, end - o)) for o in range(start + done, end, step)]
        if threads is None:
            threads = 1 if end - start < _PARALLEL_POPULATE_BYTES else min(8, os.cpu_count() or 1)
        self.threads = max(1, min(threads, len(self._chunks)))
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._next = self._prefix = 0  # next chunk to take; chunks [0, _prefix) are done
        self._finished: set[int] = set()  # done beyond the prefix
        self._workers: list[threading.Thread] = []
        self._base = 0  # address of the mapping, once started
        self._t0 = self._last_log = 0.0
        self.failure: OSError | None = None
        self.seconds: float | None = None  # wall time of the whole populate, once done

    def run(self) -> None:
        """Populate everything now (eager)."""
        self.start()
        self.join()
        self._raise_failure()

    def run_first(self) -> None:
        """Populate the first chunk in the caller's thread (then ``start`` the rest)."""
        self._begin()
        self._step()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise ArenaError(f"{self.failure}; is there enough free memory for the arena?")

    def _begin(self) -> None:
        if not self._base:
            buf = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(buf)
            del buf  # release the buffer export at once, or mm.close() would fail
            self._t0 = self._last_log = time.monotonic()

    def start(self) -> None:
        self._begin()
        self._workers = [
            threading.Thread(target=self._work, name=f"ecoffload-populate-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for w in self._workers:
            w.start()

    def join(self) -> None:
        for w in self._workers:
            w.join()

    def stop(self) -> None:
        """Stop after the chunks in progress (at most ~0.1 s of work each) and join."""
        self._stop.set()
        self.join()

    def _work(self) -> None:
        while not self._stop.is_set() and self._step():
            pass

    def _step(self) -> bool:
        """Fault the next chunk; False when there is none left (or populate failed)."""
        with self._lock:
            i = self._next
            if i >= len(self._chunks) or self.failure is not None:
                return False
            self._next += 1
        offset, size = self._chunks[i]
        try:
            _fault(self._mm, self._base, offset, size, self._path)
        except OSError as exc:
            exc.with_traceback(None)  # kept: must not hold this frame (and the mapping)
            with self._lock:
                self.failure = self.failure or exc
            log.error(
                "arena %s: populate stopped at %d of %d MiB (%s); only the ready part is used",
                self._path, self._ready() >> 20, (self._end - self._start) >> 20, exc,
            )  # fmt: skip
            return False
        with self._lock:
            self._finished.add(i)
            while self._prefix in self._finished:
                self._finished.discard(self._prefix)
                self._prefix += 1
            ready = self._ready()
            _READY.pack_into(self._mm, _READY_OFFSET, ready)
            self._progress(ready)
        return True

    def _ready(self) -> int:
        return self._done if not self._prefix else sum(self._chunks[self._prefix - 1]) - self._start

    def _progress(self, ready: int) -> None:
        now, total = time.monotonic(), self._end - self._start
        elapsed = max(now - self._t0, 1e-9)
        rate = (ready - self._done) / elapsed
        if ready == total:
            self.seconds = elapsed
            log.log(
                logging.INFO if len(self._chunks) > 4 else logging.DEBUG,
                "arena %s: pre-faulted %.1f GiB in %.2f s (%.2f GiB/s, %d thread(s))",
                self._path, total / 2**30, elapsed, rate / 2**30, self.threads,
            )  # fmt: skip
        elif now - self._last_log >= _PROGRESS_EVERY_S:
            self._last_log = now
            log.info(
                "arena %s: pre-faulted %d%% (%.1f of %.1f GiB) at %.2f GiB/s, ETA %.1f s",
                self._path, 100 * ready // total, ready / 2**30, total / 2**30, rate / 2**30,
                (total - ready) / rate if rate else float("inf"),
            )  # fmt: skip


class _Registrar:
    """Registers a process's view of the ready prefix with CUDA, span by span.

    Spans start at one populate chunk and double up to ``span`` (few calls,
    yet the first blocks are usable at once). A span whose registration fails
    is skipped (one warning) and its blocks stay host-only. The device alias is
    built after the first registered span; without it nothing is covered.
    """

    def __init__(self, registration, nbytes: int, path: str, span: int) -> None:
        self._registration, self._nbytes, self._path = registration, nbytes, path
        self._span = span
        self.alias: torch.Tensor | None = None  # built after the first registered span
        self.end = 0  # bytes handled (registered or failed): a prefix
        self.registered_bytes = 0
        self.failed: list[tuple[int, int]] = []  # byte ranges left unregistered
        self.first_error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, ready: int) -> None:
        """Register what of ``[end, ready)`` makes a span worth a call."""
        while self.end < ready and not self._stop.is_set():
            size = min(ready - self.end, self._span)
            if ready < self._nbytes and size < min(self._span, max(_POPULATE_CHUNK, self.end)):
                return  # wait for a longer span
            try:
                self._registration.register(self.end, size)
            except Exception as exc:
                exc.with_traceback(None)  # kept (and logged): must not hold frames on the mapping
                self.failed.append((self.end, self.end + size))  # before end moves past it
                if self.first_error is None:
                    self.first_error = exc
                    log.warning(
                        "arena %s: CUDA host registration failed for bytes [%d, %d) (%s); "
                        "copies of blocks there fall back to host memory, the rest use the "
                        "registered alias", self._path, self.end, self.end + size, exc,
                    )  # fmt: skip
                else:
                    log.debug("arena %s: registration of [%d, +%d) failed too: %s",
                              self._path, self.end, size, exc)  # fmt: skip
            else:
                self.registered_bytes += size
                if self.alias is None and not self._make_alias():
                    self.end = self._nbytes  # no alias, nothing to register for
                    return
            self.end += size

    def _make_alias(self) -> bool:
        reg = self._registration
        try:
            index = reg.device_index
            if index is None:
                index = torch.cuda.current_device()
            self.alias = reg.device_alias(torch.device("cuda", index))
        except Exception as exc:
            exc.with_traceback(None)
            self.first_error = self.first_error or exc
            log.warning(
                "arena %s: CUDA host registration failed: no device alias (%s); transfers "
                "fall back to host copies", self._path, exc,
            )  # fmt: skip
            return False
        return True

    def covers(self, extents: Sequence[tuple[int, int]], block_bytes: int) -> bool:
        end, failed = self.end, self.failed  # end first: every failed span below it is listed
        if self.alias is None:
            return False
        if end >= self._nbytes and not failed:
            return True
        for start, count in extents:
            lo, hi = start * block_bytes, (start + count) * block_bytes
            if hi > end or any(lo < b and a < hi for a, b in failed):
                return False
        return True

    def start(self, ready_of) -> None:
        self._thread = threading.Thread(
            target=self._loop, args=(ready_of,), name="ecoffload-register", daemon=True
        )
        self._thread.start()

    def _loop(self, ready_of) -> None:
        while not self._stop.is_set() and self.end < self._nbytes:
            self.step(ready_of())
            self._stop.wait(0.005)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _check_modes(register_cuda: str, populate: str) -> None:
    # Refused before any file is made: an unknown mode would silently act as "auto".
    if register_cuda not in REGISTER_MODES:
        raise ArenaError(
            f"register_cuda must be one of {list(REGISTER_MODES)}, got {register_cuda!r}"
        )
    if populate not in POPULATE_MODES:
        raise ArenaError(f"populate must be one of {list(POPULATE_MODES)}, got {populate!r}")


def _read_ready(mm: mmap.mmap, nbytes: int) -> int:
    while True:  # the creator may be writing it: take a value read twice alike
        first = _READY.unpack_from(mm, _READY_OFFSET)[0]
        if _READY.unpack_from(mm, _READY_OFFSET)[0] == first:
            return min(first, nbytes)


_libc_madvise = None


def _fault(mm: mmap.mmap, base: int, offset: int, size: int, path: str) -> None:
    """Fault in ``size`` bytes at ``offset`` of ``mm`` (``base``: its address)."""
    global _libc_madvise
    if _libc_madvise is None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc_madvise = madvise
    # ctypes drops the GIL during the call, so threads fault pages in parallel.
    if _libc_madvise(base + offset, size, _MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, f"pre-faulting {path}: {os.strerror(err)}")
        mm[offset : offset + size : mmap.PAGESIZE] = bytes(-(-size // mmap.PAGESIZE))


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
                    shared = _LIFETIME.unpack_from(mm, _LIFETIME_OFFSET)[0] & SHARED_LIFETIME
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


# The janitor: a bare interpreter (no site, no ecoffload import: ~10 ms) holding no
# lock until every holder is gone; its lock struct is _FLOCK's layout.
_JANITOR = """
import fcntl, os, struct, sys
if os.fork():  # the janitor is the grandchild: nobody's child once this exits
    os._exit(0)
path, inode, byte = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
except OSError:
    sys.exit(0)
if os.fstat(fd).st_ino != inode:
    sys.exit(0)
fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, byte, 1, 0))
try:
    if os.stat(path, follow_symlinks=False).st_ino == inode:
        os.unlink(path)
except FileNotFoundError:
    pass
"""


def _start_janitor(path: str, inode: int) -> None:
    """Remove ``path`` once no process holds the arena, however the holders end.

    A process of its own that exits right after; it never maps the file. It
    runs in a session of its own (a signal to the serving process group does
    not reach it) and is no descendant of this process (started through a
    parent that exits at once), because vLLM's shutdown kills its engine
    processes' children.
    """
    subprocess.run(
        [sys.executable, "-I", "-S", "-c", _JANITOR, path, str(inode), str(_HOLDERS_BYTE)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, check=True, timeout=60,
    )  # fmt: skip


def _ofd_lock(fd: int, kind: int, byte: int, *, wait: bool) -> bool:
    """Set (``F_RDLCK``/``F_WRLCK``) or drop (``F_UNLCK``) this description's lock on
    one byte; without ``wait``, False when another description's lock conflicts."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _ofd_locked(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte``."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


def _names(path: str, inode: int) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == inode
    except FileNotFoundError:
        return False
