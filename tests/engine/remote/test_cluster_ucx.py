"""engine/remote/nixl_setup.py: UCX's modules on a host with the RDMA library and no RDMA device.

The cluster tier's store (Mooncake) needs ``libibverbs1``; with it installed and
no RDMA device, nixl-cu12 1.5.1's bundled UCX segfaults at the exit of every
process that created an agent. The product keeps UCX's InfiniBand modules
unloaded there (``UCX_MODULES``), leaves them on where a device exists, and
never overrides an operator's own ``UCX_MODULES``.
"""

import ctypes.util
import os
import subprocess
import sys

import pytest

from ecoffload.engine.remote import nixl_setup
from ecoffload.engine.remote.nixl_setup import (
    NO_RDMA_UCX_MODULES,
    nixl_available,
    ucx_modules_setting,
)

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install ecoffload[nixl]"
)

BARE_AGENT = """
from ecoffload.engine.remote.nixl_setup import load_nixl
api = load_nixl()
config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                               backends=["UCX"])
agent = api.nixl_agent("bare", config)
print("agent made", flush=True)
"""


def test_no_device_and_no_operator_setting_turns_rdma_modules_off():
    assert ucx_modules_setting({}, []) == NO_RDMA_UCX_MODULES
    assert ucx_modules_setting({"UCX_TLS": "tcp"}, []) == NO_RDMA_UCX_MODULES


def test_a_device_keeps_every_module():
    assert ucx_modules_setting({}, ["mlx5_0"]) is None


def test_the_operator_s_ucx_modules_wins():
    assert ucx_modules_setting({"UCX_MODULES": "ib"}, []) is None
    assert ucx_modules_setting({"UCX_MODULES": ""}, ["mlx5_0"]) is None


def test_configure_reads_the_host_s_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    monkeypatch.setattr(nixl_setup, "RDMA_CLASS_DIR", str(tmp_path / "infiniband"))
    assert nixl_setup.configure_ucx() == NO_RDMA_UCX_MODULES  # no such folder: no device
    assert os.environ["UCX_MODULES"] == NO_RDMA_UCX_MODULES

    monkeypatch.delenv("UCX_MODULES")
    (tmp_path / "infiniband" / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    assert nixl_setup.configure_ucx() is None
    assert "UCX_MODULES" not in os.environ
    assert nixl_setup.rdma_ports() == ["mlx5_0:1"]

    monkeypatch.setenv("UCX_MODULES", "^cuda")
    monkeypatch.setattr(nixl_setup, "RDMA_CLASS_DIR", str(tmp_path / "none"))
    assert nixl_setup.configure_ucx() is None
    assert os.environ["UCX_MODULES"] == "^cuda"


@needs_nixl
def test_a_bare_agent_s_process_exits_cleanly():
    # Run where libibverbs is installed (CI here) this fails without configure_ucx:
    # the process dies with SIGSEGV (-11) after the agent was made.
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    proc = subprocess.run(
        [sys.executable, "-c", BARE_AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    ibverbs = ctypes.util.find_library("ibverbs") or "not installed"
    assert "agent made" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0, (
        f"a process with one NIXL agent exited {proc.returncode} (libibverbs: {ibverbs}, "
        f"RDMA devices: {nixl_setup.rdma_devices()}): {proc.stderr[-2000:]}"
    )
