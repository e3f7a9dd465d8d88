"""Choosing which planner pass ``plan_copy`` runs, for tests of each pass."""

import os
import shutil

import pytest

from ecoffload.kernels import native, planner

PLANNERS = ("native", "small", "vectorised", "loop")


def use_planner(monkeypatch, name: str) -> None:
    """Make ``plan_copy`` plan every valid step with one pass: "native" (the C pass; the
    test skips where the install could not build it: no C compiler at all, and fails if
    one is there but the extension is missing), "small" or "vectorised" (the Python
    passes) or "loop"."""
    if name == "native":
        module = require_native()
        monkeypatch.setattr(native, "planner", lambda: module)  # whatever the environment says
        return
    monkeypatch.setattr(native, "planner", lambda: None)
    # vectorised: every step with an extent (it needs one; an empty step takes the small pass)
    monkeypatch.setattr(planner, "VECTORISE_FROM", 1 if name == "vectorised" else 10**9)
    if name == "loop":
        monkeypatch.setattr(planner, "segments_small", lambda *args: None)


def require_native():
    """The C pass, loaded (skip only where no C compiler exists, so the install could not
    build it; with a compiler, a missing extension fails: reinstall, ``pip install -e .``)."""
    if not os.environ.get("CC") and not any(map(shutil.which, ("cc", "gcc", "clang"))):
        pytest.skip("no C compiler on this host: the planner's C pass cannot be built")
    return native.load()
