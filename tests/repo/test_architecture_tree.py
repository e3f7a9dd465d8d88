"""ARCHITECTURE.md's trees are the folder tree: every module of kernels/, engine/ and
connector/ is named in one of its fenced trees, and every module a tree names exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "engine", "connector")
MODULE = re.compile(r"\b[A-Za-z_][\w]*\.(?:py|c|pyi)\b")


def tree_names(text: str) -> set[str]:
    """The module names written inside the document's fenced blocks."""
    blocks = re.findall(r"^\s*```\n(.*?)^\s*```", text, flags=re.S | re.M)
    return {name for block in blocks for name in MODULE.findall(block)}


def product_modules() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".c", ".pyi") and "__pycache__" not in path.parts:
                found.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return found


def missing_and_stale(text: str) -> tuple[list[str], list[str]]:
    named, modules = tree_names(text), product_modules()
    missing = [p for name, paths in modules.items() if name not in named for p in paths]
    stale = sorted(name for name in named if name not in modules)
    return missing, stale


def test_every_module_is_in_a_tree_and_every_name_in_a_tree_exists():
    missing, stale = missing_and_stale((ROOT / "ARCHITECTURE.md").read_text())
    assert not missing, f"modules no tree of ARCHITECTURE.md names: {missing}"
    assert not stale, f"names in ARCHITECTURE.md's trees that no module has: {stale}"


def test_the_check_fails_on_a_module_left_out_and_on_a_stale_name():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    without = text.replace("planner.py", "plannr.py")
    missing, stale = missing_and_stale(without)
    assert "kernels/planner.py" in missing and stale == ["plannr.py"]
