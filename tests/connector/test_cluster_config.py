"""connector/config.py: the ``cluster`` key, refused at parse time when wrong."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ecoffload.connector.config import CLUSTER_DEFAULTS, ClusterConfig, OffloadConfig
from ecoffload.engine.base.errors import ConfigError
from ecoffload.engine.cluster.value import random_key_file

GOOD = {"master": "10.0.0.1:50051", "metadata": "http://10.0.0.1:8080/metadata"}


@pytest.mark.parametrize(
    "value,match",
    [
        ("10.0.0.1:50051", "must be a dict"),
        ({**GOOD, "mastr": 1}, "unknown cluster key"),
        ({"metadata": GOOD["metadata"]}, "cluster.master"),
        ({**GOOD, "master": "10.0.0.1"}, "cluster.master"),
        ({**GOOD, "master": "10.0.0.1:99999"}, "cluster.master"),
        ({"master": GOOD["master"]}, "cluster.metadata"),
        ({**GOOD, "metadata": "P2PHANDSHAKE"}, "cluster.metadata"),
        ({**GOOD, "metadata": "http://10.0.0.1/metadata"}, "metadata's host:port"),
        ({**GOOD, "protocol": "rdma"}, "cluster.protocol"),
        ({**GOOD, "segment_bytes": "lots"}, "segment_bytes"),
        ({**GOOD, "segment_bytes": 0}, "segment_bytes"),
        ({**GOOD, "key_file": "/no/such/key"}, "key_file"),
        ({**GOOD, "fetch_timeout_s": 0}, "fetch_timeout_s"),
        ({**GOOD, "fetch_timeout_s": True}, "fetch_timeout_s"),
        ({**GOOD, "publish": "yes"}, "cluster.publish"),
        ({**GOOD, "publish_queue": -1}, "publish_queue"),
        ({**GOOD, "host": ""}, "cluster.host"),
    ],
    ids=["not-a-dict", "unknown-key", "no-master", "master-no-port", "master-port-range",
         "no-metadata", "metadata-not-http", "metadata-no-port", "rdma", "segment-garbage",
         "segment-zero", "key-file-missing", "timeout-zero", "timeout-bool", "publish-string",
         "queue-negative", "empty-host"],
)  # fmt: skip
def test_bad_cluster_config_is_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_value(value)
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_extra_config({"cluster": value}, default_name="e")


def test_a_key_file_too_short_is_refused_and_a_real_one_taken(tmp_path):
    short = tmp_path / "short"
    short.write_text("secret\n")
    with pytest.raises(ConfigError, match="at least 16"):
        ClusterConfig.from_value({**GOOD, "key_file": str(short)})
    key = random_key_file(str(tmp_path / "key"))
    assert ClusterConfig.from_value({**GOOD, "key_file": key}).key_file == key


def test_defaults_and_disabled():
    assert ClusterConfig.from_value(None) is None
    assert OffloadConfig.from_extra_config({}, default_name="e").cluster is None
    assert ClusterConfig.from_value(GOOD) == ClusterConfig(
        GOOD["master"], GOOD["metadata"], None, "tcp", 1 << 30, None, 5.0, True, 256
    )
    got = ClusterConfig.from_value({**GOOD, "segment_bytes": "64MiB", "publish": False})
    assert (got.segment_bytes, got.publish) == (64 << 20, False)


ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers()),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(CLUSTER_DEFAULTS)), bad=ANY)
def test_any_value_of_any_key_is_a_config_or_a_config_error(key, bad):
    try:
        got = ClusterConfig.from_value({**GOOD, key: bad})
    except ConfigError:
        return
    assert isinstance(got, ClusterConfig) and got.fetch_timeout_s > 0
    assert got.segment_bytes > 0 and math.isfinite(got.fetch_timeout_s)


def test_a_key_file_other_users_can_read_is_warned_about(tmp_path, caplog):
    import logging
    import os

    caplog.set_level(logging.WARNING)
    key = random_key_file(str(tmp_path / "key"))
    ClusterConfig.from_value({**GOOD, "key_file": key})
    assert not [r for r in caplog.records if "key_file" in r.getMessage()]
    os.chmod(key, 0o644)
    ClusterConfig.from_value({**GOOD, "key_file": key})
    said = [r.getMessage() for r in caplog.records if "key_file" in r.getMessage()]
    assert len(said) == 1 and "mode 644" in said[0] and "chmod 600" in said[0]


def test_a_key_file_written_over_an_open_one_is_made_private(tmp_path):
    import os

    path = tmp_path / "key"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    random_key_file(str(path))
    assert os.stat(path).st_mode & 0o077 == 0
