"""The planner's C fast pass (``plan_native.c``): built once per host, loaded once per process.

The copy planner's Python passes cost ~0.7 us of interpreter time per extent;
``plan_native.c`` does the same work in ~35 ns (measured: 670 us for 19,200 extents,
most of it reading the extents out of Python tuples). It is compiled on first use
with the host's C compiler against this Python's headers (the same toolchain
Triton needs to launch its kernels on a GPU), into a cache folder, keyed by
the hash of the source, the compiler and the Python build; later processes
only load it. :func:`warm_up` (and so every ``BlockMover``) loads it at start,
so no step ever waits for a compiler.

Where no compiler works, planning stays in Python (correct, slower for
fragmented steps) and the reason is logged once.

Environment:
    ECOFFLOAD_NATIVE_PLAN=0   never build or load it (plan in Python)
    ECOFFLOAD_CACHE_DIR       where the built module goes
                              (default ``$XDG_CACHE_HOME/ecoffload``, else ``~/.cache/ecoffload``)
    CC                        the C compiler (default: the first of cc, gcc, clang on PATH)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("plan_native.c")
MODULE_NAME = "ecoffload_plan_native"  # PyInit_ecoffload_plan_native in the source
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # "module": the loaded module, or None once refused


class NativeBuildError(RuntimeError):
    """The C fast pass could not be built or loaded on this host."""


def enabled() -> bool:
    """Whether the environment allows the C fast pass (``ECOFFLOAD_NATIVE_PLAN`` not ``0``)."""
    return os.environ.get("ECOFFLOAD_NATIVE_PLAN", "1").strip() != "0"


def planner() -> ModuleType | None:
    """The loaded C fast pass, building it on the first call; None when disabled or unbuildable.

    The outcome, like ``ECOFFLOAD_NATIVE_PLAN``, is read once per process (the
    first call; a step pays a dict lookup): a failed build is logged once and
    not retried.
    """
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


def cache_dir() -> Path:
    if os.environ.get("ECOFFLOAD_CACHE_DIR"):
        return Path(os.environ["ECOFFLOAD_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ecoffload"
    try:
        return Path.home() / ".cache" / "ecoffload"
    except RuntimeError as e:  # no HOME and no passwd entry (some containers)
        raise NativeBuildError(f"no home folder to build in ({e}): set ECOFFLOAD_CACHE_DIR") from e


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` (split as a shell would: ``gcc -pthread``), else the
    first of cc, gcc, clang on PATH."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise NativeBuildError(
        "no C compiler found (looked for $CC, cc, gcc, clang): install one (e.g. gcc) or set "
        "CC; ECOFFLOAD_NATIVE_PLAN=0 plans in Python without asking"
    )


def built_path() -> tuple[Path, list[str]]:
    """(where the module for this source, compiler and Python goes, the command that builds it
    into ``{out}``)."""
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # CPython's own release flags: asserts off, signed overflow defined.
    flags = ["-O2", "-DNDEBUG", "-fwrapv", "-shared", "-fPIC", f"-I{include}"]
    command = [*compiler(), *flags, str(SOURCE), "-o", "{out}"]
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update("\0".join([*command[:-3], include, suffix]).encode())
    return cache_dir() / f"plan_native-{key.hexdigest()[:16]}{suffix}", command


def load() -> ModuleType:
    """Load the built module, building it first if this host has not; raises NativeBuildError."""
    try:
        path, command = built_path()
        if not path.exists():
            build(path, command)
    except OSError as e:  # the source unreadable, a cache folder that cannot be searched...
        raise NativeBuildError(f"cannot build or find the C pass: {e}") from e
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)  # an extension module
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise NativeBuildError(f"{path} does not load ({e}); delete it to rebuild") from e
    return module


def build(path: Path, command: list[str]) -> None:
    """Compile into a private folder, then rename the module into place: processes building
    at once never see a partial module (and it gets the usual permissions, not a temporary
    file's owner-only ones, so users sharing a cache folder can load it)."""
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        raise NativeBuildError(
            f"Python.h not found in {sysconfig.get_paths()['include']}: install this Python's "
            "development headers (e.g. python3-dev)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        private = tempfile.mkdtemp(dir=path.parent, prefix=".plan_native-")
    except OSError as e:
        raise NativeBuildError(
            f"cannot write to {path.parent} ({e}): set ECOFFLOAD_CACHE_DIR to a writable folder"
        ) from e
    tmp = os.path.join(private, path.name)
    argv = [tmp if a == "{out}" else a for a in command]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeBuildError(
                f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-800:]}"
            )
        os.replace(tmp, path)
        log.info("ecoffload: built the copy planner's C pass into %s", path)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{' '.join(argv)} failed: {e}") from e
    finally:
        shutil.rmtree(private, ignore_errors=True)
