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
import math
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import add
from typing import Literal, NamedTuple

import torch

from . import native
from .block_copy import KernelVariant, _block_copy_kernel, compile_variants, launch_block_copy
from .nvtx import nvtx_range
from .plan import VEC_WIDTHS, CopyPlan, PlanError, Tables, plan_copy, plan_in_c
from .reference import byte_view, reference_pack, reference_unpack

Backend = Literal["auto", "triton", "reference"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchConfig:
    """Persistent-grid size. Defaults from the H200 prototype (its figures:
    shared/bench/h200-baseline.md): the fewest programs and warps that come near the
    PCIe limit in each direction while leaving the SMs to concurrent compute; a
    program per row would take every SM."""

    num_programs: int
    num_warps: int
    tile_bytes: int = 16384
    # Segments (contiguous on both sides) of at least this many bytes go to the
    # copy engine, one ``copy_`` each on the same stream, the rest to the kernel.
    # None until measured on the GPU (profiling/bench.py's DMA rows decide).
    dma_min_bytes: int | None = None


PACK_CONFIG = LaunchConfig(num_programs=8, num_warps=8)
UNPACK_CONFIG = LaunchConfig(num_programs=16, num_warps=4)
ITEM_ALIGN = 256  # byte alignment of each item in buffers this module allocates


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


class ItemViews(list):
    """Per-item tensors that are views of one buffer, as :func:`empty_items` makes them.

    It also carries the buffer and each item's byte offset and size, so
    :func:`unpack` into it plans without asking each tensor for its address.
    """

    def __init__(self, views: Sequence[torch.Tensor], buffer: torch.Tensor,
                 offsets: Sequence[int], nbytes: Sequence[int]) -> None:  # fmt: skip
        super().__init__(views)
        self.buffer, self.offsets, self.nbytes = buffer, offsets, nbytes


class _Layout(NamedTuple):
    """Where :func:`empty_items` puts each item of one list of specs, and how it makes
    the views; depends on the specs only (cached)."""

    offsets: tuple[int, ...]  # each item's byte offset in the buffer, a multiple of 256
    nbytes: tuple[int, ...]
    numel: int  # buffer elements of ``dtype`` (bytes when the dtypes are mixed)
    dtype: torch.dtype | None  # the items' one dtype; None when they differ
    rows: tuple[int, ...] | None  # the buffer's shape to split: (-1, *trailing dims); None: 1-D
    split: tuple[int, ...] | None  # pieces along dim 0, in rows: items and the gaps between
    picks: tuple[int, ...] | None  # each item's piece; None when there are no gaps
    strided: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # no split, one dtype:
    # as_strided's (shape, strides, element offset) per item


def empty_items(
    specs: Sequence[tuple[torch.dtype, Sequence[int]]], device: torch.device | str
) -> ItemViews:
    """Uninitialised tensors of the given (dtype, shape), as views of one buffer.

    Each item starts at a multiple of 256 bytes, so :func:`unpack` writes all
    of them in place with full-width accesses. One allocation. When every item
    has the same dtype and the same trailing dimensions (encoder outputs:
    ``(tokens, hidden)``) all views come from one ``split_with_sizes`` call;
    other single-dtype lists get one ``as_strided`` per item; mixed dtypes go
    through bytes.
    """
    specs = tuple(specs)
    try:
        layout = _cached_layout(specs)
    except TypeError:  # a shape given as a list: not hashable
        layout = _layout(specs)
    if layout.dtype is None:
        buffer = torch.empty(layout.numel, dtype=torch.uint8, device=device)
        views = [
            buffer[o : o + n].view(dt).view(tuple(shape))
            for o, n, (dt, shape) in zip(layout.offsets, layout.nbytes, specs, strict=True)
        ]
        return ItemViews(views, buffer, layout.offsets, layout.nbytes)
    typed = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    if layout.split is not None:
        rows = typed if layout.rows is None else typed.view(layout.rows)
        pieces = rows.split_with_sizes(layout.split)
        views = pieces if layout.picks is None else [pieces[i] for i in layout.picks]
    else:
        as_strided = typed.as_strided
        views = [as_strided(*args) for args in layout.strided]
    return ItemViews(views, typed.view(torch.uint8), layout.offsets, layout.nbytes)


def _layout(specs: tuple[tuple[torch.dtype, Sequence[int]], ...]) -> _Layout:
    nbytes = tuple(math.prod(shape) * dt.itemsize for dt, shape in specs)
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ITEM_ALIGN) * ITEM_ALIGN
        offsets.append(start)
        end = start + n
    offsets = tuple(offsets)
    dtypes = {dt for dt, _ in specs}
    if len(dtypes) != 1:
        return _Layout(offsets, nbytes, end, None, None, None, None, ())
    (dtype,) = dtypes
    size = dtype.itemsize
    trailing = {tuple(shape[1:]) for _, shape in specs if len(shape)}
    if len(trailing) == 1 and all(len(shape) for _, shape in specs):
        (dims,) = trailing
        row = math.prod(dims) * size
        split, picks, at = [], [], 0
        for o, n in zip(offsets, nbytes, strict=True):
            if row == 0 or (o - at) % row:
                break  # a gap of part of a row: no split
            if o > at:
                split.append((o - at) // row)  # the gap before this item, in rows
            picks.append(len(split))
            split.append(n // row)
            at = o + n
        else:
            return _Layout(offsets, nbytes, end // size, dtype, (-1, *dims) if dims else None,
                           tuple(split), None if len(split) == len(specs) else tuple(picks),
                           ())  # fmt: skip
    strided = tuple(
        (tuple(shape), _contiguous_strides(shape), o // size)
        for o, (_, shape) in zip(offsets, specs, strict=True)
    )
    return _Layout(offsets, nbytes, end // size, dtype, None, None, None, strided)


_cached_layout = lru_cache(maxsize=256)(_layout)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


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
    base, offsets, plan = _plan(tensors, tables, arena, block_bytes, config)
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
        # the plan's item span: these tensors' own, from which _plan made it
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
    base, _, plan = _plan(tensors, tables, arena, block_bytes, config)
    return base, plan


def _plan(
    tensors: Sequence[torch.Tensor],
    tables: Tables,
    arena: torch.Tensor,
    block_bytes: int,
    config: LaunchConfig,
) -> tuple[torch.Tensor | None, Sequence[int], CopyPlan]:
    if isinstance(tensors, ItemViews):  # one buffer: its layout is known
        base, offsets, nbytes = tensors.buffer, tensors.offsets, tensors.nbytes
        span = _byte_size(base, "the ItemViews' buffer")
        if type(base) is not torch.Tensor:
            base = _plain_byte_view(base)
    else:
        tensors = list(tensors)
        c_pass = native.planner()
        found = c_pass.item_layout(tensors) if c_pass is not None else None
        if found is None:  # the long way, which names what is wrong
            base, offsets, nbytes, span = _python_item_layout(tensors)
        else:
            lowest, offsets, nbytes, span = found
            base = _byte_view_of(tensors[lowest]) if lowest >= 0 else None
            if config.dma_min_bytes is None:  # the usual step: both passes in C
                plan = plan_in_c(c_pass, offsets, nbytes, tables, block_bytes, arena.numel(),
                                 span, config.tile_bytes,
                                 base.data_ptr() if base is not None else 0, arena.data_ptr(),
                                 config.num_programs)  # fmt: skip
                if plan is not None:
                    return base, offsets, plan
    plan = plan_copy(
        offsets, nbytes, tables, block_bytes=block_bytes, arena_bytes=arena.numel(),
        items_bytes=span, tile_bytes=config.tile_bytes, num_programs=config.num_programs,
        items_base=base.data_ptr() if base is not None else 0, arena_base=arena.data_ptr(),
        dma_min_bytes=config.dma_min_bytes,
    )  # fmt: skip
    return base, offsets, plan


def _item_layout(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[int], list[int], int]:
    """(base, offsets, sizes, span): the lowest-addressed non-empty item as a
    uint8 tensor, each item's byte offset from it and byte size, and the bytes
    from base to the end of the highest item. The C pass computes the numbers
    when it is loaded (three method calls per tensor are most of a step's host
    cost); :func:`_python_item_layout` where it is not or declines (:func:`_plan`
    asks the C pass itself, once)."""
    c_pass = native.planner()
    found = c_pass.item_layout(tensors) if c_pass is not None else None
    if found is None:
        return _python_item_layout(tensors)
    lowest, offsets, sizes, span = found
    return (_byte_view_of(tensors[lowest]) if lowest >= 0 else None), offsets, sizes, span


def _python_item_layout(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[int], list[int], int]:
    """:func:`_item_layout`'s numbers in Python, naming what is wrong."""
    # torch.Tensor's own accessors with torch functions off: a subclass (its properties,
    # its __torch_function__) or a mode could otherwise answer more bytes than there are.
    with _no_torch_functions():  # (a TypeError for what is no tensor)
        contiguous = list(map(_is_contiguous, tensors))
        ptrs = list(map(_data_ptr, tensors))  # map: no bytecode per tensor
        sizes = list(map(_nbytes, tensors))
    if not all(contiguous):
        i, t = next((i, t) for i, t in enumerate(tensors) if not contiguous[i])
        raise PlanError(
            f"tensor {i} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): "
            "call .contiguous() first"
        )
    if 0 in sizes or not sizes:  # an empty tensor's address means nothing: never the base
        nonempty = [i for i, n in enumerate(sizes) if n]
        if not nonempty:
            return None, [0] * len(tensors), sizes, 0
        lowest = min(nonempty, key=ptrs.__getitem__)
        start = ptrs[lowest]
        offsets = [p - start if n else 0 for p, n in zip(ptrs, sizes, strict=True)]
    else:
        start = min(ptrs)
        lowest = ptrs.index(start)
        offsets = [p - start for p in ptrs]
    span = max(map(add, offsets, sizes))
    return _plain_byte_view(tensors[lowest]), offsets, sizes, span


def _byte_view_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as uint8 over the same memory: the launch's items base,
    of which only the address and device are read. One view, not a flat one: the
    flattening costs a second torch call, a sizeable share of a small step's host
    time (BENCHMARKS.md, "The save path's last cuts")."""
    try:
        return tensor.view(torch.uint8)  # the last dimension scaled by the element size
    except RuntimeError:  # a 0-d tensor, or a last dimension of size 1 with another stride
        return tensor.reshape(-1).view(torch.uint8)


def _plain_byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`_byte_view_of` as a plain torch.Tensor (torch functions off): the kernel
    asks its base for its address, which a subclass could answer otherwise."""
    with _no_torch_functions():  # (torch then makes a plain tensor of a subclass's view)
        return _byte_view_of(tensor)


def _byte_size(tensor: torch.Tensor, what: str) -> int:
    """Bytes of a contiguous tensor, from torch.Tensor's own accessors (torch functions
    off); PlanError for anything else."""
    if type(tensor) is torch.Tensor and not _modes_on():  # nothing can answer for torch
        if _is_contiguous(tensor):
            return _nbytes(tensor)
    else:
        with _no_torch_functions():
            if isinstance(tensor, torch.Tensor) and _is_contiguous(tensor):
                return _nbytes(tensor)
    raise PlanError(f"{what} must be a contiguous tensor, got {type(tensor).__name__}")


_is_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr
_nbytes = torch.Tensor.nbytes.__get__  # pyright: ignore[reportAttributeAccessIssue]  (a property)
_no_torch_functions = torch._C.DisableTorchFunction
_modes_on = torch._C._is_torch_function_mode_enabled
