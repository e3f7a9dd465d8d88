"""The type check (``make test`` runs pyright over every package, kernels/ to profiling/,
with the settings in pyproject.toml) reads every module, catches a type error, resolves
``ecoffload.*`` the way an editor does from a fresh clone, and the C extensions' stubs
say what the built modules are.

The checks run pyright on a probe file outside the tree, with the project's own
settings (the ``[tool.pyright]`` table, the virtual environment) and the repository's
``ecoffload/`` tree of links on its search path: what an editor opened on the
repository sees.
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
STUBS = {
    "ecoffload.kernels._plan_native": REPO / "kernels/_plan_native.pyi",
    "ecoffload.engine.catalog.shared._catalog_native": (
        REPO / "engine/catalog/shared/_catalog_native.pyi"
    ),
}


def pyright(tmp_path: pathlib.Path, probe: str) -> dict:
    """pyright's JSON report on ``probe`` (a module's source) with the project's settings."""
    if shutil.which("pyright", path=str(pathlib.Path(sys.executable).parent)) is None:
        pytest.fail("pyright is not installed: `pip install -e .[test]` brings it")
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pyright"]
    settings.update(include=["probe.py"], venvPath=str(REPO), extraPaths=[str(REPO)])
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(settings))
    (tmp_path / "probe.py").write_text(probe)
    done = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "-p", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.stdout, done.stderr
    return json.loads(done.stdout)


def messages(report: dict, severity: str) -> list[str]:
    return [d["message"] for d in report["generalDiagnostics"] if d["severity"] == severity]


@pytest.mark.slow
def test_an_injected_type_error_fails_the_check_and_its_correction_passes(tmp_path):
    code = "from ecoffload.engine.base.sizes import parse_bytes\n\nsize: {} = parse_bytes('8GiB')\n"
    wrong = pyright(tmp_path, code.format("str"))
    assert wrong["summary"]["errorCount"] == 1, wrong
    assert '"int" is not assignable to declared type "str"' in messages(wrong, "error")[0]
    right = pyright(tmp_path, code.format("int"))
    assert right["summary"]["errorCount"] == 0, messages(right, "error")


@pytest.mark.slow
def test_the_checker_finds_the_engine_s_definitions_as_an_editor_would(tmp_path):
    """From the repository's links: the package's lazy names, a sub-package's class, a
    mixin's method typed through its state, the C path's stub, the connector facade."""
    report = pyright(
        tmp_path,
        "from ecoffload.connector import ECOffloadConnector\n"
        "from ecoffload.engine import OffloadCache\n"
        "from ecoffload.engine.catalog.shared.catalog import SharedCatalog\n"
        "from ecoffload.engine.catalog.shared.native import hit_path\n"
        "from ecoffload.kernels.step_table import StepTable\n"
        "reveal_type(OffloadCache.create)\n"
        "reveal_type(SharedCatalog.pin)\n"
        "reveal_type(hit_path)\n"
        "reveal_type(StepTable.select)\n"
        "reveal_type(ECOffloadConnector.has_cache_item)\n",
    )
    assert report["summary"]["errorCount"] == 0, messages(report, "error")
    revealed = messages(report, "information")
    assert len(revealed) == 5, revealed
    create, pin, hit, select, has_item = revealed
    assert "-> OffloadCache" in create, create
    assert "(self: SharedCatalog, key: str) -> SharedEntry" in pin, pin
    assert "-> (HitPath | None)" in hit, hit  # the stub's class
    assert "-> StepTable" in select, select
    assert "(self: ECOffloadConnector, identifier: str) -> bool" in has_item, has_item


@pytest.mark.slow
def test_the_project_s_check_reads_every_module_of_every_package():
    """What ``make test`` runs (``pyright`` with pyproject's table, from the repository):
    every module of the packages it names analysed, none with an error. (Its
    ``include`` once named the ``ecoffload/`` tree of links, which pyright does not
    enter: it checked no file and reported 0 errors.)"""
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pyright"]
    packages = ("kernels", "engine", "connector", "tools", "testing", "profiling")
    assert sorted(settings["include"]) == sorted(packages), settings["include"]
    done = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    report = json.loads(done.stdout)
    modules = [p for pkg in packages for p in (REPO / pkg).rglob("*.py*")
               if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts]  # fmt: skip
    assert report["summary"]["filesAnalyzed"] >= len(modules) > 100, report["summary"]
    assert report["summary"]["errorCount"] == 0, messages(report, "error")


def stub_api(path: pathlib.Path) -> dict[str, list[str]]:
    """Each top-level name of a stub and, for a function or method, its parameter names
    (positional ones and keywords); a class's members as ``Class.name``."""
    api: dict[str, list[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            api[node.name] = [a.arg for a in node.args.posonlyargs + node.args.args]
        elif isinstance(node, ast.ClassDef):
            api[node.name] = []
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    args = member.args.posonlyargs + member.args.args
                    api[f"{node.name}.{member.name}"] = [a.arg for a in args[1:]]
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    api[f"{node.name}.{member.target.id}"] = []
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            api[node.target.id] = []
    return api


@pytest.mark.parametrize("name", sorted(STUBS))
def test_a_stub_names_what_the_built_module_has_and_each_function_s_arity(name):
    try:
        module = importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not built in this install (no C compiler at install time)")
    api = stub_api(STUBS[name])
    public = {n for n in dir(module) if not n.startswith("_")}
    assert public == {n for n in api if "." not in n}, "the stub and the module name others"
    for qualified, params in api.items():
        owner, _, member = qualified.rpartition(".")
        if owner:  # a class's member: there, by name (the keywords: the test below)
            assert member in dir(getattr(module, owner)), qualified
            continue
        if not callable(getattr(module, member)) or isinstance(getattr(module, member), type):
            continue
        with pytest.raises(TypeError) as refused:  # too many: the C parser says how many
            getattr(module, member)(*[None] * 20)
        said = re.search(r"(?:exactly|at most) (\w+) argument", str(refused.value))
        assert said, (qualified, str(refused.value))
        assert {"one": "1"}.get(said.group(1), said.group(1)) == str(len(params)), (
            qualified, params, str(refused.value),
        )  # fmt: skip


def test_the_hit_path_takes_the_keywords_its_stub_names():
    try:
        module = importlib.import_module("ecoffload.engine.catalog.shared._catalog_native")
    except ImportError:
        pytest.skip("the shared catalog's C paths are not built in this install")
    names = stub_api(STUBS["ecoffload.engine.catalog.shared._catalog_native"])["HitPath.__init__"]
    values = {n: 1 for n in names} | {"words": None, "seen": {}}
    with pytest.raises(ValueError, match="expected the catalog's writable memoryview"):
        module.HitPath(**values)  # every keyword parsed; refused only on the values
    misnamed = dict(values)
    misnamed["word"] = misnamed.pop("words")
    with pytest.raises(TypeError, match="missing required argument 'words'"):
        module.HitPath(**misnamed)
