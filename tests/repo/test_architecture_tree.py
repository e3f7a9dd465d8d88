"""ARCHITECTURE.md's trees are the folder tree: every module of kernels/, engine/ and
connector/ is named at its own path in one of the document's fenced trees, and every
module a tree names exists there.

A tree is a fenced block of lines ``name/`` (a folder, standing for its ``__init__.py``)
and ``name.py  what it is`` (a module; several may share a line, separated by commas),
nested by indentation; lines that continue a description are skipped.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "engine", "connector")
MODULE = re.compile(r"\b[A-Za-z_]\w*\.(?:py|c)\b")


def tree_paths(text: str) -> set[str]:
    """Every module path the document's fenced trees name ("engine/base/items.py")."""
    paths = set()
    for block in re.findall(r"^[ \t]*```\n(.*?)^[ \t]*```", text, flags=re.S | re.M):
        folders: list[tuple[int, str]] = []  # (indent, name) of the folders around a line
        for line in block.splitlines():
            stripped = line.lstrip()
            indent, head = len(line) - len(stripped), re.split(r" {2,}", stripped)[0]
            first = head.split(",")[0].split(" ")[0]
            if not (first.endswith("/") or MODULE.fullmatch(first)):
                continue  # a description's continuation, or no tree line
            while folders and folders[-1][0] >= indent:
                folders.pop()
            if first.endswith("/"):
                folders.append((indent, first.rstrip("/")))
                # a sub-package's line stands for its __init__.py
                paths.add("/".join(name for _, name in folders) + "/__init__.py")
                continue
            prefix = "/".join(name for _, name in folders)
            paths.update(f"{prefix}/{name}" for name in MODULE.findall(head))
    return paths


def product_modules() -> set[str]:
    return {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.suffix in (".py", ".c") and "__pycache__" not in path.parts
    }


def missing_and_stale(text: str) -> tuple[list[str], list[str]]:
    named, modules = tree_paths(text), product_modules()
    ours = {p for p in named if p.split("/")[0] in PACKAGES}
    return sorted(modules - named), sorted(ours - modules)


def test_every_module_is_in_a_tree_at_its_path_and_every_module_named_exists():
    missing, stale = missing_and_stale((ROOT / "ARCHITECTURE.md").read_text())
    assert not missing, f"modules no tree of ARCHITECTURE.md names at their path: {missing}"
    assert not stale, f"modules ARCHITECTURE.md's trees name that do not exist: {stale}"


def test_the_check_fails_on_a_module_left_out_or_named_at_another_path():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    renamed = text.replace("planner.py ", "plannr.py  ")
    assert missing_and_stale(renamed) == (["kernels/planner.py"], ["kernels/plannr.py"])
    # engine/base/items.py left out: kernels/items.py, still named, does not stand for it
    base_items = "      items.py             dtype names, the CRC-32 of an item\n"
    assert text.count(base_items) == 1
    assert missing_and_stale(text.replace(base_items, "")) == (["engine/base/items.py"], [])
