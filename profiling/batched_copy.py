"""The current upstream anchor: one ``cuMemcpyBatchAsync`` call per step (copy engine).

vLLM's CPU offloading moves blocks with one batched driver call per direction.
This module issues the same call through ``cuda-bindings`` (``cuda.bindings.driver``,
12.9 or 13.x), used by the benchmark only.

Both binding lines take ``cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs,
attrsIdxs, numAttrs, hStream)`` with ``dsts``/``srcs`` lists of ``CUdeviceptr``
(plain ints are refused with a TypeError); 12.x returns ``(CUresult, failIdx)``,
13.x ``(CUresult,)``. The descriptors (pointer objects, the attributes) are built
once by :meth:`BatchedCopy.prepare`, outside any timed region, so a timed
:meth:`BatchedCopy.__call__` is the driver call alone, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BatchDescriptors:
    """Everything one ``cuMemcpyBatchAsync`` takes but the stream, ready to pass."""

    dsts: list[Any]  # CUdeviceptr
    srcs: list[Any]  # CUdeviceptr
    sizes: list[int]
    attrs: list[Any]  # one CUmemcpyAttributes for the whole batch
    attr_idxs: list[int]  # [0]: the attributes apply from the first copy on

    @property
    def count(self) -> int:
        return len(self.sizes)


class BatchedCopy:
    """Issues one ``cuMemcpyBatchAsync`` for prepared (dst, src, size) lists on a stream."""

    def __init__(self, device: torch.device, driver: Any = None) -> None:
        if driver is None:
            from cuda.bindings import driver  # pyright: ignore[reportMissingImports]  (optional: only the benchmark uses it)
        self._driver = driver
        self.device = device

    def prepare(
        self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], *, to_host: bool
    ) -> BatchDescriptors:
        """Descriptors for copies ``srcs[i] -> dsts[i]`` of ``sizes[i]`` bytes (GPU <-> host)."""
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise ValueError(
                f"expected as many destinations, sources and sizes, got {len(dsts)}, "
                f"{len(srcs)} and {len(sizes)}"
            )
        bad = [n for n in sizes if n <= 0]
        if bad:
            raise ValueError(f"every copy needs a positive size, got {bad[0]}")
        d = self._driver
        return BatchDescriptors(
            dsts=[d.CUdeviceptr(int(p)) for p in dsts],
            srcs=[d.CUdeviceptr(int(p)) for p in srcs],
            sizes=[int(n) for n in sizes],
            attrs=[self._attrs(to_host)],
            attr_idxs=[0],
        )

    def _attrs(self, to_host: bool) -> Any:
        d = self._driver
        attr = d.CUmemcpyAttributes()
        attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        dev, host = d.CUmemLocation(), d.CUmemLocation()
        dev.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        dev.id = self.device.index or 0
        host.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        host.id = 0
        attr.srcLocHint, attr.dstLocHint = (dev, host) if to_host else (host, dev)
        attr.flags = 0
        return attr

    def __call__(self, batch: BatchDescriptors, stream: Any) -> None:
        """Enqueue the prepared batch on ``stream`` (a torch stream or a raw handle)."""
        if not batch.count:
            return
        d = self._driver
        handle = getattr(stream, "cuda_stream", stream)
        result = d.cuMemcpyBatchAsync(
            batch.dsts, batch.srcs, batch.sizes, batch.count,
            batch.attrs, batch.attr_idxs, len(batch.attrs), d.CUstream(handle),
        )  # fmt: skip
        err = result[0] if isinstance(result, tuple) else result
        if err != d.CUresult.CUDA_SUCCESS:
            where = f" (copy {result[1]})" if isinstance(result, tuple) and len(result) > 1 else ""
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {err}{where}")
