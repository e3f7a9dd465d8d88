"""vLLM general plugin: refuse a bad ``ec_connector_extra_config`` where it is parsed.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes
before it builds its configuration (``vllm serve``'s front end first). This
one makes ``ECTransferConfig`` validate ecoffload's extra config as soon as
it is constructed, so a typo stops ``vllm serve`` / ``vllm.LLM`` at argument
parsing, in the first process, with one message naming the key, what was
expected and what was found, instead of minutes later inside the engine
process under several tracebacks. The connector validates again when it
starts (the plugin can be disabled with ``VLLM_PLUGINS``).

The same entry point carries the CPU build's pixtral alias into every vLLM
process whose launcher asked for it (``connector/cpu_build.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from .cpu_build import install_if_enabled

CONNECTOR_NAMES = ("ECOffloadConnector",)
MODULE_PATHS = ("ecoffload.connector", "ecoffload.connector.connector")


def is_ecoffload(transfer: Any) -> bool:
    """Whether an ``ECTransferConfig`` selects ecoffload's connector."""
    path = getattr(transfer, "ec_connector_module_path", None)
    return getattr(transfer, "ec_connector", None) in CONNECTOR_NAMES and (
        path is None or path in MODULE_PATHS
    )


def register() -> None:
    """Entry point: wrap ``ECTransferConfig.__post_init__`` once per process."""
    install_if_enabled()
    from vllm.config import ECTransferConfig

    original = ECTransferConfig.__post_init__
    if getattr(original, "_ecoffload_validates", False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        if is_ecoffload(self):
            from .config import OffloadConfig

            # The default name needs the model; any valid name checks the rest.
            OffloadConfig.from_extra_config(self.ec_connector_extra_config, default_name="check")

    __post_init__._ecoffload_validates = True  # type: ignore[attr-defined]
    ECTransferConfig.__post_init__ = __post_init__
