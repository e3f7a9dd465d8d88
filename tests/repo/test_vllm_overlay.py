"""``make test-vllm-033``'s helper: what it unpacks, and that its runs cannot pass vacuously.

The plugin's checks run in pytest subprocesses against a stand-in ``vllm``
package (only its version matters to them), so they take seconds; the real
0.33 wheel is what ``make test-vllm-033`` runs.
"""

import os
import stat
import subprocess
import sys
import zipfile

import pytest
import vllm_overlay

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def write_wheel(path, files):
    """A zip with ``files`` ({name: (text, mode)})."""
    with zipfile.ZipFile(path, "w") as z:
        for name, (text, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, text)
    return str(path)


WHEEL_FILES = {
    "vllm/__init__.py": ("__version__ = '9.9.9'\n", 0o644),
    "vllm/entrypoints/chat.jinja": ("{{ x }}", 0o644),
    "vllm/configs/model.json": ("{}", 0o644),
    "vllm/_C.abi3.so": ("ELF", 0o755),
    "vllm/csrc/ops.cuh": ("//", 0o644),
    "vllm/vllm-rs": ("ELF", 0o755),
    "vllm-9.9.9.dist-info/METADATA": ("Name: vllm", 0o644),
}


def test_unpack_keeps_the_python_code_and_its_data_only(tmp_path):
    wheel = write_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", WHEEL_FILES)
    into = tmp_path / "overlay"
    assert vllm_overlay.unpack(wheel, str(into)) is True
    found = sorted(
        os.path.relpath(os.path.join(root, f), into)
        for root, _, files in os.walk(into)
        for f in files
    )
    assert found == [
        vllm_overlay.COMPLETE,
        "vllm/__init__.py",
        "vllm/configs/model.json",
        "vllm/entrypoints/chat.jinja",
    ]


def test_a_complete_overlay_is_not_unpacked_again_and_a_partial_one_is(tmp_path):
    wheel = write_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", WHEEL_FILES)
    into = str(tmp_path / "overlay")
    vllm_overlay.unpack(wheel, into)
    assert vllm_overlay.unpack(wheel, into) is False
    os.unlink(os.path.join(into, vllm_overlay.COMPLETE))  # interrupted mid-unpack
    os.unlink(os.path.join(into, "vllm", "__init__.py"))
    assert vllm_overlay.unpack(wheel, into) is True
    assert os.path.exists(os.path.join(into, "vllm", "__init__.py"))


def test_a_wheel_without_vllm_is_refused(tmp_path):
    wheel = write_wheel(tmp_path / "other.whl", {"other/__init__.py": ("", 0o644)})
    with pytest.raises(vllm_overlay.OverlayError, match="expected vllm/__init__.py"):
        vllm_overlay.unpack(wheel, str(tmp_path / "overlay"))


def test_a_cached_wheel_is_used_without_pip(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cached = write_wheel(wheels / "vllm-9.9.9-py3-none-any.whl", WHEEL_FILES)
    assert vllm_overlay.fetch_wheel("9.9.9", str(wheels)) == (cached, False)


def run_pytest(tmp_path, expect, files):
    """pytest with the plugin, a stand-in vllm 9.9.9 first on the path, on ``files``."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    run = tmp_path / "run"
    run.mkdir()
    for name, source in files.items():
        (run / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if k != vllm_overlay.EXPECT_ENV}
    env.update(PYTHONPATH=f"{fake}{os.pathsep}{SUPPORT}", **{vllm_overlay.EXPECT_ENV: expect})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "vllm_overlay", "-p", "no:cacheprovider",
         "--rootdir", str(run), *sorted(files)],
        cwd=run, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


PASSING = {"test_ok.py": "import vllm\ndef test_one():\n    assert vllm.__version__ == '9.9.9'\n"}
SKIPPED_WHOLE = {"test_skipped.py": "import pytest\npytest.importorskip('vllm_not_there')\n"}


def test_the_expected_version_runs_the_tests(tmp_path):
    out = run_pytest(tmp_path, "9.9.9", PASSING)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    assert f"vLLM 9.9.9 from {tmp_path / 'fake' / 'vllm'}" in out.stdout


def test_another_version_fails_before_any_test(tmp_path):
    out = run_pytest(tmp_path, "0.33.0", PASSING)
    assert out.returncode == 1
    assert "expected vLLM 0.33.0, imported 9.9.9" in out.stdout + out.stderr
    assert "passed" not in out.stdout


@pytest.mark.parametrize("others", [PASSING, {}], ids=["beside-passing-tests", "alone"])
def test_a_module_skipped_whole_fails_the_run(tmp_path, others):
    out = run_pytest(tmp_path, "9.9.9", {**SKIPPED_WHOLE, **others})
    assert out.returncode == 1, out.stdout
    assert "a test module was skipped whole: test_skipped.py" in out.stdout
