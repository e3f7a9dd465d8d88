"""CUDA host registration of the arena through CuPy, and the device alias.

``cudaHostRegister(Portable | Mapped)`` pins the mmap'd pages and maps them into
the GPU's address space, so a kernel can read and write them over PCIe with
ordinary loads and stores (zero-copy). Registration goes in chunks of at most
64 GiB: single calls of hundreds of GiB fail on recent drivers. With
``defer=True`` nothing is registered up front: the arena registers chunks with
:meth:`HostRegistration.register` as its populate makes them ready, and a
process copies through the alias only the blocks it has registered.

The alias is a CUDA ``torch.Tensor`` whose storage is the registered range
(device pointer from ``pointerGetAttributes``; with UVA it equals the host
address), wrapped with ``cupy.cuda.UnownedMemory`` for an explicit device id
and handed to torch through DLPack. One alias per device, built on first use
and cached; it is checked to be the registered range on that device (a
silent copy into GPU memory would defeat the arena). It owns nothing: the
registration must outlive every alias.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..base.errors import ArenaError

log = logging.getLogger(__name__)

REGISTER_CHUNK_BYTES = 64 << 30
_PORTABLE, _MAPPED = 0x01, 0x02


class HostRegistration:
    """A host range registered with CUDA (Portable | Mapped), unregistered by ``close``."""

    def __init__(
        self,
        host_ptr: int,
        nbytes: int,
        chunk_bytes: int = REGISTER_CHUNK_BYTES,
        *,
        defer: bool = False,
        device_index: int | None = None,
    ) -> None:
        """Register ``nbytes`` at ``host_ptr`` now, or (``defer``) chunk by chunk through
        :meth:`register` as the arena's pages become ready. ``device_index``: the
        device every registering thread makes current (default: the caller's)."""
        import cupy  # pyright: ignore[reportMissingImports]  (extras cuda12 / cuda13)

        self._cupy = cupy
        self.host_ptr, self.nbytes = host_ptr, nbytes
        self.device_index = device_index
        self.device_ptr: int | None = None  # of byte 0, once any chunk is registered
        self._chunks: list[int] = []
        self._aliases: dict[int, torch.Tensor] = {}  # device index -> alias
        if defer:
            return
        try:
            for offset in range(0, nbytes, chunk_bytes):
                self.register(offset, min(chunk_bytes, nbytes - offset))
        except Exception:
            self.close()
            raise

    def register(self, offset: int, size: int) -> None:
        """Register bytes ``[offset, offset + size)`` (at most 64 GiB), from any thread.

        The chunk's device address must continue the others' (unified addressing),
        so one alias based at byte 0 covers every registered chunk.
        """
        if size > REGISTER_CHUNK_BYTES or offset < 0 or offset + size > self.nbytes:
            raise ArenaError(
                f"cannot register [{offset}, {offset + size}) of a {self.nbytes}-byte range in "
                f"one call: chunks are at most {REGISTER_CHUNK_BYTES} bytes and inside the range"
            )
        runtime = self._cupy.cuda.runtime
        ptr = self.host_ptr + offset
        device = self.device_index
        with contextlib.nullcontext() if device is None else self._cupy.cuda.Device(device):
            runtime.hostRegister(ptr, size, _PORTABLE | _MAPPED)
            self._chunks.append(ptr)
            base = runtime.pointerGetAttributes(ptr).devicePointer - offset
        if self.device_ptr is None:
            self.device_ptr = base
        elif base != self.device_ptr:
            self._chunks.pop()
            runtime.hostUnregister(ptr)
            raise ArenaError(
                f"registered chunk at offset {offset} maps to device address {base + offset:#x}, "
                f"expected {self.device_ptr + offset:#x} (contiguous): this platform has no "
                "unified addressing; use an arena of at most 64 GiB"
            )

    def device_alias(self, device: torch.device | str) -> torch.Tensor:
        """The uint8 CUDA tensor of ``nbytes`` on ``device`` aliasing the registered range.

        Built once per device and cached: with that device's id given explicitly
        (not taken from the pointer, whose attributes name the device current at
        registration), and checked to be the registered range itself on that
        device. Never a copy: a mismatch raises :class:`ArenaError`.
        """
        device = torch.device(device)
        if device.type != "cuda":
            raise ArenaError(f"a device alias needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        alias = self._aliases.get(index)
        if alias is not None:
            return alias
        cupy = self._cupy
        if self.device_ptr is None:
            raise ArenaError("no chunk of the arena is registered yet: no device alias")
        with cupy.cuda.Device(index):
            memory = cupy.cuda.UnownedMemory(self.device_ptr, self.nbytes, self, device_id=index)
            array = cupy.ndarray(
                (self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
            alias = _as_torch(array)
        expected = torch.device("cuda", index)
        if alias.device != expected or alias.data_ptr() != self.device_ptr:
            raise ArenaError(
                f"the device alias of the arena is {alias.device} at {alias.data_ptr():#x}, "
                f"expected {expected} at {self.device_ptr:#x} (the registered range itself): "
                "this torch/CuPy pair copies instead of aliasing; use another torch or CuPy "
                "version, or register_cuda='never' for unregistered copies"
            )
        if alias.numel() != self.nbytes:
            raise ArenaError(f"the device alias has {alias.numel()} bytes, expected {self.nbytes}")
        self._aliases[index] = alias
        return alias

    def close(self) -> None:
        """Unregister every chunk (idempotent)."""
        self._aliases.clear()
        while self._chunks:
            ptr = self._chunks.pop()
            try:
                self._cupy.cuda.runtime.hostUnregister(ptr)
            except Exception as exc:  # never mask the caller's error or leave close half-done
                log.warning("cudaHostUnregister(%#x) failed: %s", ptr, exc)


def _as_torch(array) -> torch.Tensor:
    """The CuPy array as a torch tensor over the same memory, on the array's device.

    DLPack carries the device id the memory was wrapped with; the CUDA array
    interface (the fallback) names no device, and torch then asks the driver.
    Neither is given a ``device=``, which would copy on a mismatch.
    """
    try:
        return torch.from_dlpack(array)
    except Exception as exc:  # e.g. a torch/CuPy pair without a common DLPack version
        log.debug("DLPack export of the arena alias failed (%s); using __cuda_array_interface__",
                  exc)  # fmt: skip
        return torch.as_tensor(array)
