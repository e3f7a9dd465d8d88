"""A NIXL producer in its own process (ecoffload.testing.remote_producer), for the
remote and connector tests."""

import base64
import os
import subprocess
import sys


def start_producer(arena_dir, block_bytes, num_blocks, seed, env=None):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecoffload.testing.remote_producer", arena_dir,
         f"prod-{os.getpid()}", str(block_bytes), str(num_blocks), str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})},
    )  # fmt: skip
    for line in proc.stdout:
        if line.startswith("META "):
            return proc, base64.b64decode(line[5:])
    proc.kill()
    raise AssertionError(f"producer exited ({proc.wait()}) without its metadata")


def stop_producer(proc):
    """Close its stdin (it exits), collect its notifications."""
    proc.stdin.close()
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0
    return [tuple(line.split()[1:]) for line in out.splitlines() if line.startswith("NOTIF ")]
