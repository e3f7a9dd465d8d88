"""The segments of a shared-memory directory (``/dev/shm``): who holds each, which leaked.

A segment is *held* while a live process maps it or has it open: the kernel
says so (a write lease, ``F_SETLEASE``, is refused while any other process
has the file open or mapped), and ``/proc/*/maps`` and ``/proc/*/fd`` say who
(one scan, by device and inode). One nobody holds is *leaked*: its memory
stays taken until someone removes the name (vLLM's ``psm_*`` caches of a
SIGKILLed server, the ``*cpushm*`` files of a
tensor-parallel one stopped without grace, ``sem.mp-*`` semaphores...). A
persistent ecoffload arena nobody holds is kept on purpose: it is listed
apart and removed only when named. What created a segment is told from its
name where the name tells (:data:`KINDS`).

:func:`survey` only reads; :func:`remove` removes leaked segments, each under
a write lease of its own (so no process can open it meanwhile: its open waits
for the lease) and only the file it surveyed (same inode). Where a lease is
not possible (another user's file without CAP_LEASE, a file system without
leases) ``/proc`` alone decides, and a process it cannot inspect counts as a
holder of every file it could open.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import time
from dataclasses import asdict, dataclass, field

from .arena.format import DEFAULT_DIR, HEADER_BYTES, MAGIC, PERSISTENT, read_lifetime
from .arena.janitor import unlink_if_inode
from .base.errors import ArenaError

# (name pattern, kind, what creates it), the first match wins.
KINDS: tuple[tuple[str, str, str], ...] = (
    ("psm_*", "vllm-psm", "Python multiprocessing.shared_memory: vLLM's shared-memory caches "
     "and message queues"),
    ("*cpushm*", "vllm-cpushm", "vLLM's CPU tensor-parallel communicator (shm manager)"),
    ("sem.mp-*", "mp-semaphore", "a Python multiprocessing semaphore (POSIX named semaphore)"),
    ("vllm_offload_*", "vllm-offload", "vLLM's CPU KV offload region"),
    ("vllm_ec_*", "vllm-ec", "vLLM's CPU encoder-cache region"),
    ("torch_*", "torch", "PyTorch shared tensors"),
)  # fmt: skip


class SegmentError(ArenaError):
    """A segment asked for by name that is not there, or not removable."""


@dataclass
class Segment:
    """One entry of the directory as :func:`survey` saw it."""

    name: str
    path: str
    size_bytes: int  # the file's size
    allocated_bytes: int  # the memory it takes (tmpfs pages written)
    age_s: float  # since it was last written
    kind: str  # ecoffload-arena, a KINDS kind, or "unknown"
    creator: str  # what makes such segments, as far as the name (or header) tells
    persistent: bool  # a persistent ecoffload arena: removed only when named
    inode: int
    holders: list[int] = field(default_factory=list)  # pids that map it or have it open
    uncertain: bool = False  # processes it could be held by could not be inspected

    @property
    def leaked(self) -> bool:
        """Nobody holds it (and every process that could was inspected)."""
        return not self.holders and not self.uncertain

    def to_dict(self) -> dict:
        return {**asdict(self), "leaked": self.leaked}


def _kind(name: str, path: str) -> tuple[str, str, bool]:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        head = b""
    if head[: len(MAGIC)] == MAGIC and len(head) == HEADER_BYTES:
        persistent = bool(read_lifetime(head) & PERSISTENT)
        return "ecoffload-arena", "ecoffload (an arena file)", persistent
    for pattern, kind, creator in KINDS:
        if fnmatch.fnmatchcase(name, pattern):
            return kind, creator, False
    return "unknown", "", False


def _held() -> tuple[dict[tuple[int, int], set[int]], set[int]]:
    """(device, inode) -> pids that map or hold it, from one pass over /proc; and the
    uids of live processes this process could not inspect."""
    held: dict[tuple[int, int], set[int]] = {}
    blind: set[int] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue  # gone
        seen = True  # both its maps and its descriptors were read
        try:
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 6 or parts[4] == "0":
                        continue
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    held.setdefault((os.makedev(major, minor), int(parts[4])), set()).add(pid)
        except (OSError, ValueError):
            seen = False
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            fds, seen = [], False
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            held.setdefault((st.st_dev, st.st_ino), set()).add(pid)
        if not seen and os.path.exists(f"/proc/{entry}"):
            blind.add(uid)
    return held, blind


def _lease(path: str) -> int | None:
    """A descriptor of ``path`` holding a write lease (nobody else has it open or
    mapped, and an open by anyone now waits for the lease), or None if the kernel
    cannot tell (no lease possible here); raises BlockingIOError while it is held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except BlockingIOError:  # another process's lease: it is busy with the file
        raise
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EBUSY):
            raise BlockingIOError(exc.errno, f"{path} is open in another process") from None
        return None
    return fd


def _unlease(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


def _kernel_says_free(path: str) -> bool | None:
    """True if no other process has ``path`` open or mapped, False if one does, None
    if the kernel cannot tell (see :func:`_lease`)."""
    try:
        fd = _lease(path)
    except BlockingIOError:
        return False
    if fd is None:
        return None
    _unlease(fd)
    return True


def _could_open(st: os.stat_result, uids: set[int]) -> bool:
    """Could a process of one of ``uids`` (not inspected) have opened a file with ``st``'s
    owner and mode? Root's processes are assumed not to hold other users' private
    files (run as root to inspect every process)."""
    return st.st_uid in uids or bool(uids and st.st_mode & 0o066)


def survey(directory: str = DEFAULT_DIR) -> list[Segment]:
    """Every regular file in ``directory`` with its holders, by name (read only)."""
    held, blind = _held()
    now = time.time()
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            kind, creator, persistent = _kind(entry.name, entry.path)
            pids = sorted(held.get((st.st_dev, st.st_ino), ()))
            free = None if pids else _kernel_says_free(entry.path)
            found.append(Segment(
                name=entry.name, path=entry.path, size_bytes=st.st_size,
                allocated_bytes=st.st_blocks * 512, age_s=max(0.0, now - st.st_mtime),
                kind=kind, creator=creator, persistent=persistent, inode=st.st_ino, holders=pids,
                uncertain=not pids and (free is False or (free is None and _could_open(st, blind))),
            ))  # fmt: skip
    return sorted(found, key=lambda s: s.name)


def removable(segments: list[Segment], names: list[str] | None) -> list[Segment]:
    """What :func:`remove` would remove: every leaked segment but persistent arenas, or
    (``names``) exactly those named, a persistent arena included; SegmentError if a
    named one is not there or not leaked."""
    if not names:
        return [s for s in segments if s.leaked and not s.persistent]
    by_name = {s.name: s for s in segments}
    chosen = []
    for name in names:
        s = by_name.get(name)
        if s is None:
            raise SegmentError(f"expected a segment {name!r} in the directory, found none: "
                               "list them with `ecoffload shm`")  # fmt: skip
        if not s.leaked:
            who = ", ".join(map(str, s.holders)) or "processes this user cannot inspect"
            raise SegmentError(f"segment {s.path} is held (by {who}): stop them first")
        chosen.append(s)
    return chosen


def unlink_unheld(path: str, inode: int) -> bool:
    """Remove ``path`` if it is still the file ``inode`` and no process holds it (under
    a write lease where possible, as :func:`remove`); whether it was removed."""
    try:
        fd = _lease(path)
    except BlockingIOError:
        return False  # open in another process
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path, follow_symlinks=False)
        if st.st_ino != inode:
            return False
        if fd is None:
            held, blind = _held()
            if held.get((st.st_dev, st.st_ino)) or _could_open(st, blind):
                return False
        unlink_if_inode(path, inode)
        return True
    except FileNotFoundError:
        return False
    finally:
        if fd is not None:
            _unlease(fd)


def kind_of(name: str) -> str:
    """The kind :data:`KINDS` gives a segment's name ("unknown" if none)."""
    return next((k for pattern, k, _ in KINDS if fnmatch.fnmatchcase(name, pattern)), "unknown")


def remove(directory: str = DEFAULT_DIR, names: list[str] | None = None) -> list[Segment]:
    """Remove leaked segments (see :func:`removable`), each only if, surveyed again
    just before, nobody holds it and it is still the same file. The ones removed."""
    return [s for s in removable(survey(directory), names) if unlink_unheld(s.path, s.inode)]
