"""Types of the shared catalog's C hits, pins and unpins (``native.c``, built by
``pip install``; loaded and checked by ``native.py``). Each call answers the usual
case, or an int: 0 for "do it the Python way", else a mutex error code."""

from collections.abc import Sequence
from types import ModuleType

from .format import SharedEntry

LAYOUT: dict[str, int]  # the word offsets it was compiled with (native.py compares them)

class HitPath:
    hits: int  # served here
    pins: int
    unpins: int  # keys unpinned here
    slow: int  # calls sent the Python way
    def __init__(
        self,
        words: memoryview,
        seen: dict[str, SharedEntry],
        ready: object,
        fault_points: ModuleType,
        slots_at: int,
        pins_at: int,
        max_items: int,
        max_pins: int,
        pid: int,
        start: int,
    ) -> None: ...
    def hit(self, key: str, pin: bool, /) -> SharedEntry | int: ...
    def pin(self, key: str, /) -> SharedEntry | int: ...
    def unpin(self, keys: Sequence[str], /) -> bool | int: ...
    def identify(self, pid: int, start: int, /) -> None: ...
