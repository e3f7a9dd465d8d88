"""CUDA host registration of an arena's data area, following its ready prefix.

With CUDA (and CuPy), each process registers the data area with the driver
(Portable | Mapped, :mod:`.cuda_host`) for itself, span by span as the ready
prefix grows (in a background thread; at once for ``eager`` populate and for
``register_cuda="always"``), and ``Arena.device_view`` is a CUDA tensor
aliasing it. ``Arena.covers`` says whether blocks may be copied through the
alias; others go through ``Arena.host``. A span whose registration fails stays
host-only (one warning). Without CUDA, ``Arena.device`` is None and only
``Arena.host`` exists.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..base.errors import ArenaError
from . import populate as _populate
from .cuda_host import REGISTER_CHUNK_BYTES, HostRegistration
from .format import PopulateMode, RegisterMode, read_ready
from .state import ArenaState

# the arena's messages, whichever part logs them
log = logging.getLogger("ecoffload.engine.arena.arena")

REGISTER_SPAN = 1 << 30  # largest single cudaHostRegister while following the prefix


class Registrar:
    """Registers a process's view of the ready prefix with CUDA, span by span.

    Spans start at one populate chunk and double up to ``span`` (few calls,
    yet the first blocks are usable at once). A span whose registration fails
    is skipped (one warning) and its blocks stay host-only. The device alias is
    built after the first registered span; without it nothing is covered.
    """

    def __init__(self, registration, nbytes: int, path: str, span: int) -> None:
        self._registration, self._nbytes, self._path = registration, nbytes, path
        self._span = span
        self.alias: torch.Tensor | None = None  # built after the first registered span
        self.end = 0  # bytes handled (registered or failed): a prefix
        self.registered_bytes = 0
        self.failed: list[tuple[int, int]] = []  # byte ranges left unregistered
        self.first_error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, ready: int) -> None:
        """Register what of ``[end, ready)`` makes a span worth a call."""
        while self.end < ready and not self._stop.is_set():
            size = min(ready - self.end, self._span)
            if ready < self._nbytes and size < min(
                self._span, max(_populate.POPULATE_CHUNK, self.end)
            ):
                return  # wait for a longer span
            try:
                self._registration.register(self.end, size)
            except Exception as exc:
                exc.with_traceback(None)  # kept (and logged): must not hold frames on the mapping
                self.failed.append((self.end, self.end + size))  # before end moves past it
                if self.first_error is None:
                    self.first_error = exc
                    log.warning(
                        "arena %s: CUDA host registration failed for bytes [%d, %d) (%s); "
                        "copies of blocks there fall back to host memory, the rest use the "
                        "registered alias", self._path, self.end, self.end + size, exc,
                    )  # fmt: skip
                else:
                    log.debug("arena %s: registration of [%d, +%d) failed too: %s",
                              self._path, self.end, size, exc)  # fmt: skip
            else:
                self.registered_bytes += size
                if self.alias is None and not self._make_alias():
                    self.end = self._nbytes  # no alias, nothing to register for
                    return
            self.end += size

    def _make_alias(self) -> bool:
        reg = self._registration
        try:
            index = reg.device_index
            if index is None:
                index = torch.cuda.current_device()
            self.alias = reg.device_alias(torch.device("cuda", index))
        except Exception as exc:
            exc.with_traceback(None)
            self.first_error = self.first_error or exc
            log.warning(
                "arena %s: CUDA host registration failed: no device alias (%s); transfers "
                "fall back to host copies", self._path, exc,
            )  # fmt: skip
            return False
        return True

    def covers(self, extents: Sequence[tuple[int, int]] | np.ndarray, block_bytes: int) -> bool:
        """Whether every block of ``extents`` lies in a registered span."""
        end, failed = self.end, self.failed  # end first: every failed span below it is listed
        if self.alias is None:
            return False
        if end >= self._nbytes and not failed:
            return True
        for start, count in extents:
            lo, hi = start * block_bytes, (start + count) * block_bytes
            if hi > end or any(lo < b and a < hi for a, b in failed):
                return False
        return True

    def start(self, ready_of) -> None:
        """Follow ``ready_of()`` (the ready prefix) in a background thread."""
        self._thread = threading.Thread(
            target=self._loop, args=(ready_of,), name="ecoffload-register", daemon=True
        )
        self._thread.start()

    def _loop(self, ready_of) -> None:
        while not self._stop.is_set() and self.end < self._nbytes:
            self.step(ready_of())
            self._stop.wait(0.005)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class RegisteredArena(ArenaState):
    """The registration half of :class:`~ecoffload.engine.arena.arena.Arena` (a mixin: it
    reads the arena's mapping, size and path, and sets its ``device``)."""

    _registration: HostRegistration | None  # this process's CUDA registration, or None
    _registrar: Registrar | None  # the thread registering the ready prefix span by span

    @property
    def registered(self) -> bool:
        """True when this process registers the data area with CUDA (all of it, or
        chunk by chunk as it becomes ready: see :meth:`covers`)."""
        return self._registration is not None

    @property
    def registered_fraction(self) -> float:
        """Share of the data area this process has registered with CUDA (0.0 without)."""
        r = self._registrar
        return 0.0 if r is None else r.registered_bytes / self.nbytes

    def covers(self, extents: Sequence[tuple[int, int]] | np.ndarray) -> bool:
        """Whether the device alias may touch every block of ``extents`` in this process
        (every block lies in a chunk it registered); else copy them through :attr:`host`."""
        r = self._registrar
        return r is not None and r.covers(extents, self.block_bytes)

    def device_view(self, device: torch.device) -> torch.Tensor:
        """The CUDA alias of the data area on ``device`` (once a first chunk is
        registered; copy only blocks :meth:`covers` accepts through it)."""
        r = self._registrar
        if self._registration is None or r is None or r.alias is None:
            raise ArenaError(f"arena {self.path} is not registered with CUDA: no device view")
        if r.alias.device == torch.device(device):
            self.device = r.alias
            return r.alias
        return self._registration.device_alias(device)

    def _register(self, mode: RegisterMode, populate: PopulateMode) -> None:
        if mode == "never":
            return
        if not torch.cuda.is_available():
            if mode == "always":
                raise ArenaError("register_cuda='always' but CUDA is not available")
            return
        from .cuda_host import HostRegistration

        try:
            self._registration = HostRegistration(
                self.host_tensor().data_ptr(), self.nbytes, defer=True,
                device_index=torch.cuda.current_device(),  # torch's, for background threads too
            )  # fmt: skip
        except Exception as exc:
            self._registration_failed(mode, exc)
            return
        mm, nbytes = self._mapping(), self.nbytes
        if mode != "always" and populate != "eager":
            self._registrar = Registrar(self._registration, nbytes, self.path, REGISTER_SPAN)
            self._registrar.start(lambda: read_ready(mm, nbytes))
            return
        registrar = Registrar(self._registration, nbytes, self.path, REGISTER_CHUNK_BYTES)
        try:  # synchronous: the caller gets an arena registered as far as it can be
            while registrar.end < nbytes:
                registrar.step(read_ready(mm, nbytes))
                if registrar.end < nbytes:
                    if not self._populator_alive():  # its populate will never finish
                        raise ArenaError("the populating process died before populating it")
                    time.sleep(0.005)
            if mode == "always" and registrar.first_error is not None:
                raise registrar.first_error
        except Exception as exc:
            mm = None  # the error's traceback keeps this frame: let close unmap
            self._registration.close()
            self._registration_failed(mode, exc)
            return
        if registrar.alias is None:  # nothing usable (and said so): plain host copies
            self._registration.close()
            self._registration = None
            return
        self._registrar, self.device = registrar, registrar.alias

    def _registration_failed(self, mode: RegisterMode, exc: Exception) -> None:
        self._registration = None
        if mode == "always":
            raise ArenaError(f"CUDA host registration of {self.path} failed: {exc}") from exc
        log.warning(
            "arena %s: CUDA host registration failed (%s); transfers fall back to "
            "unregistered copies. Install ecoffload[cuda12] or [cuda13] for CuPy.",
            self.path,
            exc.with_traceback(None),  # kept by handlers: must not hold frames on the mapping
        )
