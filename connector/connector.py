"""``ECOffloadConnector``: the vLLM EC connector facade.

vLLM instantiates the class twice, in the scheduler process (role SCHEDULER)
and in each worker (role WORKER). The facade builds the matching delegate and
forwards every hook to it; it holds no logic of its own. Enable with::

    --ec-transfer-config '{"ec_connector": "ECOffloadConnector",
                           "ec_connector_module_path": "ecoffload.connector",
                           "ec_role": "ec_both",
                           "ec_connector_extra_config": {"arena_bytes": "8GiB"}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..engine.base.errors import ConfigError
from ..kernels.nvtx import traced
from .compat import ECConnectorBase, ECConnectorRole, items_named_by_content
from .config import OffloadConfig
from .scheduler_side import SchedulerSide
from .shared_arena import default_arena_name
from .stats import ECOffloadStats
from .worker_side import WorkerSide

if TYPE_CHECKING:  # vLLM's own types for its hooks' arguments (imported by vLLM anyway)
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.metrics import PromMetric, PromMetricT
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from .metadata import ECOffloadMetadata, ECOffloadWorkerMetadata


class ECOffloadConnector(ECConnectorBase):
    side: SchedulerSide | WorkerSide  # the delegate of this process's role
    # the same delegate typed by role: only that role's hooks are ever called (by vLLM)
    _scheduler: SchedulerSide
    _worker: WorkerSide

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None, "vLLM makes an EC connector only from ec_transfer_config"
        config = OffloadConfig.from_extra_config(
            transfer.ec_connector_extra_config, default_name=default_arena_name(vllm_config)
        )
        if not items_named_by_content(vllm_config):
            raise ConfigError(
                "ecoffload keys encoder outputs by vLLM's multimodal hash, but with "
                "--mm-processor-cache-gb 0 and prefix caching off vLLM names each item after "
                "a per-process request counter ('renderer0-mm-1-image-0'), which another "
                "instance, or this one after a restart, gives to a different image: one "
                "image's encoder output would be served for another. Keep vLLM's processor "
                "cache on (its default, --mm-processor-cache-gb 4) or enable prefix caching."
            )
        if role == ECConnectorRole.SCHEDULER:
            self.side = self._scheduler = SchedulerSide(vllm_config, config)
        else:
            self.side = self._worker = WorkerSide(vllm_config, config)

    # Scheduler side.
    @traced("ecoffload.has_cache_item")
    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has_cache_item(identifier)

    @traced("ecoffload.update_state_after_alloc")
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler.update_state_after_alloc(request, index)

    @traced("ecoffload.build_connector_meta")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECOffloadMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    @traced("ecoffload.update_connector_output")
    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    @traced("ecoffload.request_finished")
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    @traced("ecoffload.has_pending_push_work")
    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    @traced("ecoffload.ensure_cache_available")
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    @traced("ecoffload.take_unavailable_requests")
    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable_requests()

    @traced("ecoffload.update_state_after_free")
    def update_state_after_free(self, request: Request, index: int) -> None:
        self._scheduler.update_state_after_free(request, index)

    @traced("ecoffload.get_ec_connector_stats")
    def get_ec_connector_stats(self) -> ECOffloadStats | None:
        """Scheduler: its counters and gauges; worker (V2 asks it too): the writer's counters."""
        return self.side.get_ec_connector_stats()

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECOffloadStats:
        return ECOffloadStats(data=dict(data or {}))

    def offload_stats(self) -> dict[str, int | float]:
        """Cumulative counters of this side (scheduler: hits, misses, saves, loads...)."""
        return self.side.stats()

    # Worker side.
    @traced("ecoffload.bind_connector_metadata")
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata)

    @traced("ecoffload.clear_connector_metadata")
    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear_connector_metadata()

    @traced("ecoffload.start_load_caches")
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._worker.start_load_caches(encoder_cache, **kwargs)

    @traced("ecoffload.save_caches")
    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._worker.save_caches(encoder_cache, mm_hash, **kwargs)

    @traced("ecoffload.get_finished")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    @traced("ecoffload.build_connector_worker_meta")
    def build_connector_worker_meta(self) -> ECOffloadWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    @traced("ecoffload.start_worker_services")
    def start_worker_services(self) -> None:
        self._worker.start_worker_services()

    # Both.
    @traced("ecoffload.shutdown")
    def shutdown(self) -> None:
        self.side.shutdown()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """ecoffload's counters and arena occupancy for ``/metrics`` (API server process)."""
        from .prometheus import ECOffloadPromMetrics

        return ECOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
