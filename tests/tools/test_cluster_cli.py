"""``ecoffload cluster``: the cluster tier's store as an instance would see it."""

import json
import subprocess
import sys
import time

import pytest

from ecoffload.engine.cluster.master import MasterProcess
from ecoffload.engine.cluster.store import store_missing

pytestmark = pytest.mark.skipif(bool(store_missing()), reason=str(store_missing()))


def cluster(*args):
    proc = subprocess.run([sys.executable, "-m", "ecoffload.tools.cli", "cluster", *args, "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return proc.returncode, json.loads(proc.stdout)


def test_a_running_master_is_reported_available(tmp_path):
    with MasterProcess(log_path=str(tmp_path / "master.log")) as m:
        rc, report = cluster(m.address, m.metadata)
    assert rc == 0 and report["available"] is True
    assert report["master_reachable"] and report["metadata_reachable"]


def test_a_master_that_is_not_there_is_reported_unavailable_at_once(tmp_path):
    m = MasterProcess(log_path=str(tmp_path / "master.log"))  # ports picked, not started
    t = time.monotonic()
    rc, report = cluster(m.address, m.metadata)
    assert rc == 1 and report["available"] is False
    assert not report["master_reachable"] and not report["metadata_reachable"]
    assert time.monotonic() - t < 30
