"""Fault points inside the shared catalog's locked updates, for crash tests.

Tests set :data:`hook` to a callable that receives the name of each point
(``"reserve:allocated"``, ``"commit:published"``, ``"recover:slots"``, ...); it
may sleep there or SIGKILL the process. The hot paths test ``hook`` inline
(a call costs); the rest call :func:`fault`.
"""

from __future__ import annotations

from collections.abc import Callable

hook: Callable[[str], None] | None = None


def fault(point: str) -> None:
    """Run the hook at ``point``, if a test set one."""
    if hook is not None:
        hook(point)
