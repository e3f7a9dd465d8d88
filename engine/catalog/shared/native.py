"""The shared catalog's C fast paths (``native.c``): loaded once per process, one
:class:`HitPath` per catalog object.

A hit with pin, a pin and an unpin of an item the catalog object has seen READY
cost ~40 reads and writes of shared words and two ctypes calls of the robust mutex
from Python; the extension module ``ecoffload.engine.catalog.shared._catalog_native``
does the same work in C, several times faster (BENCHMARKS.md, "Shared catalog"). It
answers only the usual case (mutex free, catalog clean, the entry still the
reservation seen, a pin record at hand) and otherwise writes nothing and sends the
call the Python way, which handles everything else.
It is never used while ``fault_points.hook`` is set.

The module exports the word offsets it was compiled with (``LAYOUT``); it is
refused (logged once, the Python methods run) unless they equal
:mod:`.format`'s, so the layout has one source of truth.

Built at install time (``setup.py``, optional: without a compiler the install
warns and the catalog runs its Python methods, which write the same words).

Environment:
    ECOFFLOAD_NATIVE_CATALOG=0   never use it (read when a catalog opens)
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING

from ..catalog import ItemState
from . import fault_points
from . import format as fmt

if TYPE_CHECKING:
    from ._catalog_native import HitPath  # its stub (_catalog_native.pyi)
    from .state import CatalogState

log = logging.getLogger(__name__)

MODULE_NAME = f"{__package__}._catalog_native"  # PyInit__catalog_native
ENV_VAR = "ECOFFLOAD_NATIVE_CATALOG"

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # "module": the module, or None once refused


def enabled() -> bool:
    """Whether the environment allows the C fast paths (``ECOFFLOAD_NATIVE_CATALOG`` not ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def module() -> ModuleType | None:
    """The checked extension module, or None when not built or built for another layout;
    decided once per process, a refusal logged once."""
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _load()
        return _loaded["module"]


def _load() -> ModuleType | None:
    try:
        mod = importlib.import_module(MODULE_NAME)
    except ImportError as e:
        log.warning(
            "ecoffload: shared catalog hits stay in Python (~5 us each instead of <1): %s is "
            "not built in this install (%s); reinstall on a host with a C compiler and this "
            "Python's headers, or set %s=0 to silence this", MODULE_NAME, e, ENV_VAR,
        )  # fmt: skip
        return None
    wrong = {name: (value, getattr(fmt, name, None)) for name, value in mod.LAYOUT.items()
             if getattr(fmt, name, None) != value}  # fmt: skip
    if wrong:
        log.warning(
            "ecoffload: shared catalog hits stay in Python: %s was built for another layout "
            "than engine/catalog/shared/format.py (name: (built, source) %s); reinstall ecoffload "
            "(`pip install -e .` again after editing either file)", mod.__file__, wrong,
        )  # fmt: skip
        return None
    return mod


def forget() -> None:
    """Drop this process's decision, so the next :func:`module` call decides again (tests)."""
    with _lock:
        _loaded.clear()


def hit_path(catalog: CatalogState) -> HitPath | None:
    """The C fast paths over ``catalog``'s region (bound: ``_w``, ``_seen``, layout, owner),
    or None when disabled, not built or refused."""
    mod = module() if enabled() else None
    if mod is None:
        return None
    lay = catalog.layout
    return mod.HitPath(catalog._w, catalog._seen, ItemState.READY, fault_points, catalog._sl,
                       catalog._pn, lay.max_items, lay.max_pins, catalog._pid,
                       catalog._start)  # fmt: skip
