"""A stranger's NIXL agent, for tests/connector/test_nixl_doors.py (another network namespace).

    python nixl_stranger.py '<json>'

The JSON says what the stranger knows: ``host`` (the victims' address),
``ports`` (every TCP port their process listens on), ``names`` (their agents'
names; "wrong-name" is tried too), ``targets`` ([address, nbytes] in their
processes: worst case, it knows where their arenas are) and ``seconds`` to keep
trying. For that long it asks every (name, port) for metadata through NIXL's
listener protocol; for every agent whose metadata it obtains it READs and
WRITEs 16 bytes at every target. The last line of stdout is JSON: the names it
got metadata for, and the (name, address) pairs it read and wrote.
"""

import json
import mmap
import sys
import time

import numpy as np

from ecoffload.engine.remote.nixl_setup import load_nixl

FORGED = bytes(range(0xE0, 0xF0))  # 16 bytes the victim's arena never holds


def transfer(agent, op, local_addr, remote_addr, nbytes, name) -> bool:
    try:
        h = agent.initialize_xfer(
            op,
            agent.get_xfer_descs([(local_addr, nbytes, 0)], "DRAM"),
            agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM"),
            name,
        )
        state = agent.transfer(h)
        deadline = time.monotonic() + 5
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = agent.check_xfer_state(h)
        return state == "DONE"
    except Exception:
        return False


def main(knows: dict) -> dict:
    api = load_nixl()
    config = api.nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=True, listen_port=0, backends=["UCX"]
    )  # NIXL's metadata answers come back to the asker's own listener
    agent = api.nixl_agent("stranger", config)
    buf = np.frombuffer(mmap.mmap(-1, 1 << 20), dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    got, read, wrote = set(), set(), set()
    names = list(knows["names"]) + ["wrong-name"]
    deadline = time.monotonic() + knows["seconds"]
    while time.monotonic() < deadline:
        for port in knows["ports"]:
            for name in names:
                if name in got:
                    continue
                try:
                    agent.fetch_remote_metadata(name, knows["host"], port)
                except Exception:
                    continue
        time.sleep(0.5)
        for name in names:
            try:
                if name not in got and agent.check_remote_metadata(name):
                    got.add(name)
            except Exception:
                pass
        for name in sorted(got):
            for addr, nbytes in knows["targets"]:
                if (name, addr) not in read and transfer(
                    agent, "READ", buf.ctypes.data, addr, min(nbytes, 4096), name
                ):
                    read.add((name, addr))
                buf[4096 : 4096 + 16] = np.frombuffer(FORGED, dtype=np.uint8)
                if (name, addr) not in wrote and transfer(
                    agent, "WRITE", buf.ctypes.data + 4096, addr, 16, name
                ):
                    wrote.add((name, addr))
    return {"metadata": sorted(got), "read": sorted(read), "wrote": sorted(wrote)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
