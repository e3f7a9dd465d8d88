"""The janitor's parts (engine/arena/janitor.py), one by one in this process: OFD locks on
single header bytes, "does this name still name that file", removing a name only
if it does, and the janitor's wait-then-remove (in a thread here: the arena's
tests run it as the process of its own it is in service); and the process
``start_janitor`` leaves running: how it was started, and a start that fails.

OFD locks belong to an open file description, so two ``os.open`` of one file in
one process conflict like two processes would: no child process is needed.
"""

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from ecoffload.engine.arena import janitor
from ecoffload.engine.arena.janitor import names, ofd_lock, ofd_locked, unlink_if_inode

BYTE = 112


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "arena"
    p.write_bytes(bytes(4096))
    return str(p)


@pytest.fixture
def fds(path):
    """Two open file descriptions of one file (closed after the test)."""
    opened = [os.open(path, os.O_RDWR) for _ in range(2)]
    yield opened
    for fd in opened:
        os.close(fd)


def test_a_read_lock_of_one_description_blocks_a_write_lock_of_another_on_that_byte_only(fds):
    a, b = fds
    assert ofd_lock(a, fcntl.F_RDLCK, BYTE, wait=False) is True
    assert ofd_lock(b, fcntl.F_RDLCK, BYTE, wait=False) is True  # readers share
    assert ofd_lock(b, fcntl.F_UNLCK, BYTE, wait=True) is True
    assert ofd_lock(b, fcntl.F_WRLCK, BYTE, wait=False) is False  # a holds it
    for other in (BYTE - 1, BYTE + 1):  # one byte: its neighbours are free
        assert ofd_lock(b, fcntl.F_WRLCK, other, wait=False) is True
        assert ofd_lock(b, fcntl.F_UNLCK, other, wait=False) is True
    assert ofd_lock(a, fcntl.F_UNLCK, BYTE, wait=True) is True
    assert ofd_lock(b, fcntl.F_WRLCK, BYTE, wait=False) is True  # released: granted
    assert ofd_lock(a, fcntl.F_RDLCK, BYTE, wait=False) is False


def test_an_error_other_than_a_conflict_is_raised_not_taken_for_one(fds):
    closed = os.dup(fds[0])
    os.close(closed)
    for wait in (False, True):
        with pytest.raises(OSError) as exc:
            ofd_lock(closed, fcntl.F_WRLCK, BYTE, wait=wait)
        assert exc.value.errno == errno.EBADF


def test_locked_reports_only_another_description_s_lock_on_that_byte(fds):
    a, b = fds
    assert not ofd_locked(b, BYTE)
    ofd_lock(a, fcntl.F_RDLCK, BYTE, wait=False)
    assert ofd_locked(b, BYTE)  # a read lock conflicts with the write lock asked about
    assert not ofd_locked(a, BYTE)  # one's own lock is no conflict
    assert not ofd_locked(b, BYTE - 1) and not ofd_locked(b, BYTE + 1)
    ofd_lock(a, fcntl.F_UNLCK, BYTE, wait=False)
    ofd_lock(a, fcntl.F_WRLCK, BYTE + 1, wait=False)
    assert ofd_locked(b, BYTE + 1) and not ofd_locked(b, BYTE)


def test_a_name_names_its_file_until_replaced_or_removed_and_a_link_is_not_followed(path):
    inode = os.stat(path).st_ino
    assert names(path, inode) is True
    link = path + ".link"
    os.symlink(path, link)
    assert names(link, inode) is False  # the link's own inode, not its target's
    os.replace(path, path + ".old")
    open(path, "wb").close()  # a replacement under the same name
    assert names(path, inode) is False
    os.unlink(path)
    assert names(path, inode) is False  # no file at all


def test_unlink_if_inode_removes_only_that_very_file(path):
    inode = os.stat(path).st_ino
    link = path + ".link"
    os.symlink(path, link)
    unlink_if_inode(link, inode)  # the link is another file: kept, and its target too
    assert os.path.islink(link) and os.path.exists(path)
    os.replace(path, path + ".old")
    open(path, "wb").close()
    unlink_if_inode(path, inode)  # a replacement is left alone
    assert os.path.exists(path)
    os.unlink(path)
    unlink_if_inode(path, inode)  # nothing there: no error
    os.replace(path + ".old", path)
    unlink_if_inode(path, inode)
    assert not os.path.exists(path) and os.path.islink(link)


def _janitor_in_thread(path, inode):
    t = threading.Thread(target=janitor._janitor, args=(path, inode, BYTE), daemon=True)
    t.start()
    return t


def test_the_janitor_waits_for_every_holder_then_removes_the_name(path):
    inode = os.stat(path).st_ino
    holders = [os.open(path, os.O_RDWR) for _ in range(2)]
    for fd in holders:
        ofd_lock(fd, fcntl.F_RDLCK, BYTE, wait=False)
    ofd_lock(holders[0], fcntl.F_WRLCK, BYTE + 1, wait=False)  # another byte: no matter
    t = _janitor_in_thread(path, inode)
    try:
        t.join(0.2)
        assert t.is_alive() and os.path.exists(path)  # holders left: it waits
        os.close(holders.pop())
        t.join(0.2)
        assert t.is_alive() and os.path.exists(path)  # one holder is enough
    finally:
        for fd in holders:
            os.close(fd)  # the last holder goes
    t.join(10)
    assert not t.is_alive() and not os.path.exists(path)


def test_the_janitor_leaves_a_replacement_a_link_and_a_missing_name_at_once(path):
    inode = os.stat(path).st_ino
    holder = os.open(path, os.O_RDWR)
    ofd_lock(holder, fcntl.F_RDLCK, BYTE, wait=False)  # would make a waiting janitor hang
    try:
        link = path + ".link"
        os.symlink(path, link)
        janitor._janitor(link, inode, BYTE)  # O_NOFOLLOW: not its file, returns at once
        assert os.path.islink(link)
        os.unlink(link)
        os.replace(path, path + ".old")
        open(path, "wb").close()
        janitor._janitor(path, inode, BYTE)  # another file under the name: returns at once
        assert os.path.exists(path)
        os.unlink(path)
        janitor._janitor(path, inode, BYTE)  # no file: returns
    finally:
        os.close(holder)
    assert os.path.exists(path + ".old")


def watching(path):
    """Pids of the processes whose command line names ``path`` (its janitor)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.fsencode(path) in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_start_janitor_leaves_an_isolated_silent_process_in_a_session_of_its_own(path):
    inode = os.stat(path).st_ino
    holder = os.open(path, os.O_RDWR)
    ofd_lock(holder, fcntl.F_RDLCK, BYTE, wait=False)  # the janitor waits for it
    terminal, ours = os.pipe(), os.dup(0)  # our standard input: say, a terminal's
    os.dup2(terminal[0], 0)
    try:
        janitor.start_janitor(path, inode, BYTE)
        os.dup2(ours, 0)
        (pid,) = watching(path)  # started and returned: it runs on alone
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")[:-1]
        # this very file, isolated and without site (no PYTHON* variables, no
        # site-packages, no ecoffload or torch: it imports the standard library only)
        expected = [sys.executable, "-I", "-S", os.path.abspath(janitor.__file__), path,
                    str(inode), str(BYTE)]  # fmt: skip
        assert args == [os.fsencode(a) for a in expected]
        with open(f"/proc/{pid}/stat") as f:
            ppid, pgrp, session = map(int, f.read().rsplit(")", 1)[1].split()[1:4])
        assert ppid != os.getpid()  # no child of ours (vLLM's shutdown kills those)...
        assert pgrp != os.getpgrp() and session != os.getsid(0)  # ...nor reached by our signals
        for fd in (0, 1, 2):  # it holds no terminal and no pipe of whoever started it
            assert os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/null"
        assert os.path.exists(path)
    finally:
        os.dup2(ours, 0)
        for fd in (*terminal, ours):
            os.close(fd)
        os.close(holder)  # the last holder goes: the janitor removes the name and ends
    deadline = time.monotonic() + 10
    while (os.path.exists(path) or watching(path)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(path) and not watching(path)


def test_a_janitor_that_cannot_start_raises(path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits 1 at once
    with pytest.raises(subprocess.CalledProcessError) as err:
        janitor.start_janitor(path, os.stat(path).st_ino, BYTE)
    assert err.value.returncode == 1 and err.value.cmd[:3] == ["/bin/false", "-I", "-S"]
    assert os.path.exists(path)
