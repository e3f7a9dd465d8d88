"""Put this folder on PYTHONPATH so vLLM's child processes get the alias too.

vLLM 0.32's pixtral.py imports transformers' torchvision image processor;
without a working torchvision (the case beside torch+cpu) its PIL twin, which
exports the same name, stands in. No-op when torchvision is importable.
"""


def _alias() -> None:
    import contextlib
    import importlib
    import importlib.util
    import sys

    key = "transformers.models.pixtral.image_processing_pixtral"
    if key in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    with contextlib.suppress(ImportError):  # no transformers here: nothing to alias
        sys.modules[key] = importlib.import_module(
            "transformers.models.pixtral.image_processing_pil_pixtral"
        )


_alias()
del _alias
