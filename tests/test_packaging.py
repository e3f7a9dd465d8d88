"""The distribution installs one package, `ecoffload`, and nothing at top level."""

import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_outside_repo(code, tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env},
        timeout=300,
    )


def test_fresh_interpreter_imports_subpackages_but_no_top_level_ones(tmp_path):
    code = (
        "import importlib, ecoffload.kernels, ecoffload.engine, ecoffload.connector, "
        "ecoffload.profiling, ecoffload.tools\n"
        "for name in ('kernels', 'engine', 'connector', 'profiling', 'tools'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'top-level {name} is importable')\n"
        "print(ecoffload.kernels.pack.__module__)\n"
    )
    out = run_outside_repo(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ecoffload.kernels.api"


def test_allocator_and_catalog_do_not_import_torch(tmp_path):
    code = (
        "import sys, ecoffload.engine.catalog, ecoffload.engine.allocator, ecoffload.engine\n"
        "print('torch' in sys.modules)"
    )
    out = run_outside_repo(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_wheel_holds_only_the_ecoffload_package(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), REPO],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ecoffload", wheel.split("-")[0] + "-" + wheel.split("-")[1] + ".dist-info"}
    for sub in ("kernels", "engine", "connector", "profiling", "tools"):
        assert f"ecoffload/{sub}/__init__.py" in names
    assert "ecoffload/profiling/gpu_check.sh" in names
    assert "ecoffload/kernels/plan_native.c" in names  # built on first use, so shipped as source
    assert "ecoffload/tools/grafana/ecoffload.json" in names  # `ecoffload dashboard` prints it
    entry_points = zipfile.ZipFile(tmp_path / wheel).read(
        wheel.split("-")[0] + "-" + wheel.split("-")[1] + ".dist-info/entry_points.txt"
    ).decode()
    assert "ecoffload = ecoffload.tools.cli:main" in entry_points
    assert "ecoffload-vllm = ecoffload.connector.cli:main" in entry_points
