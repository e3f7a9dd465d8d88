"""Starting a ``mooncake_master`` (the wheel's command) on one address: for tests,
benchmarks and a single-host trial. A deployment runs its own master (README
"Beyond the host: the cluster tier").

The master serves its RPC port (clients' object metadata), its HTTP metadata
server (where clients publish their transfer endpoints and segments) and a
metrics port, all bound to ``host``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from ..base.errors import ClusterNotInstalledError


def master_binary() -> str:
    """Path of ``mooncake_master`` (beside this Python, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = here if os.access(here, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise ClusterNotInstalledError(
            "mooncake_master is not installed: pip install ecoffload[cluster] "
            "(mooncake-transfer-engine-non-cuda) ships it"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reachable(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a TCP connection to (host, port) opens within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MasterProcess:
    """One ``mooncake_master`` child process with its HTTP metadata server.

    Ports are picked free on ``host`` unless given; :meth:`start` again after
    :meth:`kill` restarts it on the same ports (its objects are gone: the master
    keeps them in memory only)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        log_path: str = os.devnull,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_path = log_path
        self.extra_flags = extra_flags
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (the ``cluster.master`` key)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        """URL of its HTTP metadata server (the ``cluster.metadata`` key)."""
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [
            master_binary(),
            f"-rpc_port={self.rpc_port}",
            f"-rpc_address={self.host}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            *self.extra_flags,
        ]

    def start(self, timeout_s: float = 20.0) -> MasterProcess:
        """Start it and wait until both its ports accept connections."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited {self.proc.returncode} at start ({self.command()}): "
                    f"see {self.log_path}"
                )
            if reachable(self.host, self.rpc_port, 0.2) and reachable(
                self.host, self.http_port, 0.2
            ):
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"mooncake_master did not open its ports within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL it (and wait): what a crash looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
