"""tests/ mirrors the product: a module's tests are found by its path.

``tests/engine/catalog/shared/`` holds the tests of ``engine/catalog/shared/``; the few
folders that are not a product package say what crosses packages instead. The tests'
shared helpers live in ``tests/support/`` (on sys.path through ``tests/conftest.py``),
and no test folder is importable under a product folder's name: transformers probes
for a top-level ``kernels`` package, which ``tests/kernels/`` would otherwise be.
"""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PRODUCT = ("kernels", "engine", "connector", "testing", "profiling", "tools")
ACROSS = {
    "e2e": "vLLM end to end, servers, the GPU tests",
    "fuzz": "fuzzers of inputs that cross packages",
    "repo": "the repository itself: layers, types, packaging, the overlay, this layout",
    "support": "helpers the tests share (not tests)",
}


def test_every_test_file_sits_in_its_module_folder_or_a_declared_cross_package_one():
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.relative_to(TESTS).parts
        top = parts[0]
        if len(parts) == 1:
            misplaced.append(f"{path.name}: directly in tests/")
        elif top in PRODUCT:
            folder = ROOT.joinpath(*parts[:-1])
            if not (folder.is_dir() and (folder / "__init__.py").exists()):
                misplaced.append(f"{'/'.join(parts)}: no product package {'/'.join(parts[:-1])}/")
        elif top not in ACROSS or top == "support":
            misplaced.append(f"{'/'.join(parts)}: {top}/ is neither a product folder nor in ACROSS")
    assert not misplaced, "move each test beside its module's path:\n" + "\n".join(misplaced)


def test_test_file_names_are_unique_across_folders():
    # pytest imports each test file by its own name (rootdir-less "prepend" mode: a test
    # module's folder goes on sys.path), so two files of one name would collide
    seen: dict[str, str] = {}
    clashes = []
    for path in TESTS.rglob("*.py"):
        rel = str(path.relative_to(TESTS))
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {rel}")
        seen.setdefault(path.name, rel)
    assert not clashes, clashes


def test_no_test_folder_is_importable_under_a_product_name():
    found = {name: importlib.util.find_spec(name) for name in (*PRODUCT, "support")}
    assert all(spec is None for spec in found.values()), {
        name: list(spec.submodule_search_locations or [spec.origin])
        for name, spec in found.items()
        if spec is not None
    }
