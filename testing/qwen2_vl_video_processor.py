"""Qwen2-VL's video preprocessing in torch alone: the tiny Qwen2-VL's own processor code.

transformers 5's video processors need torchvision (``tvF.resize``, ``tvF.normalize``),
which does not load beside torch+cpu, so on a CPU host vLLM can serve Qwen2-VL images
(a PIL image processor exists) but no video. :func:`.tiny_qwen2_vl.build_tiny_qwen2_vl`
copies this file into the model's folder as its processor code (``auto_map``; the
server runs with ``--trust-remote-code``): it resizes with ``torch.nn.functional``
(bicubic, antialiased), rescales, normalises and cuts the frames into Qwen2-VL's
patches in the order its image processor does (a still video's patches equal the
image processor's: ``tests/testing/test_tiny_qwen2_vl.py``). Frames are taken as
given (vLLM samples them when it decodes the video).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

# Without torchvision, transformers exports no VideoProcessorMixin, and a processor checks
# its video processor against that name: every video processor would be refused.
if not hasattr(transformers, "VideoProcessorMixin"):
    transformers.VideoProcessorMixin = VideoProcessorMixin  # type: ignore[attr-defined]


class TinyQwen2VLVideoProcessor(BaseVideoProcessor):
    """Frames ``(T, 3, H, W)`` -> ``pixel_values_videos`` and ``video_grid_thw``."""

    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    resample = 3  # bicubic (the base class insists on one when resizing)
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_sample_frames = False
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def convert_to_rgb(self, video: Any) -> Any:
        """Grey frames to three channels (the base class does it with torchvision)."""
        if video.shape[-3] == 1:
            return video.expand(*video.shape[:-3], 3, *video.shape[-2:])
        return video[..., :3, :, :]

    def _preprocess(  # type: ignore[override]
        self,
        videos: list[torch.Tensor],
        do_resize: bool,
        size: Any,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: list[float],
        image_std: list[float],
        patch_size: int | None = None,
        temporal_patch_size: int | None = None,
        merge_size: int | None = None,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        patch = patch_size or self.patch_size
        merge = merge_size or self.merge_size
        frames_per_patch = temporal_patch_size or self.temporal_patch_size
        mean = torch.tensor(image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(image_std, dtype=torch.float32).view(1, 3, 1, 1)
        flat, grids = [], []
        for video in videos:  # (T, 3, H, W), uint8
            frames = video.to(torch.float32)
            if do_resize:  # transformers' own rule, the one vLLM counts a video's tokens by
                h, w = smart_resize(frames.shape[-2], frames.shape[-1], patch * merge,
                                    size.shortest_edge, size.longest_edge)  # fmt: skip
                frames = F.interpolate(frames, size=(h, w), mode="bicubic", antialias=True)
                frames = frames.clamp(0, 255).round()  # as uint8 frames would be
            if do_rescale:
                frames = frames * rescale_factor
            if do_normalize:
                frames = (frames - mean) / std
            if pad := -frames.shape[0] % frames_per_patch:  # the last frame, repeated
                frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
            t, c, h, w = frames.shape
            gt, gh, gw = t // frames_per_patch, h // patch, w // patch
            # (t, merge rows, merge columns) outermost, each patch's values channel-first,
            # then its frames, rows and columns: the layout of Qwen2-VL's patch embedding
            patches = frames.view(gt, frames_per_patch, c, gh // merge, merge, patch,
                                  gw // merge, merge, patch)  # fmt: skip
            patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            flat.append(patches.reshape(gt * gh * gw, c * frames_per_patch * patch * patch))
            grids.append([gt, gh, gw])
        data = {"pixel_values_videos": torch.cat(flat), "video_grid_thw": torch.tensor(grids)}
        return BatchFeature(data=data, tensor_type=return_tensors)
