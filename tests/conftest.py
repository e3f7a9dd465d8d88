"""Test set-up: the Triton interpreter for CPU runs, temporary arena directories.

TRITON_INTERPRET must be set before any kernel module is imported, so it is
set here, at collection time. It is left alone when CUDA is available, so
`pytest -m gpu` compiles the real kernels.
"""

import os
import sys

import pytest

# The repository's top level holds folders named kernels/, engine/, ... that must
# only ever be imported as ecoffload.*; `python -m pytest` puts the current
# directory on sys.path, where e.g. transformers' probe for the HF `kernels`
# package would find ours. Importing from the installed package only.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI replays the same examples every run (a red CI must be reproducible);
# locally hypothesis explores new ones each time.
if os.environ.get("CI"):
    from hypothesis import settings

    settings.register_profile("ecoffload-ci", derandomize=True, database=None)
    settings.load_profile("ecoffload-ci")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def arena_dir(tmp_path):
    """A private directory for arena files; checked empty afterwards (nothing leaked)."""
    d = tmp_path / "arenas"
    d.mkdir()
    yield str(d)
    left = os.listdir(d)
    assert not left, f"arena files leaked: {left}"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """vLLM's ModelConfig of a tiny local Llama (vLLM tests only)."""
    from vllm_harness import tiny_model_config

    return tiny_model_config(str(tmp_path_factory.mktemp("tiny-llama")))
