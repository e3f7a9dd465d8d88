"""The vLLM encoder-cache connector (the only part of ecoffload that imports vLLM).

``ECOffloadConnector`` is loaded on first access, so ``import ecoffload.connector``
works without vLLM installed; vLLM's factory does ``getattr(module, name)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors
    from .connector import ECOffloadConnector

__all__ = ["ECOffloadConnector"]


def __getattr__(name: str) -> Any:
    if name == "ECOffloadConnector":
        from .connector import ECOffloadConnector

        return ECOffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
