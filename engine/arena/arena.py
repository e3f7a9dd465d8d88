"""The arena: one shared-memory file of fixed-size blocks, mapped by every process.

Life cycle::

    creator                                   other processes
    -------                                   ---------------
    open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600)
    ftruncate, mmap(MAP_SHARED)
    write header fields, then the magic       attach(): wait (bounded) for a valid
    populate (populate.py)                    header, check every field, count itself
    ... name unlinked when `processes` processes have attached, or at the
        creator's close: a crash can leave no file behind once all have mapped it ...

The concepts around it, a file each:

* :mod:`.format`: the file layout (header, layout key, name rules) and
  the checks an opener runs; no torch.
* :mod:`.populate`: pre-faulting the data area (``background``, ``eager``,
  ``lazy``) and publishing the ready prefix.
* :mod:`.lifetime`: shared lifetime (:meth:`Arena.open_shared`: the name
  lives while any process holds the file open), resuming a dead populator.
* :mod:`.janitor`: the OFD byte locks and the process that removes the name
  once every holder is gone, however they ended.
* :mod:`.registration`: CUDA host registration following the ready
  prefix, the device alias.
* :mod:`..base.liveness`: (pid, start time) owners.

If the creator dies mid-populate its pid no longer runs, so the file is stale
(:class:`ArenaStaleError`) and reclaimed by the next ``create_or_attach``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Mapping

import torch

from ..base.errors import ArenaError, ArenaExistsError, ArenaStaleError
from ..base.liveness import ProcessId, process_start_time
from .format import (
    ANY_LAYOUT,
    DEFAULT_DIR,
    FORMAT_VERSION,
    HEADER,
    HEADER_BYTES,
    HOLDERS_BYTE,
    KEY_OFFSET,
    MAGIC,
    MAX_LAYOUT_KEY_BYTES,
    PERSISTENT,
    POPULATE_MODES,
    POPULATOR_BYTE,
    REGISTER_MODES,
    SHARED_LIFETIME,
    Header,
    LayoutKey,
    PopulateMode,
    RegisterMode,
    _AnyLayout,
    check_arena_name,
    check_free_space,
    check_header,
    check_modes,
    creator_alive,
    layout_key_text,
    read_header,
    read_lifetime,
    read_ready,
    wait_for_header,
    write_lifetime,
    write_ready,
)
from .janitor import ofd_lock, start_janitor, unlink_if_inode
from .lifetime import SharedLifetime
from .populate import Populator
from .registration import RegisteredArena

log = logging.getLogger(__name__)

__all__ = [  # what `from ecoffload.engine.arena.arena import ...` offers (and always offered)
    "ANY_LAYOUT", "DEFAULT_DIR", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC",
    "MAX_LAYOUT_KEY_BYTES", "PERSISTENT", "POPULATE_MODES", "REGISTER_MODES", "SHARED_LIFETIME",
    "Arena", "Header", "LayoutKey", "PopulateMode", "RegisterMode", "check_arena_name",
    "creator_alive", "layout_key_text", "process_start_time",
]  # fmt: skip


class Arena(SharedLifetime, RegisteredArena):
    """A shared, pre-faulted, optionally CUDA-registered block arena.

    Use :meth:`create`, :meth:`attach`, :meth:`create_or_attach` or
    :meth:`open_shared`; close with :meth:`close` (idempotent) or a ``with`` block.

    Attributes:
        host: uint8 CPU tensor over the data area, ``(num_blocks * block_bytes,)``.
        device: uint8 CUDA tensor aliasing the same bytes, or None without CUDA.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, *, created: bool) -> None:
        self.path, self.created = path, created
        self._fd, self._mm = fd, mm
        self._unlinked = False
        header = read_header(mm)
        self.block_bytes, self.num_blocks = header.block_bytes, header.num_blocks
        self.nonce = header.nonce
        self.meta_offset = HEADER_BYTES  # metadata region: [meta_offset, data offset)
        self.meta_bytes = header.data_offset - HEADER_BYTES
        self._creator = ProcessId(header.creator_pid, header.creator_start)
        self.layout_key = bytes(mm[KEY_OFFSET : KEY_OFFSET + header.key_len]).decode()
        self.nbytes = header.block_bytes * header.num_blocks
        self._data_offset = header.data_offset
        self.lifetime = read_lifetime(mm)
        self.warm_started = False  # open_shared: this process found it held by nobody
        self._opener = os.getpid()  # a forked child shares the description, not the hold
        self.host = torch.frombuffer(
            mm, dtype=torch.uint8, count=self.nbytes, offset=header.data_offset
        )
        self.device = None
        self._registration = None
        self._registrar = None
        self._populator = None
        self._verifier = None

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
        check_modes(register_cuda, populate)
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
        if not os.path.isdir(directory):
            check_free_space(directory, total)  # names the missing directory
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise ArenaExistsError(
                f"{path} already exists: attach to it, pick another arena name, or remove "
                "the file if no process uses it"
            ) from None
        mm = None
        try:
            # Once the name is ours (empty: no room taken yet): an existing arena's opener
            # joins it above, needing no room for a second copy of it.
            check_free_space(directory, total)
            os.fchmod(fd, 0o600)  # the umask may only narrow it; be explicit anyway
            if lifetime:  # held until close; a joiner that opens it now waits for the header
                ofd_lock(fd, fcntl.F_RDLCK, HOLDERS_BYTE, wait=True)
                if populate == "background":  # whoever takes over a dead populator needs it
                    ofd_lock(fd, fcntl.F_WRLCK, POPULATOR_BYTE, wait=False)
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # Who is creating it goes first, so an attacher can tell a creator that
            # died mid-way from one still pre-faulting; the magic goes last.
            header = Header(
                b"\0" * 8, FORMAT_VERSION, HEADER_BYTES, block_bytes, num_blocks, data_offset,
                *ProcessId.of_this_process(),
                int.from_bytes(os.urandom(8), "little"), processes, 1, len(key), 0, 0,
            )  # fmt: skip
            HEADER.pack_into(mm, 0, *header)
            write_lifetime(mm, lifetime)
            populator = Populator(mm, data_offset, total, populate_threads, path)
            if populate == "eager":
                populator.run()
            elif populate == "background":
                populator.run_first()  # ~0.1 s: some blocks are ready when attachers look
            if populate == "lazy":
                write_ready(mm, total - data_offset)
            mm[KEY_OFFSET : KEY_OFFSET + len(key)] = key
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
        try:
            if lifetime and not lifetime & PERSISTENT:
                arena._start_janitor()
            arena._register(register_cuda, populate)
        except BaseException:
            # The error's traceback keeps this frame: were its locals still to reference
            # the mapping, close could not unmap while anyone kept the error (a log record).
            del mm, populator
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
        check_modes(register_cuda, populate)
        path = os.path.join(directory, name)
        deadline = time.monotonic() + timeout_s
        fd, mm = wait_for_header(path, deadline, timeout_s)
        try:
            check_header(path, mm, block_bytes, num_blocks, layout_key, os.fstat(fd).st_size)
            arena = cls(path, fd, mm, created=False)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        arena._count_attach()
        try:
            arena._register(register_cuda, populate)
        except BaseException:
            del mm  # as in _new: the traceback keeps this frame
            arena.close()
            raise
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
                unlink_if_inode(stale.path, stale.inode)
        raise ArenaError(f"could not create or attach {name!r}: it keeps changing under us")

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def ready_bytes(self) -> int:
        """Bytes of the data area faulted so far, a prefix (published by the creator)."""
        return 0 if self._mm is None else read_ready(self._mm, self.nbytes)

    @property
    def ready_blocks(self) -> int:
        """Blocks the catalog may hand out: those wholly inside the ready prefix."""
        return self.ready_bytes // self.block_bytes

    @property
    def ready_fraction(self) -> float:
        return self.ready_bytes / self.nbytes

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

    def _start_janitor(self) -> None:
        """Start the process that removes this shared arena's name after its last holder."""
        try:
            start_janitor(self.path, os.fstat(self._fd).st_ino, HOLDERS_BYTE)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ArenaError(
                f"could not start the janitor that removes {self.path} once its last holder "
                f"ends ({exc}): check that {sys.executable} can run a script with -I -S"
            ) from exc

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

    def _stop_workers(self) -> None:
        workers = (self._registrar, self._populator, self._verifier)
        self._registrar = self._populator = self._verifier = None  # they reference the file too
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

    def fileno(self) -> int:
        """The arena file's descriptor (the shared catalog opens its own description)."""
        return self._fd

    def _unlink(self) -> None:
        """Remove the name, but only if it still names this very file."""
        if not self._unlinked:
            self._unlinked = True
            unlink_if_inode(self.path, os.fstat(self._fd).st_ino)
