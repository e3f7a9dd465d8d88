"""What every layer needs to know about an item's bytes: its dtype as a name (and
back) and its CRC-32 in an arena.

Catalogs store an item's dtype as a short name (``"bfloat16"``) so they stay
plain Python; the CRC-32 of ``integrity`` mode covers the item's extents in
order, the last one cut at the item's size. Plain Python: torch is imported
the first time a name is turned back into a dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

_BY_NAME: dict[str, Any] = {}  # dtype name -> torch.dtype, filled on first use


def dtype_name(dtype: object) -> str:
    """The name a catalog stores for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> Any:
    """The ``torch.dtype`` of a stored name; ValueError for a name torch does not know."""
    dtype = _BY_NAME.get(name)
    if dtype is None:
        import torch

        # vars(), not getattr(): torch's module __getattr__ imports modules for some
        # names ("onnx", "_inductor"), and a name may come from another host's bytes.
        dtype = vars(torch).get(name)
        if not isinstance(dtype, torch.dtype) or dtype in _quantized(torch):
            raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'bfloat16')")
        _BY_NAME[name] = dtype
    return dtype


def _quantized(torch: Any) -> set:
    """Quantized dtypes: no plain tensor of them can be made (``torch.empty`` fails)."""
    names = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    return {d for d in (vars(torch).get(n) for n in names) if d is not None}


def item_crc32(data, extents: Iterable[tuple[int, int]], block_bytes: int, nbytes: int) -> int:
    """CRC-32 of an item's bytes in an arena's data area (``data``: any buffer of it):
    its extents in order, the last one cut at ``nbytes`` (padding excluded)."""
    view = memoryview(data).cast("B")
    crc, left = 0, nbytes
    for start, count in extents:
        take = min(count * block_bytes, left)
        crc = zlib.crc32(view[start * block_bytes : start * block_bytes + take], crc)
        left -= take
    return crc
