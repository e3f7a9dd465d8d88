"""A tiny, randomly initialised Qwen2-VL that vLLM's CPU build serves images and video with.

The video item of the end-to-end tests (PaliGemma takes images only). The model:
a Qwen2-VL vision tower (patch 14, 2 x 2 patches merged into one token, 2 frames
per temporal patch; 1 layer, width 32) and a Qwen2 text model (width 128, so an
item is ``(tokens, 128)``; 2 layers), vocab 512 (byte-level, no merges), ~0.6 M
parameters, float32 weights from transformers' own initialisation under a seed
(a large std, so greedy output depends on the item). Images and frames are resized
to 56 x 56 .. 112 x 112 pixels: an image is 4-16 tokens, a 4-frame video 8-32.

The video processor is :mod:`.qwen2_vl_video_processor`, copied into the model's
folder as its processor code (transformers' needs torchvision): serve it with
:data:`SERVE_ARGS` (``--trust-remote-code`` among them). The CPU build's twin alias
(``ecoffload.connector.cpu_build``) loads vLLM's ``qwen2_vl.py`` without torchvision.

    path = build_tiny_qwen2_vl(tmpdir, seed=0)
    Server.start(path, connector=True, extra_args=SERVE_ARGS)   # .vllm_serve
    chat(client, make_videos(1)[0])                               # a video_url part
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from . import qwen2_vl_video_processor

VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
INIT_STD = 0.5  # large on purpose: makes greedy output depend on the item
#: Qwen's chat layout; an image or a video part becomes its placeholder, which vLLM
#: expands to the item's tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: What ``ecoffload-vllm serve`` needs beside :func:`.vllm_serve.server_command`'s
#: (later flags win): the processor code, the chat layout, an image and a video a prompt.
SERVE_ARGS = (
    "--trust-remote-code",
    "--chat-template", CHAT_TEMPLATE,
    "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 1}),
)  # fmt: skip
PROCESSOR_FILE = "video_processing_tiny_qwen2_vl.py"


def _vocab() -> dict[str, int]:
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + SPECIALS
    tokens += [f"<|unused{i}|>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == len(set(tokens)) == VOCAB_SIZE
    return {t: i for i, t in enumerate(tokens)}


def _write_tokenizer(out_dir: str) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = _vocab()
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _dump(out_dir, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                 "vision_bos_token": "<|vision_start|>",
                                 "vision_eos_token": "<|vision_end|>"},
    })  # fmt: skip
    return vocab


def _dump(out_dir: str, name: str, obj: object) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def build_tiny_qwen2_vl(out_dir: str, seed: int = 0) -> str:
    """Write a random Qwen2-VL (config, weights, tokenizer, processors) to ``out_dir``.

    Returns the absolute path; deterministic for a given ``seed`` (about a second)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    vocab = _write_tokenizer(out_dir)
    text = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        # M-RoPE: the head's 32 frequency pairs split over time, height and width
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, rope_theta=10000.0,
        bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
        initializer_range=INIT_STD,
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=128, mlp_ratio=2, num_heads=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  initializer_range=INIT_STD)  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out_dir)
    shared = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}  # fmt: skip
    _dump(out_dir, "preprocessor_config.json", {
        **shared, "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor", "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS, "resample": 3, "rescale_factor": 1 / 255,
    })  # fmt: skip
    shutil.copyfile(qwen2_vl_video_processor.__file__, os.path.join(out_dir, PROCESSOR_FILE))
    _dump(out_dir, "video_preprocessor_config.json", {
        **shared, "video_processor_type": "TinyQwen2VLVideoProcessor", "do_sample_frames": False,
        "auto_map": {"AutoVideoProcessor":
                     f"{PROCESSOR_FILE.removesuffix('.py')}.TinyQwen2VLVideoProcessor"},
    })  # fmt: skip
    _dump(out_dir, "processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    return out_dir


def make_videos(count: int, *, frames: int = 4, width: int = 80, height: int = 60,
                seed: int = 0) -> list[bytes]:  # fmt: skip
    """``count`` distinct MP4 files (random frames, 4 fps), as the bytes a client sends."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    videos = []
    with tempfile.TemporaryDirectory(prefix="ecoffload-video-") as tmp:
        path = os.path.join(tmp, "video.mp4")
        for _ in range(count):
            writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), 4.0, (width, height))
            if not writer.isOpened():
                raise RuntimeError("expected OpenCV to write MP4 (mp4v); it could not: "
                                   "install opencv-python-headless with its FFmpeg")  # fmt: skip
            for _ in range(frames):  # blocks of colour, so the codec keeps them apart
                small = rng.integers(0, 256, (height // 10, width // 10, 3), dtype=np.uint8)
                writer.write(cv2.resize(small, (width, height), interpolation=cv2.INTER_NEAREST))
            writer.release()
            with open(path, "rb") as f:
                videos.append(f.read())
    return videos
