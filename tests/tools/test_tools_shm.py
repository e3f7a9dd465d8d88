"""``ecoffload shm``: the segments of a shared-memory directory, and removing the leaked ones.

A private directory stands for /dev/shm. Segments named as vLLM and Python
name theirs are left by processes that exited (leaked), or held by live child
processes: one that only maps its segment (its descriptor closed), one that
only has it open (never mapped); a persistent ecoffload arena nobody holds
sits beside them. The installed console script must list every one with its
holders and remove only the leaked ones (the arena only when named).
"""

import json
import os
import subprocess
import sys
import sysconfig

from ecoffload.engine.arena.arena import Arena

B = 4096

# Writes a segment, maps it, then exits without removing it (a killed server's leftover).
LEAVER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, int(sys.argv[2]))
m = mmap.mmap(fd, int(sys.argv[2]))
m[:4] = b"data"
os._exit(0)
"""

# Holds a segment until stdin closes: mapped only ("map") or open only ("fd").
HOLDER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 2 * 4096)
if sys.argv[2] == "map":
    m = mmap.mmap(fd, 2 * 4096)
    m[:4] = b"data"
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def ecoffload(*args):
    """The installed console script with ``--json``: exit code, parsed output, stderr."""
    script = os.path.join(sysconfig.get_path("scripts"), "ecoffload")
    out = subprocess.run([script, *args, "--json"], capture_output=True, text=True, timeout=300)
    return out.returncode, (json.loads(out.stdout) if out.stdout.strip() else None), out.stderr


def test_shm_lists_every_segment_and_removes_only_the_leaked_ones(arena_dir):
    leaked = {"psm_4f1c2a": 3 * B, "vllm_dist_9e3b-0-[0-1]-cpushm": 5 * B, "sem.mp-x1y2z3": 32}
    for name, size in leaked.items():
        subprocess.run([sys.executable, "-c", LEAVER, os.path.join(arena_dir, name), str(size)],
                       check=True, timeout=60)  # fmt: skip
    holders = {}
    for name, how in (("psm_mapped", "map"), ("psm_opened", "fd")):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, os.path.join(arena_dir, name), how],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert p.stdout.readline().strip() == "ready"
        holders[name] = p
    try:
        with Arena.open_shared("kept", block_bytes=B, num_blocks=4, directory=arena_dir,
                               register_cuda="never", persistent=True):  # fmt: skip
            pass  # closed: nobody holds it, it stays
        code, report, err = ecoffload("shm", "--dir", arena_dir)
        assert code == 0, err
        rows = {s["name"]: s for s in report["segments"]}
        assert set(rows) == {*leaked, *holders, "kept"}
        for name, size in leaked.items():
            row = rows[name]
            assert row["leaked"] and row["holders"] == [] and not row["persistent"]
            assert row["size_bytes"] == size and 0 <= row["age_s"] < 600
        assert rows["psm_4f1c2a"]["kind"] == "vllm-psm"
        assert "multiprocessing.shared_memory" in rows["psm_4f1c2a"]["creator"]
        assert rows["vllm_dist_9e3b-0-[0-1]-cpushm"]["kind"] == "vllm-cpushm"
        assert rows["sem.mp-x1y2z3"]["kind"] == "mp-semaphore"
        for name, p in holders.items():  # mapped only, or open only: held either way
            assert rows[name]["holders"] == [p.pid] and not rows[name]["leaked"], name
        assert rows["kept"]["kind"] == "ecoffload-arena" and rows["kept"]["persistent"]
        assert rows["kept"]["leaked"] and rows["kept"]["holders"] == []
        assert report["leaked_bytes"] == sum(rows[n]["allocated_bytes"] for n in leaked)

        code, report, err = ecoffload("shm", "--dir", arena_dir, "--remove")
        assert code == 0, err
        assert sorted(report["removed"]) == sorted(leaked)
        assert sorted(os.listdir(arena_dir)) == sorted([*holders, "kept"])

        code, report, err = ecoffload("shm", "--dir", arena_dir, "--remove", "psm_opened")
        assert code == 1 and report is None
        assert err.strip() == (
            f"ecoffload shm: segment {os.path.join(arena_dir, 'psm_opened')} is held (by "
            f"{holders['psm_opened'].pid}): stop them first"
        )
        code, report, err = ecoffload("shm", "--dir", arena_dir, "--remove", "kept")
        assert code == 0 and report["removed"] == ["kept"], err
        assert sorted(os.listdir(arena_dir)) == sorted(holders)
    finally:
        for p in holders.values():
            p.stdin.close()
            p.wait(60)
        for name in os.listdir(arena_dir):
            os.unlink(os.path.join(arena_dir, name))
