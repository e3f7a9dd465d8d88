"""The import graph runs downward: kernels <- engine <- connector <- testing <- profiling,
tools;
inside engine, base <- arena <- catalog <- remote <- the engine's own modules; and no
module imports, even for type checking only, a module that imports it back.

A module may import from its own layer and the layers below it, never above:
the kernels know tensors and block tables only, the engine knows arenas and
catalogs, the connector knows vLLM, testing is the harness tests, demos and benchmarks
share (tiny models, vLLM scenarios and servers), profiling (benchmarks, demos) and tools
(the operators' command, the dashboard) sit on top; neither imports the other. Inside the engine,
``base/`` (errors, sizes, items, liveness) knows nothing of the rest, the arena
knows no catalog, the catalogs (the shared one keeps its process lock in the arena
file) know no remote peer, and the modules at ``engine/``'s top (``cache.py``,
``transfer.py``, ``shared_cache.py``, ``survey.py``) put them together.
Every import statement is read from the source (AST, so imports inside
functions and under ``if TYPE_CHECKING`` count too, and nothing is imported to find out).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "engine", "connector", "testing", "profiling", "tools")  # lowest first
TOP = ("profiling", "tools")  # peers: each may import the layers below, not the other
# engine's sub-packages, lowest first; engine's top-level modules sit above them all
ENGINE_LAYERS = ("base", "arena", "catalog", "remote", "cluster")


def module_name(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    """``ecoffload.<...>`` of a source file under ``root``, as parts (a package's
    ``__init__`` is the package)."""
    parts = ["ecoffload", *path.relative_to(root).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(line, module parts) of every ``ecoffload`` module ``path`` imports: ``from a.b
    import c`` is ``a.b.c`` where that is a module under ``root``, else ``a.b``."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.module else []
            if node.level:  # relative: climb from this module's package
                base = package[: len(package) - node.level + 1] + base
            targets = []
            for alias in node.names:
                sub = root.joinpath(*base[1:], alias.name)
                is_module = sub.with_suffix(".py").is_file() or sub.is_dir()
                targets.append(base + [alias.name] if is_module else base)
        else:
            continue
        for parts in targets:
            if len(parts) >= 2 and parts[0] == "ecoffload":
                found.append((node.lineno, parts))
    return found


def imported_packages(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, top-level ecoffload sub-package) of every import in ``path``, a module of
    ``ecoffload`` under ``root``; imports of other distributions are left out."""
    return [(line, parts[1]) for line, parts in imported_modules(path, root)]


def _engine_rank(parts: list[str]) -> int:
    """The engine sub-layer of a module of ``ecoffload.engine``: its sub-package's
    index, or one past the last for engine's own top-level modules."""
    if len(parts) > 3 and parts[2] in ENGINE_LAYERS:  # ecoffload.engine.<sub>.<module>
        return ENGINE_LAYERS.index(parts[2])
    return len(ENGINE_LAYERS)


def upward_imports(root: pathlib.Path = ROOT) -> list[str]:
    """Every import of a higher layer (or engine sub-layer), as ``file:line: layer ->
    higher layer``."""
    wrong = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            here = module_name(path, root)
            for line, parts in imported_modules(path, root):
                target = parts[1]
                above = target in LAYERS and LAYERS.index(target) > LAYERS.index(layer)
                peer = target != layer and target in TOP and layer in TOP
                if above or peer:
                    wrong.append(f"{path.relative_to(root)}:{line}: {layer} -> {target}")
                elif layer == target == "engine" and _engine_rank(parts) > _engine_rank(here):
                    wrong.append(
                        f"{path.relative_to(root)}:{line}: engine/{here[2]} -> "
                        f"{'.'.join(parts[1:])}"
                    )
    return wrong


def import_cycles(root: pathlib.Path = ROOT) -> list[list[str]]:
    """Every cycle of module imports (type-only ones included): the strongly connected
    components of more than one module, each sorted."""
    graph: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in (root / layer).rglob("*.py"):
            here = ".".join(module_name(path, root))
            graph.setdefault(here, set()).update(
                ".".join(parts) for _, parts in imported_modules(path, root)
            )
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


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
        ("kernels", "import ecoffload.engine.arena.arena\n", True),
        ("kernels", "def f():\n    from ..engine.base import sizes\n", True),  # inside a function
        ("connector", "from ..engine.arena import Arena\nfrom ..kernels import api\n", False),
        ("profiling", "from ..connector import config\n", False),
        ("tools", "from ..engine.survey import survey\n", False),
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


@pytest.mark.parametrize(
    ("where", "source", "upward"),
    [
        ("engine/base/probe.py", "from ..arena.format import HEADER_BYTES\n", True),
        ("engine/arena/probe.py", "from ..catalog.shared import catalog\n", True),
        ("engine/arena/probe.py", "def f():\n    from ..remote.peer import ArenaPeer\n", True),
        ("engine/catalog/shared/probe.py", "from ...remote import peer\n", True),
        ("engine/catalog/shared/probe.py", "from ... import cache\n", True),  # engine's top
        ("engine/remote/probe.py", "import ecoffload.engine.transfer\n", True),
        ("engine/catalog/shared/probe.py", "from ...arena.janitor import ofd_lock\n", False),
        ("engine/catalog/shared/probe.py", "from ..catalog import ItemState\n", False),
        ("engine/remote/probe.py", "from ..catalog.allocator import Extent\n", False),
        ("engine/probe.py", "from .remote.peer import ArenaPeer\n", False),
        ("engine/probe.py", "from .base import sizes\n", False),
    ],
)
def test_the_walk_sees_an_import_up_the_engine_s_sub_packages(tmp_path, where, source, upward):
    for name in LAYERS:
        (tmp_path / name).mkdir()
    for sub in ("base", "arena", "catalog/shared", "remote"):
        (tmp_path / "engine" / sub).mkdir(parents=True)
    (tmp_path / "engine/arena/janitor.py").write_text("")
    (tmp_path / "engine/remote/peer.py").write_text("")
    (tmp_path / "engine/cache.py").write_text("")
    (tmp_path / where).write_text(source)
    found = upward_imports(tmp_path)
    assert bool(found) == upward, found


def test_no_module_imports_one_that_imports_it_back():
    assert import_cycles() == [], (
        "import cycles (type-only imports count: tools and readers follow them too): "
        "move what both need into a module below both"
    )


def test_the_walk_sees_a_type_only_cycle(tmp_path):
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "engine" / "a.py").write_text("from .b import B\n")
    (tmp_path / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    )
    (tmp_path / "engine" / "c.py").write_text("def f():\n    from .a import A\n")
    (tmp_path / "engine" / "d.py").write_text("from . import a\n")  # on no cycle
    assert import_cycles(tmp_path) == [
        ["ecoffload.engine.a", "ecoffload.engine.b", "ecoffload.engine.c"]
    ]


def test_the_plugin_and_the_config_import_no_torch():
    # vLLM loads the plugin in every process before it parses its arguments: the
    # config check must not pull torch (or the arena) in with it.
    code = (
        "import sys, ecoffload.connector.plugin, ecoffload.connector.config\n"
        "heavy = sorted(m for m in ('torch', 'ecoffload.engine.arena.arena') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
