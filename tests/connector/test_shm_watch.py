"""The launcher's sweep of what vLLM's killed processes leave in /dev/shm (connector/shm_watch.py).

Real processes in a private directory: a child (a descendant, as vLLM's engine
core and workers are of the launcher) maps segments named as vLLM's CPU
tensor-parallel workers name theirs, and a ``psm_*`` segment (Python's, which
its resource tracker removes); a process that is not a descendant maps a
``*cpushm*`` segment too. The child is SIGKILLed, as vLLM's process manager
kills the engine core: the sweep removes what the child held, and nothing else.
"""

import os
import signal
import subprocess
import sys

from ecoffload.connector.shm_watch import SegmentWatch, descendants

MAPPER = """
import mmap, os, sys
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print(os.getpid(), flush=True)
sys.stdin.read()
"""

# A child that maps its segments and starts a worker mapping one more, which outlives
# it a moment (as TP workers outlive the engine core vLLM kills: no longer descendants).
ENGINE = """
import mmap, os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import sys, time; from mmap import mmap;"
    "import os; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 4096);"
    "m = mmap(fd, 4096); print('ok', flush=True); sys.stdin.read(); time.sleep(0.5)",
    sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline().strip() == "ok"
exec(sys.argv[2])
"""

# A process that is not this one's descendant: started through a parent that exits.
STRANGER = """
import os, subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True, start_new_session=True)
print(p.stdout.readline().strip(), flush=True)
os._exit(0)
"""


def test_the_sweep_removes_what_killed_descendants_mapped_and_nothing_else(tmp_path):
    d = str(tmp_path)
    mine = ["vllm_dist_ab12-tp:0-[0-1]-cpushm_0", "vllm_dist_ab12-tp:0-[0-1]-cpushm_1"]
    worker = "vllm_dist_ab12-tp:0-[0-1]-cpushm_2"
    other_kind = "psm_1a2b3c4d"  # Python SharedMemory: the resource tracker's to remove
    theirs = "vllm_dist_cd34-tp:0-[0-1]-cpushm_0"
    mapper = MAPPER.replace("sys.argv[1:]", "sys.argv[3:]")
    child = subprocess.Popen([sys.executable, "-c", ENGINE, os.path.join(d, worker), mapper,
                              *(os.path.join(d, n) for n in [*mine, other_kind])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert int(child.stdout.readline()) == child.pid
    out = subprocess.run([sys.executable, "-c", STRANGER, MAPPER, os.path.join(d, theirs)],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    stranger = int(out.stdout.strip())
    try:
        assert child.pid in descendants(os.getpid()) and stranger not in descendants(os.getpid())
        watch = SegmentWatch(d, period_s=0.05).start()
        watch.note()
        assert sorted(os.path.basename(p) for p in watch.noted) == sorted([*mine, worker])
        child.send_signal(signal.SIGKILL)  # as vLLM's process manager ends the engine core
        child.wait(60)
        removed = watch.finish(wait_s=5)  # after the worker, no descendant now, is gone
        assert sorted(os.path.basename(p) for p in removed) == sorted([*mine, worker])
        assert sorted(os.listdir(d)) == sorted([other_kind, theirs])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(60)
        os.kill(stranger, signal.SIGKILL)
