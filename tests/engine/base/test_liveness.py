"""Owners' liveness (engine/base/liveness.py): a process's start time read from /proc,
whether a recorded (pid, start time) still runs, and this boot's id.

The references are independent of the parsing under test: a child's start
time against /proc/uptime read at its fork, the boot id against ``uuid``.
"""

import io
import os
import signal
import uuid

import pytest

from ecoffload.engine.base import liveness
from ecoffload.engine.base.liveness import alive, boot_id, process_start_time


def _uptime_ticks() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def test_a_start_time_is_read_past_a_process_name_with_parentheses_and_spaces():
    before = _uptime_ticks()
    ready, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        signal.alarm(60)  # a child a mutant hangs must not outlive the run
        try:
            with open("/proc/self/comm", "w") as f:
                f.write("a) b 1 2 (c")  # field 22 must still be found from the last ")"
            os.write(ready[1], b"x")
            os.read(done[0], 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready[0], 1) == b"x"
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip() == "a) b 1 2 (c"
        start = process_start_time(pid)
        assert before - 2 <= start <= _uptime_ticks() + 2  # forked just now, in ticks
        assert process_start_time(os.getpid()) <= start
        assert alive(pid, start) and alive(pid, 0)
        assert not alive(pid, start + 1)
    finally:
        os.write(done[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*ready, *done):
            os.close(fd)
    assert process_start_time(pid) is None  # reaped: gone
    assert not alive(pid, start) and not alive(pid, 0)


def test_alive_answers_from_the_cache_and_fills_it():
    me = os.getpid()
    start = process_start_time(me)
    cache = {}
    assert alive(me, start, cache) is True
    assert alive(me, start + 1, cache) is False
    assert cache == {(me, start): True, (me, start + 1): False}
    cache[me, start] = False  # a sweep's earlier answer stands for the whole sweep
    assert alive(me, start, cache) is False
    assert alive(me, start) is True  # no cache: /proc again


def test_the_boot_id_is_the_two_halves_of_the_kernel_s_boot_uuid():
    with open("/proc/sys/kernel/random/boot_id") as f:
        raw = uuid.UUID(f.read().strip()).bytes
    expected = tuple(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8))
    assert boot_id() == expected
    assert expected != (0, 0)


@pytest.mark.parametrize("proc", ["missing", "garbled"])
def test_without_a_readable_boot_id_the_boot_is_0_0(monkeypatch, proc):
    """(0, 0) stands for "boot unknown", never an exception at a catalog's open."""

    def fake_open(path, mode="r"):  # a /proc without the file, or with something else in it
        assert path == "/proc/sys/kernel/random/boot_id" and mode == "rb"
        if proc == "missing":
            raise FileNotFoundError(path)
        return io.BytesIO(b"not a uuid\n")

    monkeypatch.setattr(liveness, "open", fake_open, raising=False)
    assert boot_id() == (0, 0)


def test_this_process_s_identity_is_its_pid_and_its_start_time():
    # what every reservation and pin records: a pid that is reused later must not match
    me = liveness.ProcessId.of_this_process()
    assert me == (os.getpid(), process_start_time(os.getpid()))
    assert me.start > 0 and alive(*me)
