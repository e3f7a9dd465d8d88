"""Loading NIXL and choosing where its UCX transport listens: the NIXL module (any of
the wheels that ship it), which UCX modules load, this host's interface for an
address, its RDMA ports, and ``UCX_NET_DEVICES`` while a backend reads its
configuration.

UCX modules: on a host with the RDMA user library (``libibverbs1``) installed
but no RDMA device (the usual cloud VM), the UCX bundled in nixl-cu12 1.5.1
loads its InfiniBand modules and every process that created an agent dies with
SIGSEGV at exit. :func:`load_nixl` therefore sets ``UCX_MODULES`` to
:data:`NO_RDMA_UCX_MODULES` before NIXL is imported, only where
``/sys/class/infiniband`` names no device (a host with one keeps RDMA) and only
where the operator has not set ``UCX_MODULES`` (theirs wins). The setting is
process-wide and inherited by child processes: UCX loads its modules once.

Kept apart from :mod:`.peer` (the peer and its transfers): this is the part an
operator reads to know which interfaces and ports a peer opens (README "Security").
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import glob
import importlib
import os
import socket
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from ..base.errors import NixlNotInstalledError, RemotePeerError

_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
RDMA_CLASS_DIR = "/sys/class/infiniband"
# UCX module globs kept unloaded on a host without an RDMA device ("^": all but these).
NO_RDMA_UCX_MODULES = "^ib,rdmacm,mlx5,rdma"


def rdma_devices() -> list[str]:
    """Names of this host's RDMA devices (``mlx5_0``, ...), as the kernel lists them."""
    try:
        return sorted(os.listdir(RDMA_CLASS_DIR))
    except OSError:
        return []


def ucx_modules_setting(environ: Mapping[str, str], devices: list[str]) -> str | None:
    """The ``UCX_MODULES`` value to set before UCX loads, or None to leave it alone: the
    operator's own ``UCX_MODULES`` wins; a host with an RDMA device keeps every module."""
    if "UCX_MODULES" in environ or devices:
        return None
    return NO_RDMA_UCX_MODULES


def configure_ucx() -> str | None:
    """Apply :func:`ucx_modules_setting` to this process's environment (before any NIXL
    agent exists); returns the value it set, or None."""
    value = ucx_modules_setting(os.environ, rdma_devices())
    if value is not None:
        os.environ["UCX_MODULES"] = value
    return value


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl``, else ``nixl_cu12``, else ``nixl_cu13``),
    with UCX configured for this host first (:func:`configure_ucx`)."""
    configure_ucx()
    tried = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            tried.append(f"{name}: {exc}")
    raise NixlNotInstalledError(
        "remote arena transfers need NIXL, which is not importable ("
        + "; ".join(tried)
        + "): install it with `pip install ecoffload[nixl]` (nixl-cu12), or the nixl "
        "package your vLLM uses"
    )


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlNotInstalledError:
        return False
    return True


def outward_ip() -> str:
    """The address of the interface that routes outwards (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


_SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str:
    """The name of the local network interface whose IPv4 address is ``host``
    (what UCX's ``NET_DEVICES`` takes); raises RemotePeerError if none has it."""
    try:
        want = socket.inet_aton(socket.gethostbyname(host))
    except OSError as exc:
        raise RemotePeerError(f"nixl host {host!r} is not an IPv4 address ({exc})") from None
    seen = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address
            addr = bytes(req[20:24])
            seen.append(f"{name}={socket.inet_ntoa(addr)}")
            if addr == want:
                return name
    raise RemotePeerError(
        f"no local interface has the address {host!r} (interfaces: {', '.join(seen)}): "
        "set nixl.host to this host's address on the network the other hosts reach"
    )


def rdma_ports() -> list[str]:
    """UCX names (``mlx5_0:1``) of this host's RDMA ports: kept usable when ``host``
    narrows UCX to one IP interface (RDMA opens no TCP port)."""
    out = []
    for dev in sorted(glob.glob(f"{RDMA_CLASS_DIR}/*/ports/*")):
        parts = dev.split("/")
        out.append(f"{parts[-3]}:{parts[-1]}")
    return out


@contextlib.contextmanager
def net_devices(devices: str | None) -> Iterator[None]:
    """``UCX_NET_DEVICES=devices`` while a UCX backend reads its configuration (NIXL's
    engine_config cannot carry a list); an operator's own UCX_NET_DEVICES wins."""
    if devices is None or "UCX_NET_DEVICES" in os.environ:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = devices
    try:
        yield
    finally:
        del os.environ["UCX_NET_DEVICES"]
