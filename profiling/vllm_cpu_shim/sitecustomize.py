"""Put this folder on PYTHONPATH so vLLM's child processes get the alias too.

vLLM 0.32's pixtral.py imports transformers' torchvision image processor
module; without a working torchvision (the case beside torch+cpu) its PIL
twin, which defines the same names, stands in. The hook is lazy: nothing is
imported at start-up (an eager transformers import costs seconds in every
process); the first import of the torchvision module gets the twin's names.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_TARGET = "transformers.models.pixtral.image_processing_pixtral"
_TWIN = "transformers.models.pixtral.image_processing_pil_pixtral"


class _TwinLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        twin = importlib.import_module(_TWIN)
        module.__dict__.update({k: v for k, v in vars(twin).items() if not k.startswith("__")})


class _PixtralAlias(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, _TwinLoader())


if not any(type(f).__name__ == "_PixtralAlias" for f in sys.meta_path):
    sys.meta_path.insert(0, _PixtralAlias())
