"""What the connector tests share: a tiny model config, the connector pair built by
vLLM's factory, requests with image features, one worker step as V1 calls it.

Import it after ``pytest.importorskip("vllm")``.
"""

import json
import os
import pickle

import torch
from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

HIDDEN = 64  # the tiny model's hidden size: one encoder row = 128 bytes of bf16


def write_tiny_model(directory) -> str:
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    }))  # fmt: skip
    return str(directory)


def model_config(model_dir: str, dtype: str = "bfloat16") -> ModelConfig:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=0)


def make_config(directory, role="ec_both", model=None, **extra) -> VllmConfig:
    extra = {"arena_dir": directory, "arena_bytes": "256KiB", "block_bytes": "4KiB", **extra}
    transfer = ECTransferConfig(
        ec_connector="ECOffloadConnector",
        ec_connector_module_path="ecoffload.connector",
        ec_role=role,
        ec_connector_extra_config=extra,
    )
    kwargs = {"model_config": model} if model is not None else {}
    return VllmConfig(**kwargs, ec_transfer_config=transfer)


def connector(config: VllmConfig, role: str):
    roles = {"scheduler": ECConnectorRole.SCHEDULER, "worker": ECConnectorRole.WORKER}
    return ECConnectorFactory.create_connector(config, roles[role])


def make_request(req_id, images) -> Request:
    """A Request whose features are images: [(identifier, num_embeds)]."""
    prompt, features = [1, 2, 3], []
    for identifier, rows in images:
        features.append(MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(), modality="image", identifier=identifier,
            mm_position=PlaceholderRange(offset=len(prompt), length=rows), mm_hash=identifier,
        ))  # fmt: skip
        prompt += [9] * rows + [4]
    return Request(request_id=req_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   mm_features=features)  # fmt: skip


def encoder_output(rows, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)


def via_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def schedule(sched, request) -> list[bool]:
    """The scheduler's calls for one request: has_cache_item, then alloc for each item."""
    hits = [sched.has_cache_item(f.identifier) for f in request.mm_features]
    for i in range(len(request.mm_features)):
        sched.update_state_after_alloc(request, i)
    return hits


def worker_step(worker, meta, encoder_cache, computed):
    """One worker step as vLLM's V1 runner calls the hooks; returns the pickled report."""
    worker.bind_connector_metadata(via_pickle(meta))
    if worker.is_consumer:
        worker.start_load_caches(encoder_cache)
    for key, tensor in computed.items():
        encoder_cache[key] = tensor
        worker.save_caches(encoder_cache=encoder_cache, mm_hash=key)
    worker.get_finished(set())
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return via_pickle(report)


def deliver(sched, report) -> None:
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
