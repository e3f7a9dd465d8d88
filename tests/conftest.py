"""Test set-up: the Triton interpreter for CPU runs, temporary arena directories.

TRITON_INTERPRET must be set before any kernel module is imported, so it is
set here, at collection time. It is never set when CUDA is available: there,
every test that runs the kernel (marked `kernel` or `gpu`) runs it compiled;
`pytest -m "gpu or kernel"` is the GPU check's selection.

hypothesis is optional: without it, test files that import it are not
collected (and are listed at the end of the run), so the rest still runs.
"""

import os
import re
import sys
import time

import pytest

# The repository's top level holds folders named kernels/, engine/, ... that must
# only ever be imported as ecoffload.*; `python -m pytest` puts the current
# directory on sys.path, where e.g. transformers' probe for the HF `kernels`
# package would find ours. Importing from the installed package only.
_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)
# The same holds for tests/ itself (pytest puts this file's folder first on sys.path):
# its folders mirror the product's (tests/kernels/, tests/engine/...). The tests' shared
# helpers are in tests/support/, imported by their own names (`from copy_gate import ...`).
_SUPPORT = os.path.join(_TESTS, "support")
sys.path[:] = [_SUPPORT] + [
    p for p in sys.path if os.path.abspath(p or os.curdir) not in (_REPO, _TESTS, _SUPPORT)
]

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import hypothesis
except ImportError:
    hypothesis = None

# CI replays the same examples every run (a red CI must be reproducible);
# locally hypothesis explores new ones each time.
if os.environ.get("CI") and hypothesis is not None:
    hypothesis.settings.register_profile("ecoffload-ci", derandomize=True, database=None)
    hypothesis.settings.load_profile("ecoffload-ci")

_IMPORTS_HYPOTHESIS = re.compile(r"^(?:from|import) hypothesis\b", re.MULTILINE)
_NOT_COLLECTED: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # mutmut tests several mutants at once, each in a forked pytest session; sessions
    # sharing pytest's numbered temp folders delete each other's, so a test would fail
    # for that and its mutant count as killed: each session gets a folder of its own.
    mutation_tmp = os.environ.get("ECOFFLOAD_MUTATION_TMP")
    if mutation_tmp and config.option.basetemp is None:
        config.option.basetemp = os.path.join(mutation_tmp, str(os.getpid()))
    config.addinivalue_line(
        "markers",
        "kernel: runs the Triton kernel (compiled on CUDA, interpreted on CPU); "
        "the GPU check runs `pytest -m 'gpu or kernel'`",
    )


def pytest_ignore_collect(collection_path, config):
    """Without hypothesis, skip the test files that import it instead of failing collection."""
    if hypothesis is not None or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if _IMPORTS_HYPOTHESIS.search(collection_path.read_text(encoding="utf-8")):
        _NOT_COLLECTED.append(collection_path.name)
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    if _NOT_COLLECTED:
        terminalreporter.write_line(
            "not collected, hypothesis is not installed: " + ", ".join(sorted(_NOT_COLLECTED))
        )
    if _HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        terminalreporter.write_line(
            "TRITON_INTERPRET=1 was set although CUDA is available: kernel tests did not run "
            "compiled; unset it"
        )


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def planner_c_pass_built():
    """Load the planner's C pass (the extension the install built) before the first test,
    as a mover does at start, so no test pays the import inside its own timing.
    """
    from ecoffload.kernels import native

    native.planner()


@pytest.fixture
def nvtx_timeline(monkeypatch):
    """What ECOFFLOAD_NVTX=1 would put on the Nsight timeline: each range's name when
    it opens, "end" when it closes (the nvtx package itself is not needed)."""
    import contextlib

    from ecoffload.kernels import nvtx

    timeline = []

    @contextlib.contextmanager
    def annotate(message):
        timeline.append(message)
        yield
        timeline.append("end")

    monkeypatch.setattr(nvtx, "_annotate", annotate)
    return timeline


@pytest.fixture
def arena_dir(tmp_path):
    """A private directory for arena files; checked empty afterwards (nothing leaked)."""
    d = tmp_path / "arenas"
    d.mkdir()
    yield str(d)
    # A shared arena whose last holder was killed is removed by its janitor
    # process a moment later: give it a bounded moment.
    deadline = time.monotonic() + 5
    while os.listdir(d) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = os.listdir(d)
    assert not left, f"arena files leaked: {left}"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """vLLM's ModelConfig of a tiny local Llama (vLLM tests only)."""
    from vllm_harness import tiny_model_config

    return tiny_model_config(str(tmp_path_factory.mktemp("tiny-llama")))
