"""The planner's C fast pass (``plan_native.c``): built at install time, loaded once per process.

The copy planner's Python passes cost interpreter time per extent; ``plan_native.c``
does the same work without it, reading a step table's int64 arrays or Python tuples
(BENCHMARKS.md, "Host cost of a step's copy"). It is the extension module
``ecoffload.kernels._plan_native``, compiled by ``pip install`` (``setup.py``;
a wheel carries it built), so a serving host never runs a compiler, and
nothing is written at run time.

The extension is optional: where the install found no C compiler or no
Python headers it warned and went on, and planning stays in Python (correct,
slower for fragmented steps); the first :func:`planner` call logs that once.

Environment:
    ECOFFLOAD_NATIVE_PLAN=0   never load it (plan in Python)
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType

log = logging.getLogger(__name__)

MODULE_NAME = f"{__package__}._plan_native"  # PyInit__plan_native in plan_native.c

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # "module": the loaded module, or None once refused


class NativeBuildError(RuntimeError):
    """The C fast pass was not built into this install, or does not load."""


def enabled() -> bool:
    """Whether the environment allows the C fast pass (``ECOFFLOAD_NATIVE_PLAN`` not ``0``)."""
    return os.environ.get("ECOFFLOAD_NATIVE_PLAN", "1").strip() != "0"


def planner() -> ModuleType | None:
    """The C fast pass, or None when disabled or not built; decided once per process
    (the first call; a step pays a dict lookup), a missing build logged once."""
    try:
        return _loaded["module"]
    except KeyError:
        pass
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _decide()
        return _loaded["module"]


def _decide() -> ModuleType | None:
    if not enabled():
        return None
    try:
        return load()
    except NativeBuildError as e:
        log.warning("ecoffload: copy planning stays in Python (slower for fragmented steps): "
                    "%s", e)  # fmt: skip
        return None


def forget() -> None:
    """Drop this process's outcome, so the next :func:`planner` call decides again (tests)."""
    with _lock:
        _loaded.clear()


def load() -> ModuleType:
    """The built extension module; raises NativeBuildError naming what to do when absent."""
    try:
        return importlib.import_module(MODULE_NAME)
    except ImportError as e:
        raise NativeBuildError(
            f"{MODULE_NAME} is not built in this install ({e}): reinstall ecoffload on a host "
            "with a C compiler and this Python's headers (e.g. gcc and python3-dev; "
            "`pip install -e .` again after editing kernels/plan_native.c), or set "
            "ECOFFLOAD_NATIVE_PLAN=0 to plan in Python without this warning"
        ) from e
