"""A tiny, randomly initialised PaliGemma that vLLM's CPU build loads offline.

Used by the demo and the end-to-end test (no model hub exists there). The model:
SigLIP vision tower (112 px, patch 14 -> 64 image tokens, hidden 32, 1 layer),
a linear projector and a Gemma text model (hidden 128, 2 layers), vocab 1536,
~0.45 M parameters. ``vision="siglip-base"`` builds the same model around a
SigLIP-base-sized tower (224 px, patch 16 -> 196 tokens, hidden 768, 12 layers)
and a 640-wide Gemma (:data:`SIGLIP_BASE`), for time-to-first-token figures;
``vision="siglip-so400m"`` around PaliGemma's own tower's geometry (224 px, patch
14 -> 256 tokens, hidden 1152, 27 layers) and a 2048-wide Gemma (:data:`SIGLIP_SO400M`).
Weights come from a seeded generator, so a seed always gives the same
checkpoint; a large init std makes greedy output depend on the image.

    cpu_build.install()                 # ecoffload.connector: before `LLM(...)` without torchvision
    path = build_tiny_paligemma(tmpdir, seed=0)
    LLM(model=path, enforce_eager=True, max_model_len=1024, ...)

vLLM 0.32's pixtral.py imports ``transformers.models.pixtral.image_processing_pixtral``,
which needs torchvision; PyPI's torchvision does not load beside torch+cpu.
``ecoffload.connector.cpu_build`` aliases its PIL twin, in this process and in
vLLM's children (``ecoffload-vllm`` does that itself).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class VlmGeometry:
    """The shape of a generated PaliGemma: the one source every file and check reads."""

    image_size: int
    patch_size: int
    vision_hidden: int
    vision_inter: int
    vision_layers: int
    vision_heads: int
    text_hidden: int  # also the projector's output: the row width of one cached item
    text_inter: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    # Weight std of the vision tower. The tiny tower's large one makes greedy output
    # depend on the image; a 12-layer tower gets a realistic one (its output still
    # does: four images gave four different greedy answers through vllm serve).
    vision_init_std: float = 0.5

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image: one per patch."""
        return (self.image_size // self.patch_size) ** 2


#: The tiny default the tests and the demo use (~0.45 M parameters, 64 tokens).
TINY = VlmGeometry(
    image_size=112, patch_size=14, vision_hidden=32, vision_inter=64, vision_layers=1,
    vision_heads=2, text_hidden=128, text_inter=256, text_layers=2, text_heads=2,
    text_kv_heads=1, head_dim=64,
)  # fmt: skip
#: A SigLIP-base-sized tower (google/siglip-base-patch16-224: 224 px, patch 16 ->
#: 196 tokens, hidden 768, 12 layers, 12 heads, MLP 3072; ~86 M parameters) in front
#: of a small Gemma: 640 wide (Gemma 3 270M's width, so an item is 196 x 640, a small
#: VLM's row) but 2 layers, so the prefill stays a small share of the time to first
#: token and what a repeated image saves is the encoder.
SIGLIP_BASE = VlmGeometry(
    image_size=224, patch_size=16, vision_hidden=768, vision_inter=3072, vision_layers=12,
    vision_heads=12, text_hidden=640, text_inter=2048, text_layers=2, text_heads=10,
    text_kv_heads=2, head_dim=64, vision_init_std=0.02,
)  # fmt: skip
#: PaliGemma's own tower, SigLIP-so400m (google/siglip-so400m-patch14-224: 224 px,
#: patch 14 -> 256 tokens, hidden 1152, 27 layers, 16 heads, MLP 4304; ~412 M
#: parameters, a 1.65 GB float32 checkpoint), in front of a Gemma as wide as
#: PaliGemma's Gemma-2B (2048: an item is 256 x 2048, 1 MiB in bf16) but 2 layers
#: with a 4096 MLP, so the encoder stays the bulk of a first sight's work.
SIGLIP_SO400M = VlmGeometry(
    image_size=224, patch_size=14, vision_hidden=1152, vision_inter=4304, vision_layers=27,
    vision_heads=16, text_hidden=2048, text_inter=4096, text_layers=2, text_heads=16,
    text_kv_heads=2, head_dim=128, vision_init_std=0.02,
)  # fmt: skip
PRESETS: dict[str, VlmGeometry] = {
    "tiny": TINY, "siglip-base": SIGLIP_BASE, "siglip-so400m": SIGLIP_SO400M,
}  # fmt: skip

IMAGE_SIZE = TINY.image_size
PATCH_SIZE = TINY.patch_size
NUM_IMAGE_TOKENS = TINY.num_image_tokens  # 64
TEXT_HIDDEN = TINY.text_hidden
VOCAB_SIZE = 1536
INIT_STD = 0.5  # large on purpose: makes greedy output depend on the image

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # ids 0..4 (Gemma order)
IMAGE_TOKEN = "<image>"
EXTRA_TOKENS = [f"<loc{i:0>4}>" for i in range(1024)] + [f"<seg{i:0>3}>" for i in range(128)]


def _vocab() -> dict[str, int]:
    """Character-level Gemma-style vocab (BPE with no merges + byte fallback)."""
    toks: list[str] = list(SPECIALS) + [IMAGE_TOKEN, "\n", "\u2581"]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    toks += [chr(c) for c in range(33, 127)]  # printable ASCII except space ("▁")
    toks += EXTRA_TOKENS  # PaliGemmaProcessor adds these anyway; keep ids stable
    # pad with <unusedN> so every id the LM can emit (0..VOCAB_SIZE-1) decodes
    toks += [f"<unused{i}>" for i in range(VOCAB_SIZE - len(toks))]
    assert len(toks) == len(set(toks)) == VOCAB_SIZE
    return {t: i for i, t in enumerate(toks)}


def _write_tokenizer(out_dir: str) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = _vocab()
    tok = Tokenizer(
        BPE(vocab=vocab, merges=[], fuse_unk=True, unk_token="<unk>", byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIALS + [IMAGE_TOKEN]]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in EXTRA_TOKENS + [t for t in vocab if t.startswith("<unused")]
        ]
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    tok_cfg = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
        # PaliGemma-2 style: vLLM inserts <image>*64 + <bos> at the very start.
        "add_bos_token": False,
        "add_eos_token": False,
        "extra_special_tokens": {"image_token": IMAGE_TOKEN},
        "model_max_length": 1024,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }
    _dump(out_dir, "tokenizer_config.json", tok_cfg)
    _dump(
        out_dir,
        "special_tokens_map.json",
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
            "additional_special_tokens": [IMAGE_TOKEN],
        },
    )
    return vocab


def _config(image_token_id: int, g: VlmGeometry) -> dict:
    text = {
        "model_type": "gemma",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": g.text_hidden,
        "intermediate_size": g.text_inter,
        "num_hidden_layers": g.text_layers,
        "num_attention_heads": g.text_heads,
        "num_key_value_heads": g.text_kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": INIT_STD,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": g.vision_hidden,
        "intermediate_size": g.vision_inter,
        "num_hidden_layers": g.vision_layers,
        "num_attention_heads": g.vision_heads,
        "num_channels": 3,
        "image_size": g.image_size,
        "patch_size": g.patch_size,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "projection_dim": g.text_hidden,
        "vision_use_head": False,
        "torch_dtype": "float32",
    }
    return {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "image_token_index": image_token_id,
        "vocab_size": VOCAB_SIZE,
        "projection_dim": g.text_hidden,
        "hidden_size": g.text_hidden,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }


def _weight_shapes(g: VlmGeometry) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in the key layout vLLM expects.

    kind: "w" random normal, "vw" random normal at the tower's std, "b" bias
    (small random), "ln" LayerNorm weight (ones), "rms" Gemma RMSNorm weight
    (stored as w, applied as 1+w: zeros-ish).
    Names follow what transformers 5 ``save_pretrained`` writes, except the
    vision tower which gets the ``vision_tower.vision_model.`` prefix vLLM's
    SiglipVisionModel wants (transformers 5 saves ``vision_tower.embeddings...``).
    """
    S: list[tuple[str, tuple[int, ...], str]] = []
    vt = "model.vision_tower.vision_model."
    V, VI, T, TI, HD = g.vision_hidden, g.vision_inter, g.text_hidden, g.text_inter, g.head_dim
    P, N = g.patch_size, g.num_image_tokens
    S += [
        (vt + "embeddings.patch_embedding.weight", (V, 3, P, P), "vw"),
        (vt + "embeddings.patch_embedding.bias", (V,), "b"),
        (vt + "embeddings.position_embedding.weight", (N, V), "vw"),
    ]
    for i in range(g.vision_layers):
        p = f"{vt}encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            S += [
                (p + f"self_attn.{n}.weight", (V, V), "vw"),
                (p + f"self_attn.{n}.bias", (V,), "b"),
            ]
        S += [
            (p + "layer_norm1.weight", (V,), "ln"),
            (p + "layer_norm1.bias", (V,), "b"),
            (p + "layer_norm2.weight", (V,), "ln"),
            (p + "layer_norm2.bias", (V,), "b"),
            (p + "mlp.fc1.weight", (VI, V), "vw"),
            (p + "mlp.fc1.bias", (VI,), "b"),
            (p + "mlp.fc2.weight", (V, VI), "vw"),
            (p + "mlp.fc2.bias", (V,), "b"),
        ]
    S += [(vt + "post_layernorm.weight", (V,), "ln"), (vt + "post_layernorm.bias", (V,), "b")]
    S += [
        ("model.multi_modal_projector.linear.weight", (T, V), "w"),
        ("model.multi_modal_projector.linear.bias", (T,), "b"),
    ]
    lm = "model.language_model."
    S += [(lm + "embed_tokens.weight", (VOCAB_SIZE, T), "w")]
    for i in range(g.text_layers):
        p = f"{lm}layers.{i}."
        S += [
            (p + "self_attn.q_proj.weight", (g.text_heads * HD, T), "w"),
            (p + "self_attn.k_proj.weight", (g.text_kv_heads * HD, T), "w"),
            (p + "self_attn.v_proj.weight", (g.text_kv_heads * HD, T), "w"),
            (p + "self_attn.o_proj.weight", (T, g.text_heads * HD), "w"),
            (p + "mlp.gate_proj.weight", (TI, T), "w"),
            (p + "mlp.up_proj.weight", (TI, T), "w"),
            (p + "mlp.down_proj.weight", (T, TI), "w"),
            (p + "input_layernorm.weight", (T,), "rms"),
            (p + "post_attention_layernorm.weight", (T,), "rms"),
        ]
    S += [(lm + "norm.weight", (T,), "rms")]
    return S


def _make_weights(seed: int, geometry: VlmGeometry):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, kind in _weight_shapes(geometry):
        if kind == "w":
            t = torch.randn(shape, generator=g) * INIT_STD
        elif kind == "vw":
            t = torch.randn(shape, generator=g) * geometry.vision_init_std
        elif kind == "b":
            t = torch.randn(shape, generator=g) * 0.02
        elif kind == "ln":
            t = torch.ones(shape)
        else:  # rms: Gemma applies (1 + w)
            t = torch.randn(shape, generator=g) * 0.02
        out[name] = t.to(torch.float32).contiguous()
    return out


def _dump(out_dir: str, name: str, obj) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def image_token_id() -> int:
    """The id of the ``<image>`` placeholder token in every generated tokenizer."""
    return _vocab()[IMAGE_TOKEN]


def geometry(vision: str) -> VlmGeometry:
    """The preset named ``vision`` (a key of :data:`PRESETS`)."""
    try:
        return PRESETS[vision]
    except KeyError:
        raise ValueError(
            f"expected a vision preset among {sorted(PRESETS)}, got {vision!r}"
        ) from None


def build_tiny_paligemma(out_dir: str, seed: int = 0, vision: str = "tiny") -> str:
    """Write a random PaliGemma (config, weights, tokenizer, processor) to ``out_dir``.

    ``vision`` names the geometry (:data:`PRESETS`): ``"tiny"`` takes well under a
    second; ``"siglip-base"`` (~95 M parameters, 380 MB of float32) a few seconds;
    ``"siglip-so400m"`` (~485 M parameters, 1.9 GB of float32) ~10 s and a peak of
    ~2.5 GiB resident (2026-12-05, the 2-vCPU VM).
    Returns the absolute path. Deterministic for a given ``seed`` and preset.
    """
    from safetensors.torch import save_file

    g = geometry(vision)

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)

    vocab = _write_tokenizer(out_dir)
    image_token_id = vocab[IMAGE_TOKEN]
    _dump(out_dir, "config.json", _config(image_token_id, g))
    _dump(
        out_dir, "generation_config.json", {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    )
    _dump(
        out_dir,
        "preprocessor_config.json",
        {
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "PaliGemmaProcessor",
            "image_seq_length": g.num_image_tokens,
            "size": {"height": g.image_size, "width": g.image_size},
            "resample": 3,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
        },
    )
    _dump(out_dir, "processor_config.json", {"processor_class": "PaliGemmaProcessor"})

    state = _make_weights(seed, g)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
