"""profiling/gpu_check.sh on CPU: valid bash, refuses unknown options, and leaves a
gpu_check.json even when it cannot start at all. (`--dry-run` is exercised by hand:
it imports torch several times, too slow for the suite.)"""

import json
import os
import shutil
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "profiling", "gpu_check.sh")  # fmt: skip

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args, env=None):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


@pytest.mark.parametrize("args", [[], ["out", "--bogus"]], ids=["no-out-dir", "unknown-option"])
def test_bad_arguments_are_refused(args, tmp_path):
    result = run(*[str(tmp_path / a) if a == "out" else a for a in args])
    assert result.returncode == 2
    assert "usage" in result.stderr or "unknown option" in result.stderr


def test_summary_is_written_even_without_a_usable_python(tmp_path):
    out = tmp_path / "out"
    result = run(str(out), env={"PYTHON": str(tmp_path / "no-such-python")})
    assert result.returncode == 1
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["status"] == "missing tools"
