"""The import graph runs downward: kernels <- engine <- connector <- profiling, tools.

A module may import from its own layer and the layers below it, never above:
the kernels know tensors and block tables only, the engine knows arenas and
catalogs, the connector knows vLLM, profiling (benchmarks, demos) and tools (the operators'
command, the dashboard) sit on top; neither imports the other.
Every import statement is read from the source (AST, so imports inside
functions count too, and nothing is imported to find out).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "engine", "connector", "profiling", "tools")  # lowest first
TOP = ("profiling", "tools")  # peers: each may import the layers below, not the other


def imported_packages(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, top-level ecoffload sub-package) of every import in ``path``, a module of
    ``ecoffload`` under ``root``; imports of other distributions are left out."""
    here = ["ecoffload", *path.relative_to(root).with_suffix("").parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.module else []
            if node.level:  # relative: climb from this module's package
                base = here[: len(here) - node.level + 1] + base
            # `from .. import engine` names the sub-packages in the imported names
            targets = [base + [alias.name] for alias in node.names] if len(base) < 2 else [base]
        else:
            continue
        for parts in targets:
            if len(parts) >= 2 and parts[0] == "ecoffload":
                found.append((node.lineno, parts[1]))
    return found


def upward_imports(root: pathlib.Path = ROOT) -> list[str]:
    """Every import of a higher layer, as ``file:line: layer -> higher layer``."""
    wrong = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            for line, target in imported_packages(path, root):
                above = target in LAYERS and LAYERS.index(target) > LAYERS.index(layer)
                peer = target != layer and target in TOP and layer in TOP
                if above or peer:
                    wrong.append(f"{path.relative_to(root)}:{line}: {layer} -> {target}")
    return wrong


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports() == [], (
        "imports against the layers (kernels <- engine <- connector <- profiling, tools): move "
        "the shared code down to the lowest layer that needs it"
    )


@pytest.mark.parametrize(
    ("layer", "source", "upward"),
    [
        ("engine", "from ..connector import config\n", True),
        ("engine", "from .. import profiling\n", True),
        ("kernels", "import ecoffload.engine.arena\n", True),
        ("kernels", "def f():\n    from ..engine import sizes\n", True),  # inside a function
        ("connector", "from ..engine.arena import Arena\nfrom ..kernels import api\n", False),
        ("profiling", "from ..connector import config\n", False),
        ("tools", "from ..engine.arena_survey import survey\n", False),
        ("tools", "from ..profiling import bench\n", True),  # peers on top
        ("profiling", "from ..tools import cli\n", True),
        ("engine", "from .arena import Arena\nimport numpy\n", False),
    ],
)
def test_the_walk_sees_an_upward_import(tmp_path, layer, source, upward):
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / layer / "probe.py").write_text(source)
    found = upward_imports(tmp_path)
    assert bool(found) == upward, found


def test_the_plugin_and_the_config_import_no_torch():
    # vLLM loads the plugin in every process before it parses its arguments: the
    # config check must not pull torch (or the arena) in with it.
    code = (
        "import sys, ecoffload.connector.plugin, ecoffload.connector.config\n"
        "heavy = sorted(m for m in ('torch', 'ecoffload.engine.arena') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
