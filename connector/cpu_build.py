"""What vLLM's CPU build needs in every process to serve multimodal models.

vLLM 0.32 imports helpers from transformers modules that import torchvision:
``model_executor/models/pixtral.py`` (imported by ``vision.py``, so by every
multimodal model, PaliGemma included) imports ``_num_image_tokens`` from
``image_processing_pixtral``; ``qwen2_vl.py`` (Qwen2-VL, and the models built on
it) imports ``smart_resize`` from ``image_processing_qwen2_vl``. PyPI's torchvision
does not load beside torch+cpu, so CPU hosts run without it and the import fails
while vLLM inspects the model or profiles its processor. transformers ships a PIL
twin of each of those modules (``image_processing_pil_*``) that defines the
helpers vLLM imports; :class:`TwinAlias` serves a twin's names under the
torchvision module's name (:data:`TWINS`), and only when torchvision is absent
(where it is installed, nothing changes). It is lazy: nothing is imported until
vLLM asks for the module (an eager transformers import would cost seconds in
every process).

Every process, not only the first: vLLM starts its engine core and workers
with ``multiprocessing`` (spawn by default: fresh interpreters that inherit
the environment, not ``sys.meta_path``). :func:`install` puts the alias in
this process and sets :data:`ENV_VAR` for its children; ecoffload's
``vllm.general_plugins`` entry point, which vLLM loads in each of its
processes before it builds a model (``connector/plugin.py``), calls
:func:`install_if_enabled`. ``ecoffload-vllm`` calls :func:`install`, so no
PYTHONPATH or ``sitecustomize`` is needed; ``vllm.LLM`` users on a CPU host
call it themselves before creating the ``LLM``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

#: Set to ``1`` in a process whose vLLM children must install the alias too.
ENV_VAR = "ECOFFLOAD_VLLM_CPU_BUILD"

#: Each torchvision module vLLM imports from, and its PIL twin in transformers.
TWINS = {
    "transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral"
    ),
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
    ),
}


class _TwinLoader(importlib.abc.Loader):
    """Executes the target module as a copy of its twin's public names."""

    def __init__(self, twin: str) -> None:
        self.twin = twin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        twin = importlib.import_module(self.twin)
        module.__dict__.update({k: v for k, v in vars(twin).items() if not k.startswith("__")})


class TwinAlias(importlib.abc.MetaPathFinder):
    """Finds each module of :data:`TWINS` as its PIL twin when torchvision is not installed."""

    def find_spec(
        self,
        fullname: str,
        path: object = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        twin = TWINS.get(fullname)
        if twin is None or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, _TwinLoader(twin))


def install_twin_alias() -> None:
    """Put :class:`TwinAlias` first on ``sys.meta_path`` of this process (idempotent)."""
    if not any(isinstance(f, TwinAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, TwinAlias())


def install() -> None:
    """The alias in this process and, through :data:`ENV_VAR`, in every process it starts."""
    os.environ[ENV_VAR] = "1"
    install_twin_alias()


def install_if_enabled() -> bool:
    """In a child: install the alias if the process that started it asked for it."""
    if os.environ.get(ENV_VAR) != "1":
        return False
    install_twin_alias()
    return True
