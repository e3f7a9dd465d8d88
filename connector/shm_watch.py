"""What a stopped ``vllm serve`` leaves in /dev/shm, removed by the launcher on its way out.

vLLM removes its shared-memory segments when it stops gracefully; its process
manager stops the engine core with SIGKILL and no grace (``--shutdown-timeout
0``, the default), so what the workers' C++ code created stays: the
``*cpushm*`` files of the CPU tensor-parallel communicator, one per rank (its
``psm_*`` caches are Python ``SharedMemory``: the launcher's resource tracker
removes those at its exit). The launcher (:mod:`.cli`) notes, every couple of
seconds while the server runs, the ``*cpushm*`` segments its descendant
processes map; once vLLM's main returns it waits (bounded) for them to exit,
then removes each noted segment that is still the same file and that no
process holds (``engine/shm_segments.py``), and the file store in the
temporary directory their ranks met through (``vllm_dist_<id>``, named in the
segments' names). Arena files are never touched (the arena's own janitor or
persistence decides), nor anything another program made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time

from ..engine.base.liveness import process_start_time
from ..engine.shm_segments import kind_of, unlink_unheld

log = logging.getLogger("vllm.ecoffload_cli")

KINDS = ("vllm-cpushm",)  # what vLLM removes when it stops gracefully, and nobody else
# Descendants that live as long as the launcher itself (not waited for).
LIFELONG = (b"multiprocessing.resource_tracker",)
PERIOD_S = 2.0


def descendants(root: int, *, lifelong: bool = True) -> list[int]:
    """Live processes below ``root`` (from /proc/*/stat); ``lifelong=False`` leaves out
    the helpers that exit only with ``root`` (:data:`LIFELONG`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":  # a zombie holds nothing
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    if not lifelong:
        found = [pid for pid in found if not _lifelong(pid)]
    return found


def _running(pid: int, start: int) -> bool:
    """Process ``pid`` (started at ``start`` ticks; 0: unknown) runs, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != b"Z" and (not start or int(fields[19]) == start)


def _lifelong(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return False
    return any(name in command for name in LIFELONG)


class SegmentWatch:
    """The vLLM segments this process's descendants map in ``directory``, noted while
    it runs (:meth:`start`) and removed by :meth:`finish` if nobody holds them."""

    def __init__(self, directory: str = "/dev/shm", period_s: float = PERIOD_S) -> None:
        self.directory = os.path.realpath(directory)
        self.period_s = period_s
        self.noted: dict[str, int] = {}  # path -> inode
        self.mappers: dict[int, int] = {}  # pid -> start time of the processes that map them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ecoffload-shm-watch",
                                        daemon=True)  # fmt: skip

    def start(self) -> SegmentWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.note()

    def note(self) -> None:
        """Add the segments of vLLM's kinds the descendants map now."""
        prefix = self.directory + "/"
        for pid in descendants(os.getpid(), lifelong=False):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or not fields[5].startswith(prefix):
                        continue
                    path = fields[5].rstrip("\n")
                    if path.endswith(" (deleted)") or "/" in path[len(prefix) :]:
                        continue  # removed already, or in a folder
                    if kind_of(os.path.basename(path)) in KINDS:
                        self.noted[path] = int(fields[4])
                        self.mappers.setdefault(pid, process_start_time(pid) or 0)
                        self._note_store(os.path.basename(path))

    def _note_store(self, name: str) -> None:
        """The torch.distributed file store the ranks met through: ``<tmp>/vllm_dist_<id>``,
        whose id starts the ``*cpushm*`` names (its last user removes it, if it exits)."""
        ident = name.split("-", 1)[0]
        if not ident.startswith("vllm_dist_"):
            return
        path = os.path.join(tempfile.gettempdir(), ident)
        if path not in self.noted:
            with contextlib.suppress(OSError):
                self.noted[path] = os.stat(path, follow_symlinks=False).st_ino

    def finish(self, wait_s: float = 5.0) -> list[str]:
        """Stop noting; wait up to ``wait_s`` for the descendants and the processes seen
        mapping the segments to exit (a killed engine core's workers are no longer
        descendants); remove the noted segments nobody holds. The paths removed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (
            descendants(os.getpid(), lifelong=False)
            or any(_running(pid, start) for pid, start in self.mappers.items())
        ):
            time.sleep(0.1)
        removed = [p for p, inode in self.noted.items() if unlink_unheld(p, inode)]
        if removed:
            log.info("ecoffload-vllm: removed %d file(s) vLLM's stopped processes left: %s",
                     len(removed), ", ".join(removed))  # fmt: skip
        return removed
