"""Public pack/unpack: many tensors <-> their blocks of an arena, one launch each way.

``pack(sources, tables, arena, block_bytes)`` writes each source tensor's byte
stream into the blocks of its table; ``unpack(arena, tables, block_bytes,
outputs)`` fills each output tensor from its blocks. Only the listed blocks
(and, for unpack, the outputs) are written; everything else is untouched.

No staging copy: the kernel receives one base tensor (the lowest-addressed
item) and each item's int64 byte offset from it. That is plain address
arithmetic in one flat address space (CUDA's unified addressing, or the host
under the Triton interpreter), never a pointer loaded from memory, so the
same launch works in both modes and items may live in separate allocations.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from collections.abc import Sequence
from typing import Literal

import torch

from . import native
from .block_copy import KernelVariant, _block_copy_kernel, compile_variants, launch_block_copy
from .items import ItemViews
from .nvtx import nvtx_range
from .plan import PACK_CONFIG, UNPACK_CONFIG, VEC_WIDTHS, CopyPlan, LaunchConfig
from .planner import plan_items
from .reference import byte_view, reference_pack, reference_unpack
from .step_table import PlanError, Tables

Backend = Literal["auto", "triton", "reference"]
log = logging.getLogger(__name__)


def _interpreted() -> bool:
    return type(_block_copy_kernel).__name__ == "InterpretedFunction"


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run on tensors of ``device``."""
    return device.type == "cpu" if _interpreted() else device.type == "cuda"


def kernel_variants(
    pack_config: LaunchConfig = PACK_CONFIG, unpack_config: LaunchConfig = UNPACK_CONFIG
) -> list[KernelVariant]:
    """Every kernel variant :func:`pack` and :func:`unpack` can launch with these configs:
    both directions x every access width a plan can pick."""
    return [
        KernelVariant(to_arena, vec, config.tile_bytes, config.num_warps)
        for to_arena, config in ((True, pack_config), (False, unpack_config))
        for vec in VEC_WIDTHS
    ]


def warm_up(
    device: torch.device,
    *,
    pack_config: LaunchConfig = PACK_CONFIG,
    unpack_config: LaunchConfig = UNPACK_CONFIG,
) -> list[KernelVariant]:
    """Load the planner's C pass (:mod:`.native`) and compile every kernel variant launches
    with these configs can select, before the first copy.

    Returns the variants compiled: none for a non-CUDA device or under the
    interpreter, which compile nothing. Triton's on-disk cache makes later
    processes' warm-ups fast; the C pass was built at install time.
    """
    native.planner()
    if _interpreted() or device.type != "cuda":
        return []
    variants = kernel_variants(pack_config, unpack_config)
    start = time.perf_counter()
    compile_variants(variants, device)
    log.info("ecoffload: %d kernel variants ready on %s in %.2f s",
             len(variants), device, time.perf_counter() - start)  # fmt: skip
    return variants


def pack(
    sources: Sequence[torch.Tensor],
    tables: Tables,
    arena: torch.Tensor,
    block_bytes: int,
    *,
    config: LaunchConfig = PACK_CONFIG,
    backend: Backend = "auto",
) -> None:
    """Copy each source's bytes into its blocks of ``arena``, in one launch.

    Args:
        sources: contiguous tensors of any dtype and shape, on ``arena``'s device
            (each is its flat byte stream; zero-size tensors are allowed).
        tables: per source, extents ``(start_block, count)`` in stream order that
            cover its bytes exactly (the last block may be partly used).
        arena: flat uint8 tensor of ``num_blocks * block_bytes`` bytes (on CUDA,
            typically the device alias of host-registered memory).
        block_bytes: block size in bytes.
        backend: "triton", "reference" (torch slice copies), or "auto" (Triton
            when it can run on this device, else the reference).

    Leaves every block outside ``tables`` untouched. Asynchronous on CUDA (the
    current stream); ``sources`` must stay alive until the copy completes.
    """
    with nvtx_range("ecoffload.pack"):
        _run(list(sources), tables, arena, block_bytes, config, backend, to_arena=True)


def unpack(
    arena: torch.Tensor,
    tables: Tables,
    block_bytes: int,
    outputs: Sequence[torch.Tensor],
    *,
    config: LaunchConfig = UNPACK_CONFIG,
    backend: Backend = "auto",
) -> None:
    """Fill each output tensor with the bytes of its blocks of ``arena``, in one launch.

    ``outputs`` are contiguous tensors on ``arena``'s device whose byte sizes are
    the items' sizes (use :func:`empty_items` for one buffer with per-item views).
    Only the outputs are written.
    """
    with nvtx_range("ecoffload.unpack"):
        outputs = outputs if isinstance(outputs, ItemViews) else list(outputs)
        _run(outputs, tables, arena, block_bytes, config, backend, to_arena=False)


def _run(
    tensors: list[torch.Tensor],
    tables: Tables,
    arena: torch.Tensor,
    block_bytes: int,
    config: LaunchConfig,
    backend: Backend,
    *,
    to_arena: bool,
) -> None:
    if len(tables) != len(tensors):
        raise PlanError(
            f"expected one block table per tensor, got {len(tables)} for {len(tensors)}"
        )
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise PlanError(
            f"arena must be a flat uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
        )
    if backend == "auto":
        backend = "triton" if triton_available(arena.device) else "reference"
    if backend not in ("triton", "reference"):
        raise PlanError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    base, offsets, plan = plan_items(tensors, tables, arena, block_bytes, config)
    if backend == "reference":
        if to_arena:
            reference_pack(tensors, tables, arena, block_bytes)
        else:
            reference_unpack(arena, tables, block_bytes, tensors)
        return
    if not triton_available(arena.device):
        raise PlanError(
            f"the Triton kernel cannot run on {arena.device} here (CUDA needed, or "
            "TRITON_INTERPRET=1 set before importing ecoffload for CPU tensors); "
            "use backend='reference'"
        )
    for i, t in enumerate(tensors[:1] if isinstance(tensors, ItemViews) else tensors):
        if t.device != arena.device:
            raise PlanError(
                f"tensor {i} is on {t.device}, expected the arena's device {arena.device}"
            )
    if plan.dma:
        _copy_engine(plan.dma, tensors, offsets, arena, to_arena=to_arena)
    if base is not None:
        # the plan's item span: these tensors' own, from which plan_items made it
        launch_block_copy(base, arena, plan, to_arena=to_arena, num_warps=config.num_warps,
                          items_bytes=plan.items_bytes)  # fmt: skip


def _copy_engine(
    segments: Sequence[tuple[int, int, int]],
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    arena: torch.Tensor,
    *,
    to_arena: bool,
) -> None:
    """One ``copy_`` per long segment, on the current stream (cudaMemcpyAsync on CUDA)."""
    nonempty = [i for i, t in enumerate(tensors) if t.numel()]
    by_start = sorted(nonempty, key=offsets.__getitem__)
    starts = [offsets[i] for i in by_start]
    for src, dst, nbytes in segments:
        item = by_start[bisect_right(starts, src) - 1]  # segments never cross items
        data = byte_view(tensors[item])[src - offsets[item] :][:nbytes]
        if to_arena:
            arena[dst : dst + nbytes].copy_(data, non_blocking=True)
        else:
            data.copy_(arena[dst : dst + nbytes], non_blocking=True)


def plan_batch(
    tensors: Sequence[torch.Tensor],
    tables: Tables,
    arena: torch.Tensor,
    block_bytes: int,
    *,
    config: LaunchConfig = PACK_CONFIG,
) -> tuple[torch.Tensor | None, CopyPlan]:
    """(items base, plan) for one launch over ``tensors`` and ``arena``; validates everything.

    The base is the lowest-addressed non-empty tensor as a uint8 view (None
    when every tensor is empty); the plan's access width divides the absolute
    address of every segment on both sides. :func:`pack`, :func:`unpack` and
    the benchmark's prebuilt launches all plan through here.
    """
    base, _, plan = plan_items(tensors, tables, arena, block_bytes, config)
    return base, plan
