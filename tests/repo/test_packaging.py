"""The distribution installs one package, `ecoffload`, and nothing at top level."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        "import sys, ecoffload.engine.catalog.catalog, ecoffload.engine.catalog.allocator\n"
        "import ecoffload.engine\n"
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
    for sub in (
        "kernels",
        "engine",
        "connector",
        "testing",
        "profiling",
        "tools",
        "engine/base",
        "engine/arena",
        "engine/catalog",
        "engine/catalog/shared",
        "engine/remote",
    ):
        assert f"ecoffload/{sub}/__init__.py" in names
    assert "ecoffload/profiling/gpu_check.sh" in names
    # The C passes, built by the install (a host building the wheel has a compiler).
    for module in ("kernels/_plan_native.", "engine/catalog/shared/_catalog_native."):
        assert any(n.startswith(f"ecoffload/{module}") and n.endswith(".so")
                   for n in names), names  # fmt: skip
    assert "ecoffload/tools/grafana/ecoffload.json" in names  # `ecoffload dashboard` prints it
    entry_points = (
        zipfile.ZipFile(tmp_path / wheel)
        .read(wheel.split("-")[0] + "-" + wheel.split("-")[1] + ".dist-info/entry_points.txt")
        .decode()
    )
    assert "ecoffload = ecoffload.tools.cli:main" in entry_points
    assert "ecoffload-vllm = ecoffload.connector.cli:main" in entry_points


def copy_of_the_sources(tmp_path):
    """The repository's files as a fresh clone has them (no build/ folder, no built module)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True)  # fmt: skip
    listed = listed.stdout.split("\n")
    src = tmp_path / "src"
    for name in filter(None, listed):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(src / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), src / name)
    return src


@pytest.mark.slow
def test_a_host_without_a_compiler_installs_with_a_warning_and_serves(tmp_path, arena_dir):
    """No C compiler (CC names none, none on PATH): the install warns and goes on, and the
    installed package saves and loads through OffloadCache (both catalogs), planning and
    answering the shared catalog's hits in Python."""
    src, site = copy_of_the_sources(tmp_path), tmp_path / "site"
    no_compiler = {"CC": str(tmp_path / "no-cc"), "PATH": os.path.dirname(sys.executable)}
    env = {**os.environ, **no_compiler}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for module in ("kernels._plan_native", "engine.catalog.shared._catalog_native"):
        assert f'building extension "ecoffload.{module}" failed' in out.stdout + out.stderr
        assert not list(site.glob(f"ecoffload/{module.replace('.', '/')}*.so"))  # its stub only
    code = (
        "import logging, sys, torch\n"
        # This venv's editable install of the repository would answer for the module
        # the target lacks: serve from the target alone, as on the compiler-less host.
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from ecoffload.engine.cache import OffloadCache\n"
        "from ecoffload.kernels import native\n"
        "for shared in (False, True):\n"
        f"    with OffloadCache.create('nocc', arena_bytes=1 << 20, block_bytes=4096, "
        f"directory={arena_dir!r}, register_cuda='never', device='cpu', shared=shared) as cache:\n"
        "        items = {f'k{i}': torch.randn(1000 + i, 3) for i in range(4)}\n"
        "        cache.save(items); cache.flush()\n"
        "        got = cache.load(list(items)); cache.flush()\n"
        "        assert all(torch.equal(got[k], t) for k, t in items.items())\n"
        "        assert not shared or cache.catalog._fast is None\n"
        "print(native.planner() is None, native.__file__)\n"
    )
    # The catalog's switch on, whatever the suite runs with: its warning is checked below.
    served = run_outside_repo(code, tmp_path, PYTHONPATH=str(site), ECOFFLOAD_NATIVE_CATALOG="1",
                              **no_compiler)  # fmt: skip
    assert served.returncode == 0, served.stderr[-2000:]
    planned_in_python, module = served.stdout.split()
    assert planned_in_python == "True" and module.startswith(str(site))
    assert "copy planning stays in Python" in served.stderr
    assert served.stderr.count("shared catalog hits stay in Python") == 1  # logged once
