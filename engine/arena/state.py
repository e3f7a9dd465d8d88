"""What the parts of :class:`~.arena.Arena` share, declared once and typed.

``Arena`` (``arena.py``: the file, its mapping and header, create / attach / close)
is assembled with two parts that derive from :class:`ArenaState`: ``lifetime.py``
(who holds a shared arena, warm starts) and ``registration.py`` (CUDA host
registration). The attributes are the ones ``Arena.__init__`` sets from the header;
the methods declared under ``TYPE_CHECKING`` are the ones a part calls in another,
implemented where the comment says: the declarations only tell readers and the type
checker what each part offers the others, and cost nothing at run time.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ..base.errors import ArenaError
from ..base.liveness import ProcessId
from .format import PopulateMode, RegisterMode
from .populate import Populator

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self


class Worker(Protocol):
    """A thread working on the arena's file for a layer above it (the background
    verifier of a warm start): the arena's close stops it."""

    def stop(self) -> None: ...


class ArenaState:
    path: str  # the arena file
    created: bool  # this object created the file
    _fd: int
    _mm: mmap.mmap | None  # None once closed
    _unlinked: bool  # the name was removed by this object
    block_bytes: int
    num_blocks: int
    nbytes: int  # block_bytes * num_blocks: the data area
    nonce: int  # random per file: tells an arena from a later one of the same name
    meta_offset: int  # the metadata region (a shared catalog): [meta_offset, data offset)
    meta_bytes: int
    _data_offset: int
    _creator: ProcessId  # the creating process
    layout_key: str
    lifetime: int  # 0, or SHARED_LIFETIME | PERSISTENT (format.py)
    warm_started: bool  # open_shared found the file held by nobody
    _opener: int  # the pid that opened it (a forked child shares the description only)
    host: torch.Tensor | None  # uint8 over the data area; None once closed
    device: torch.Tensor | None  # the CUDA alias of host, or None
    _populator: Populator | None  # this process's pre-faulting threads
    _verifier: Worker | None  # a warm start's background verifier (engine/background_verify.py)

    def _mapping(self) -> mmap.mmap:
        """The file's mapping, for the parts that read or write its header."""
        if self._mm is None:
            raise ArenaError(f"arena {self.path} is closed")
        return self._mm

    def host_tensor(self) -> torch.Tensor:
        """:attr:`host` of an open arena (ArenaError once closed)."""
        if self.host is None:
            raise ArenaError(f"arena {self.path} is closed")
        return self.host

    if TYPE_CHECKING:
        # arena.py
        def __init__(self, path: str, fd: int, mm: mmap.mmap, *, created: bool) -> None: ...
        @classmethod
        def _new(
            cls,
            name: str,
            *,
            block_bytes: int,
            num_blocks: int,
            layout_key: str | Mapping[str, object],
            directory: str,
            processes: int,
            register_cuda: RegisterMode,
            populate: PopulateMode,
            populate_threads: int | None,
            meta_bytes: int,
            lifetime: int,
        ) -> Self: ...
        def close(self) -> None: ...
        def _unlink(self) -> None: ...
        @property
        def ready_bytes(self) -> int: ...

        # registration.py
        def _register(self, mode: RegisterMode, populate: PopulateMode) -> None: ...

        # lifetime.py
        def _populator_alive(self) -> bool: ...
