"""Whether a process recorded as (pid, start time) still runs, and this boot's id.

Every owner ecoffload records in shared memory (an arena's creator and catalog
owner, a shared catalog's reservations and pins) is a pair: the pid and the
process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22).
The start time tells a reused pid apart. One pid namespace is assumed.

Plain Python, no torch: the shared catalog and the connector's configuration
import it.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple


def process_start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    return int(stat_line.rsplit(b")", 1)[1].split()[19])  # field 22: starttime


class ProcessId(NamedTuple):
    """A process as ecoffload records it: its pid and start time (0: not known)."""

    pid: int
    start: int

    @classmethod
    def of_this_process(cls) -> ProcessId:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or 0)


def alive(pid: int, start: int, cache: dict | None = None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start`` ticks.

    ``start`` 0 means "not known" (its owner could not read its own /proc entry):
    only the pid is checked then. ``cache`` (a dict the caller keeps for one
    sweep) answers a pair asked before without reading /proc again.
    """
    if cache is not None and (pid, start) in cache:
        return cache[pid, start]
    now = process_start_time(pid)
    answer = now is not None and (not start or now == start)
    if cache is not None:
        cache[pid, start] = answer
    return answer


def boot_id() -> tuple[int, int]:
    """This boot's id (/proc/sys/kernel/random/boot_id) as two int64 words; (0, 0) if none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = bytes.fromhex(f.read().strip().replace(b"-", b"").decode())
    except (OSError, ValueError):
        return (0, 0)
    return struct.unpack("<qq", raw[:16].ljust(16, b"\0"))
