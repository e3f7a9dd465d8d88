"""The current upstream anchor: one ``cuMemcpyBatchAsync`` call per step (copy engine).

vLLM's CPU offloading moves blocks with one batched driver call per direction.
This module issues the same call through ``cuda-bindings`` (``cuda.bindings.driver``),
used by the benchmark only (CUDA 12.8+; the bindings return ``failIdx`` on 12.x
instead of taking it, so one call form serves both).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2


class BatchedCopy:
    """Issues one ``cuMemcpyBatchAsync`` for a list of (dst, src, size) on a stream."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver  # optional: only the benchmark uses it

        self._driver = driver
        self.device = device

    def _attrs(self, to_host: bool):
        d = self._driver
        attr = d.CUmemcpyAttributes()
        attr.srcAccessOrder = d.CUmemcpySrcAccessOrder(_SRC_ACCESS_ORDER_STREAM)
        dev, host = d.CUmemLocation(), d.CUmemLocation()
        dev.type, dev.id = d.CUmemLocationType(_LOCATION_DEVICE), self.device.index or 0
        host.type, host.id = d.CUmemLocationType(_LOCATION_HOST), 0
        attr.srcLocHint, attr.dstLocHint = (dev, host) if to_host else (host, dev)
        attr.flags = 0
        return attr

    def __call__(
        self,
        dsts: Sequence[int],
        srcs: Sequence[int],
        sizes: Sequence[int],
        *,
        to_host: bool,
        stream: torch.cuda.Stream,
    ) -> None:
        d = self._driver
        result = d.cuMemcpyBatchAsync(
            list(dsts), list(srcs), list(sizes), len(sizes), [self._attrs(to_host)], [0], 1,
            d.CUstream(stream.cuda_stream),
        )  # fmt: skip
        err = result[0] if isinstance(result, tuple) else result
        if err != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {err}")
