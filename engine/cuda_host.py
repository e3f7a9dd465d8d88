"""CUDA host registration of the arena through CuPy, and the device alias.

``cudaHostRegister(Portable | Mapped)`` pins the mmap'd pages and maps them into
the GPU's address space, so a kernel can read and write them over PCIe with
ordinary loads and stores (zero-copy). Registration goes in chunks of at most
64 GiB: single calls of hundreds of GiB fail on recent drivers.

The alias is a CUDA ``torch.Tensor`` whose storage is the registered range
(device pointer from ``pointerGetAttributes``; with UVA it equals the host
address), wrapped with ``cupy.cuda.UnownedMemory`` and ``torch.as_tensor``.
It owns nothing: the registration must outlive every alias.
"""

from __future__ import annotations

import logging

import torch

from .errors import ArenaError

log = logging.getLogger(__name__)

REGISTER_CHUNK_BYTES = 64 << 30
_PORTABLE, _MAPPED = 0x01, 0x02


class HostRegistration:
    """A host range registered with CUDA (Portable | Mapped), unregistered by ``close``."""

    def __init__(self, host_ptr: int, nbytes: int, chunk_bytes: int = REGISTER_CHUNK_BYTES):
        import cupy  # optional dependency: extras cuda12 / cuda13

        self._cupy = cupy
        self.host_ptr, self.nbytes = host_ptr, nbytes
        self._chunks: list[int] = []
        try:
            for offset in range(0, nbytes, chunk_bytes):
                size = min(chunk_bytes, nbytes - offset)
                cupy.cuda.runtime.hostRegister(host_ptr + offset, size, _PORTABLE | _MAPPED)
                self._chunks.append(host_ptr + offset)
            self.device_ptr = self._device_ptr_of_chunks(chunk_bytes)
        except Exception:
            self.close()
            raise

    def _device_ptr_of_chunks(self, chunk_bytes: int) -> int:
        runtime = self._cupy.cuda.runtime
        base = runtime.pointerGetAttributes(self.host_ptr).devicePointer
        for i, chunk in enumerate(self._chunks[1:], start=1):
            found = runtime.pointerGetAttributes(chunk).devicePointer
            if found != base + i * chunk_bytes:
                raise ArenaError(
                    f"registered chunk {i} maps to device address {found:#x}, expected "
                    f"{base + i * chunk_bytes:#x} (contiguous): this platform has no unified "
                    "addressing; use an arena of at most 64 GiB"
                )
        return base

    def device_alias(self, device: torch.device) -> torch.Tensor:
        """A uint8 CUDA tensor of ``nbytes`` aliasing the registered range."""
        cupy = self._cupy
        with cupy.cuda.Device(device.index or 0):
            memory = cupy.cuda.UnownedMemory(self.device_ptr, self.nbytes, owner=self)
            array = cupy.ndarray(
                (self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
        return torch.as_tensor(array, device=device)

    def close(self) -> None:
        """Unregister every chunk (idempotent)."""
        while self._chunks:
            ptr = self._chunks.pop()
            try:
                self._cupy.cuda.runtime.hostUnregister(ptr)
            except Exception as exc:  # never mask the caller's error or leave close half-done
                log.warning("cudaHostUnregister(%#x) failed: %s", ptr, exc)
