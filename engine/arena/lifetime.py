"""Shared lifetime: one arena for several instances, removed when the last holder goes.

::

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
every process. The janitor (:mod:`.janitor`) makes "removed when the last
holder is gone" true even when every holder is killed (vLLM's shutdown may
SIGKILL its engine processes): nothing is left in /dev/shm. A file nobody
holds anyway (the janitor was killed too) is reclaimed (not persistent) or
*warm started* (persistent: validated while the opener holds it
exclusively); a creator that died before the magic is stale. One process
populates at a time (a write lock on byte 113); whoever opens the arena after
its populator died resumes from the ready prefix. Plain ``Arena.attach`` maps
a shared-lifetime arena without holding it and never calls it stale.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..base.errors import ArenaAttachTimeout, ArenaError, ArenaExistsError, ArenaLayoutMismatch
from ..base.liveness import ProcessId, alive
from .format import (
    ANY_LAYOUT,
    ATTACHED_OFFSET,
    DEFAULT_DIR,
    HEADER_BYTES,
    HOLDERS_BYTE,
    MAGIC,
    OWNER,
    OWNER_OFFSET,
    PERSISTENT,
    POPULATOR_BYTE,
    PROCESSES_OFFSET,
    SHARED_LIFETIME,
    UNWRITTEN,
    PopulateMode,
    RegisterMode,
    check_arena_name,
    check_header,
    check_modes,
    check_owner,
    creator_alive,
    read_count,
    read_header,
    read_lifetime,
    write_count,
)
from .janitor import names, ofd_lock, ofd_locked, unlink_if_inode
from .populate import Populator
from .state import ArenaState

if TYPE_CHECKING:
    from typing_extensions import Self

# the arena's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.arena.arena")


class SharedLifetime(ArenaState):
    """The lifetime half of :class:`~ecoffload.engine.arena.arena.Arena` (a mixin): who holds
    the file (shared holders, the ``processes`` count, the catalog owner) and who
    populates it."""

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
        on_warm_start: Callable[[Self], object] | None = None,
    ) -> Self:
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
        check_modes(register_cuda, populate)
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
    ) -> tuple[Self | None, str]:  # fmt: skip
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
            check_owner(path, st)
            # Nobody else holds it (write lock granted)? Then this process decides what
            # the file is, and joiners wait for that (their read locks block).
            alone = ofd_lock(fd, fcntl.F_WRLCK, HOLDERS_BYTE, wait=False)
            if not alone:  # blocks only while a last holder closes or a warm start validates
                ofd_lock(fd, fcntl.F_RDLCK, HOLDERS_BYTE, wait=True)
            if not names(path, st.st_ino):  # the last holder removed it meanwhile
                os.close(fd)
                return None, "its last holder removed the name meanwhile"
            if not alone:  # the holders may all have gone (or died) meanwhile
                alone = ofd_lock(fd, fcntl.F_WRLCK, HOLDERS_BYTE, wait=False)
            size = os.fstat(fd).st_size
            raw = os.pread(fd, HEADER_BYTES, 0) if size >= HEADER_BYTES else bytes(HEADER_BYTES)
            h = read_header(raw)
            found = read_lifetime(raw)
            if h.magic not in (MAGIC, UNWRITTEN):
                raise ArenaLayoutMismatch(path, "magic", MAGIC, h.magic)
            if h.magic != MAGIC:
                if alone and h.creator_pid and not creator_alive(h):
                    log.warning(
                        "arena %s: its creator (process %d) died before finishing it; "
                        "reclaiming it", path, h.creator_pid,
                    )  # fmt: skip
                    unlink_if_inode(path, st.st_ino)
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
                unlink_if_inode(path, st.st_ino)
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
            check_header(path, mm, block_bytes, None, layout_key, size)
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
                ofd_lock(fd, fcntl.F_RDLCK, HOLDERS_BYTE, wait=True)
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
            check_owner(path, os.fstat(fd))
            if not ofd_lock(fd, fcntl.F_WRLCK, HOLDERS_BYTE, wait=False):
                raise ArenaError(f"arena {path} is held open by live processes: close them first")
            raw = os.pread(fd, HEADER_BYTES, 0)
            if (
                len(raw) == HEADER_BYTES
                and raw[:8] == MAGIC
                and not (read_lifetime(raw) & SHARED_LIFETIME)
            ):
                raise ArenaError(
                    f"{path} is not a shared-lifetime arena (made by Arena.create): its "
                    "creator removes it; remove the file by hand if no process uses it"
                )
            unlink_if_inode(path, os.fstat(fd).st_ino)
        finally:
            os.close(fd)
        return True

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
        if not ofd_lock(self._fd, fcntl.F_WRLCK, POPULATOR_BYTE, wait=False):
            return False  # its populator lives
        done = self.ready_bytes  # again: it may have finished before dying
        if done >= self.nbytes:
            return False
        log.warning(
            "arena %s: its populate stopped at %.1f of %.1f MiB (that process is gone); "
            "this process resumes it", self.path, done / 2**20, self.nbytes / 2**20,
        )  # fmt: skip
        start = self._data_offset
        populator = Populator(self._mm, start, start + self.nbytes, threads, self.path, done)
        if populate == "eager":
            populator.run()
        else:
            self._populator = populator
            populator.start()
        return True

    def _populator_alive(self) -> bool:
        if self._populator is not None:
            return self._populator.failure is None
        if self.lifetime:  # any process may have taken over: whoever holds the lock
            return ofd_locked(self._fd, POPULATOR_BYTE)
        return alive(*self._creator)

    def attached_processes(self) -> int:
        """How many processes have mapped the arena so far (creator included)."""
        return read_count(self._mapping(), ATTACHED_OFFSET)

    def claim_ownership(self) -> None:
        """Record this process as the arena's one catalog owner, or refuse.

        Blocks are handed out by a catalog; two catalogs over one arena would
        give the same blocks to different items. The first live claimant
        (vLLM's scheduler) owns the arena; another process claiming it while the
        owner lives gets an ArenaError.
        """
        me = ProcessId.of_this_process()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            owner = OWNER.unpack_from(self._mapping(), OWNER_OFFSET)
            if owner[0] and owner != me and alive(*owner):
                raise ArenaError(
                    f"arena {self.path} already has a catalog owner (process {owner[0]}): "
                    "every serving instance, and every data-parallel rank, needs its own "
                    "arena_name"
                )
            OWNER.pack_into(self._mapping(), OWNER_OFFSET, *me)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _count_attach(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # read-modify-write across processes
        try:
            expected = read_count(self._mapping(), PROCESSES_OFFSET)
            attached = min(self.attached_processes() + 1, 0xFFFFFFFF)  # a counter, saturated
            write_count(self._mapping(), ATTACHED_OFFSET, attached)
            if expected and attached >= expected:
                self._unlink()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _release_hold(self) -> None:
        """The last holder (no other read lock on the holders byte) removes the name,
        unless the arena is persistent; joiners waiting meanwhile see it gone and retry."""
        last = ofd_lock(self._fd, fcntl.F_WRLCK, HOLDERS_BYTE, wait=False)
        if last and not self.lifetime & PERSISTENT:
            self._unlink()
        # Explicitly: a mapping that outlives close (a tensor still viewing it) keeps
        # the file description, and so its locks, alive.
        for byte in (HOLDERS_BYTE, POPULATOR_BYTE):
            ofd_lock(self._fd, fcntl.F_UNLCK, byte, wait=True)
        if last:
            kept = self.lifetime & PERSISTENT
            log.debug("arena %s: closed by its last holder, %s", self.path,
                      "kept (persistent)" if kept else "name removed")  # fmt: skip
