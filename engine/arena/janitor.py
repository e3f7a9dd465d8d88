"""Open-file-description locks on single header bytes, and the janitor that waits on one.

A shared-lifetime arena (``Arena.open_shared``) is held by an OFD read lock
per process on one header byte; the kernel drops a lock with its holder,
however that holder ends. The janitor is a process of its own that waits for
a *write* lock on that byte, granted once every holder closed or died, and
then removes the arena's name if it still names the same file (inode).

This module is also the janitor's program: :func:`start_janitor` runs this
very file with ``python -I -S`` (no site, no ecoffload, no torch: ~10 ms), so
it imports nothing but the standard library.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import sys

_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid


def ofd_lock(fd: int, kind: int, byte: int, *, wait: bool) -> bool:
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


def ofd_locked(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte``."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


def names(path: str, inode: int) -> bool:
    """Whether ``path`` still names the file ``inode``."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == inode
    except FileNotFoundError:
        return False


def unlink_if_inode(path: str, inode: int) -> None:
    """Remove ``path`` only if it still names the file ``inode`` (never a replacement)."""
    try:
        if os.stat(path, follow_symlinks=False).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def start_janitor(path: str, inode: int, byte: int) -> None:
    """Remove ``path`` once no process holds a lock on ``byte`` of it, however the
    holders end.

    A process of its own that exits right after; it never maps the file. It
    runs in a session of its own (a signal to the serving process group does
    not reach it) and is no descendant of this process (started through a
    parent that exits at once), because vLLM's shutdown kills its engine
    processes' children.
    """
    subprocess.run(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), path, str(inode), str(byte)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, check=True, timeout=60,
    )  # fmt: skip


def _janitor(path: str, inode: int, byte: int) -> None:
    """The janitor's work, in the grandchild: wait for the write lock, remove the name."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    if os.fstat(fd).st_ino != inode:
        return
    ofd_lock(fd, fcntl.F_WRLCK, byte, wait=True)  # holds no lock until then
    unlink_if_inode(path, inode)


if __name__ == "__main__":
    if os.fork():  # the janitor is the grandchild: nobody's child once this exits
        os._exit(0)
    _janitor(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
