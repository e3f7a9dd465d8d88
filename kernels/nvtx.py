"""NVTX ranges for Nsight Systems, in the domain ``ecoffload``.

Off by default and free when off: ``nvtx_range(name)`` then returns one shared
no-op context manager. Enable with ``ECOFFLOAD_NVTX=1`` (read at import) or
:func:`set_enabled`. The ``nvtx`` package is optional: without it, ranges
stay off and a warning says why. It lives in the lowest layer (kernels/) so the
kernels, the engine and the connector can all mark ranges without importing
upwards.

    nsys profile -t cuda,nvtx env ECOFFLOAD_NVTX=1 python -m ecoffload.profiling.bench
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

DOMAIN = "ecoffload"
ENV_VAR = "ECOFFLOAD_NVTX"
_NULL = contextlib.nullcontext()
_annotate: Callable[..., Any] | None = None

F = TypeVar("F", bound=Callable[..., Any])


def set_enabled(enabled: bool) -> bool:
    """Turn ranges on or off; returns whether they are on (False if nvtx is missing)."""
    global _annotate
    if not enabled:
        _annotate = None
        return False
    try:
        import nvtx
    except ImportError:
        log.warning("%s=1 but the nvtx package is not installed: pip install nvtx", ENV_VAR)
        _annotate = None
        return False
    _annotate = functools.partial(nvtx.annotate, domain=DOMAIN)
    return True


def enabled() -> bool:
    return _annotate is not None


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    """A context manager that marks ``name`` on the timeline when ranges are on."""
    return _NULL if _annotate is None else _annotate(message=name)


def traced(name: str) -> Callable[[F], F]:
    """Decorator form of :func:`nvtx_range` (checks the switch at every call)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _annotate is None:
                return fn(*args, **kwargs)
            with _annotate(message=name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


set_enabled(os.environ.get(ENV_VAR, "0").lower() in ("1", "true", "yes", "on"))
