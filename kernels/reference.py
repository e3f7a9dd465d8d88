"""Torch reference of pack/unpack: obviously correct, one slice copy per extent.

Used by the tests as the oracle (it shares no code with the planner or the
kernel) and by the engine as the fallback when no kernel can run (CPU without
the Triton interpreter, or an arena that CUDA could not register).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .step_table import Extents


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError(
            f"expected a contiguous tensor, got shape {tuple(t.shape)} with strides "
            f"{t.stride()}: call .contiguous() first"
        )
    return t.reshape(-1).view(torch.uint8)


def reference_pack(
    sources: Sequence[torch.Tensor],
    tables: Sequence[Extents],
    arena: torch.Tensor,
    block_bytes: int,
) -> None:
    """Write each source's bytes, in order, into the blocks of its table."""
    for src, table in zip(sources, tables, strict=True):
        data, pos = byte_view(src), 0
        for start, count in table:
            take = min(count * block_bytes, data.numel() - pos)
            arena[start * block_bytes : start * block_bytes + take].copy_(data[pos : pos + take])
            pos += take


def reference_unpack(
    arena: torch.Tensor,
    tables: Sequence[Extents],
    block_bytes: int,
    outputs: Sequence[torch.Tensor],
) -> None:
    """Fill each output with the bytes of its blocks, in table order."""
    for out, table in zip(outputs, tables, strict=True):
        data, pos = byte_view(out), 0
        for start, count in table:
            take = min(count * block_bytes, data.numel() - pos)
            data[pos : pos + take].copy_(arena[start * block_bytes : start * block_bytes + take])
            pos += take
