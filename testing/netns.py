"""A second test host on this machine: a network namespace joined to this one by a veth pair.

This host gets ``here`` and the namespace ``there``, two addresses of a private /30
that exists only inside this machine; the namespace has no other route, so its
traffic goes only between those two addresses (its loopback is up for the
processes' own local sockets). Creating one needs root and iproute2; where either
is missing, or namespaces are refused (a container without CAP_NET_ADMIN),
:func:`second_host` raises :class:`NoTestHost` saying which, for the caller to skip
with. Both ends and the namespace are deleted on exit, whatever happened::

    with second_host("ecoff-x", "10.213.38.0") as host:
        subprocess.run(host.exec_prefix() + ["python", "-c", "..."])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class NoTestHost(RuntimeError):
    """A namespace test host cannot be made here; the message says why."""


@dataclass(frozen=True)
class TestHost:
    """The namespace ``ns``; ``here`` is this host's address, ``there`` the namespace's."""

    __test__ = False  # not a pytest test class

    ns: str
    here: str
    there: str

    def exec_prefix(self) -> list[str]:
        """Prepended to a command line, runs it inside the namespace (same pid: it execs)."""
        return ["ip", "netns", "exec", self.ns]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS`` (bounded), its output captured."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


@contextlib.contextmanager
def second_host(prefix: str, net: str) -> Iterator[TestHost]:
    """A namespace named ``prefix-<pid>`` on the /30 ``net`` (``"a.b.c.0"``: ``.1`` here,
    ``.2`` there). Raises :class:`NoTestHost` where it cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NoTestHost("a second test host needs root and iproute2 (ip netns)")
    base = net.rsplit(".", 1)[0]
    here, there = f"{base}.1", f"{base}.2"
    tag = f"{os.getpid() % 100000}"
    ns, end_here, end_there = f"{prefix}-{tag}", f"ecv{tag}a", f"ecv{tag}b"
    try:
        ip("netns", "add", ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        raise NoTestHost(
            f"network namespaces are refused here: {getattr(exc, 'stderr', exc)}"
        ) from None
    try:
        ip("link", "add", end_here, "type", "veth", "peer", "name", end_there)
        ip("link", "set", end_there, "netns", ns)
        ip("addr", "add", f"{here}/30", "dev", end_here)
        ip("link", "set", end_here, "up")
        ip("-n", ns, "addr", "add", f"{there}/30", "dev", end_there)
        ip("-n", ns, "link", "set", end_there, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        deadline = time.monotonic() + 10
        while (
            Path(f"/sys/class/net/{end_here}/operstate").read_text().strip() != "up"
            or "linkdown" in ip("-4", "route", "show", "dev", end_here).stdout
            or f"{net}/30" not in ip("-4", "route", "show", "dev", end_here).stdout
        ):  # UCX and Mooncake check the route before they use the interface
            if time.monotonic() > deadline:
                raise NoTestHost(f"the veth end {end_here} never came up")
            time.sleep(0.05)
        time.sleep(0.5)  # and read it through netlink: let the kernel settle
        yield TestHost(ns, here, there)
    finally:
        ip("netns", "del", ns, check=False)  # takes the veth pair with it
        ip("link", "del", end_here, check=False)


def leftovers(host: TestHost) -> list[str]:
    """What is left of ``host`` after :func:`second_host` exited: its namespace or an
    interface holding its address (empty when everything is gone)."""
    left = [host.ns] if host.ns in ip("netns", "list", check=False).stdout.split() else []
    return left + [line for line in ip("-o", "-4", "addr").stdout.splitlines() if host.here in line]
