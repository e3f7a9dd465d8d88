"""Where a step's items lie: buffers made for them, and the layout read off given tensors.

:func:`empty_items` makes one buffer with a view per item, each item at a multiple of
256 bytes so a launch into them uses full-width accesses; :class:`ItemViews` carries that
layout, so planning a launch into it asks no tensor for its address.
:func:`python_item_layout` reads the layout of any tensors (the lowest-addressed item,
each item's byte offset from it and size), naming what is wrong; the planner's C pass
computes the same numbers in less time, and :mod:`.planner` chooses between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from operator import add
from typing import NamedTuple

import torch

from .step_table import PlanError

ITEM_ALIGN = 256  # byte alignment of each item in buffers this module allocates


class ItemViews(list):
    """Per-item tensors that are views of one buffer, as :func:`empty_items` makes them.

    It also carries the buffer and each item's byte offset and size, so
    :func:`~.api.unpack` into it plans without asking each tensor for its address.
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


def python_item_layout(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[int], list[int], int]:
    """(base, offsets, sizes, span): the lowest-addressed non-empty item as a uint8
    tensor (None when every item is empty), each item's byte offset from it and byte
    size, and the bytes from base to the end of the highest item; PlanError naming
    the first tensor that is not contiguous."""
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
    return plain_byte_view(tensors[lowest]), offsets, sizes, span


def byte_view_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as uint8 over the same memory: the launch's items base,
    of which only the address and device are read. One view, not a flat one: the
    flattening costs a second torch call, a sizeable share of a small step's host
    time (BENCHMARKS.md, "The save path's last cuts")."""
    try:
        return tensor.view(torch.uint8)  # the last dimension scaled by the element size
    except RuntimeError:  # a 0-d tensor, or a last dimension of size 1 with another stride
        return tensor.reshape(-1).view(torch.uint8)


def plain_byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`byte_view_of` as a plain torch.Tensor (torch functions off): the kernel
    asks its base for its address, which a subclass could answer otherwise."""
    with _no_torch_functions():  # (torch then makes a plain tensor of a subclass's view)
        return byte_view_of(tensor)


def byte_size(tensor: torch.Tensor, what: str) -> int:
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
