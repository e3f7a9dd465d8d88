"""Mutation testing with mutmut 3: ``make mutate``, or ``python tests/mutate.py [MODULE...]``.

mutmut names each mutant after its file's path (``src/a/b.py`` -> ``a.b``) and
needs the tests to import the module under that same dotted name. This
repository's folders are installed as ``ecoffload.kernels``, ``ecoffload.engine``...
(setuptools package-dir), so every module is run in a staging copy,
``.mutate/<module>/``, laid out the way mutmut expects::

    src/ecoffload/{kernels,engine,connector,profiling}/   the package, copied
    tests/                                                the suite, copied
    pyproject.toml                                        + [tool.mutmut] for this module

There ``mutmut run`` mutates the one module, runs only the tests listed for it
below (derandomized hypothesis, CI=1, fewer examples: ECOFFLOAD_MUTATION=1),
and this script prints the kill rate,
the time taken and every survivor (``mutmut show NAME`` inside the staging
folder prints its diff). Results are kept in ``.mutate/`` (git-ignored).

``--changed-since REV`` runs only the mutants of the functions and methods that
``git diff -M REV HEAD`` touches in each module (a line of theirs added, changed or
removed; every function of a module new since REV): mutmut 3's ``mutmut run`` takes
the names as globs (``ecoffload.kernels.plan.x_plan_copy__mutmut_*``), and the
rate printed is over those mutants alone. The module's other functions keep their
earlier measurement only while no test of their list was removed since.

Tests that cannot run in a forked child (``FRESH_PROCESS``: the cluster tier's, whose
Mooncake client hangs in a child forked after its parent used one) are kept out of
mutmut's run and run afterwards on each mutant it did not detect, in a new interpreter.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "connector", "testing", "profiling", "tools")
# the test folders of the arena and the shared catalog (tests/ mirrors the product)
ARENA_TESTS = "tests/engine/arena"
SHARED_TESTS = "tests/engine/catalog/shared"
CONNECTOR_TESTS = [
    "tests/connector/test_connector_contract.py",
    "tests/connector/test_connector_inflight.py",
    "tests/connector/test_connector_reports.py",
    "tests/connector/test_connector_nixl.py",
    "tests/connector/test_connector_runners.py",
    # the scheduler while the arena is still populating (reservations wait for ready blocks)
    f"{ARENA_TESTS}/test_arena_startup.py::test_scheduler_skips_saves_until_blocks_are_ready_and_reports_readiness",
]
ARENA_MODULES = ("arena/arena", "arena/format", "arena/lifetime", "arena/registration",
                 "arena/populate", "arena/janitor")  # fmt: skip
ARENA_FILES = [
    f"{ARENA_TESTS}/test_arena_format.py",
    f"{ARENA_TESTS}/test_arena_lifetime.py",
    f"{ARENA_TESTS}/test_populate.py",
    f"{ARENA_TESTS}/test_arena_registration.py",
    f"{ARENA_TESTS}/test_arena.py",
    f"{ARENA_TESTS}/test_arena_shared.py",
    f"{ARENA_TESTS}/test_arena_startup.py",
    f"{ARENA_TESTS}/test_cuda_host.py",
]
# The arena's tests of a second or more (processes spawned, a slow populate, a fuzzer):
# as for the shared catalog below, each stays only in the lists of the modules it is
# there for (TESTING.md, "Mutation testing"; times under ECOFFLOAD_MUTATION=1 CI=1).
ARENA_SLOW: dict[str, tuple[str, ...]] = {
    # the connector's scheduler while the arena populates (20 s): the connectors' list has it
    f"{ARENA_TESTS}/test_arena_startup.py::"
    "test_scheduler_skips_saves_until_blocks_are_ready_and_reports_readiness": (),
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_a_later_instance_joins_the_file_the_creator_left_to_another": (
        "arena/lifetime",),  # 12 s
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_a_persistent_file_outlives_its_holders_and_is_warm_started": (
        "arena/lifetime",),  # 9 s
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_open_shared_refuses_an_arena_of_the_other_lifetime_and_attach_never_reclaims": (
        "arena/lifetime",),  # 9 s
    f"{ARENA_TESTS}/test_arena.py::test_one_catalog_owner_per_arena": ("arena/lifetime",),  # 8 s
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_holders_that_all_die_leave_nothing_the_janitor_removes_the_name": (
        "arena/lifetime",),  # 6 s
    f"{ARENA_TESTS}/test_arena.py::test_second_process_attaches_writes_and_is_read_back": (
        "arena/arena",),  # 6 s
    f"{ARENA_TESTS}/test_arena.py::test_attach_waits_for_a_creator_that_starts_later": (
        "arena/arena", "arena/format"),  # 6 s
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_a_persistent_arena_whose_populator_died_alone_resumes_at_warm_start": (
        "arena/lifetime", "arena/populate"),  # 5 s
    f"{ARENA_TESTS}/test_arena_startup.py::"
    "test_creator_killed_mid_populate_leaves_a_stale_file_that_is_reclaimed": (
        "arena/arena", "arena/format"),  # 4 s
    f"{ARENA_TESTS}/test_arena.py::test_stale_arena_of_a_dead_creator_is_refused_then_reclaimed": (
        "arena/arena", "arena/format"),  # 4 s
    f"{ARENA_TESTS}/test_arena_shared.py::"
    "test_a_file_left_with_its_janitor_killed_too_is_reclaimed": (
        "arena/lifetime",),  # 4 s
    f"{ARENA_TESTS}/test_arena_shared.py::test_a_dead_populator_is_resumed_by_the_next_opener": (
        "arena/lifetime", "arena/populate"),  # 4 s
    f"{ARENA_TESTS}/test_arena_startup.py::"
    "test_registration_follows_the_ready_prefix_chunk_by_chunk": (
        "arena/registration",),  # 1.6 s
    f"{ARENA_TESTS}/test_arena_startup.py::test_cache_saves_only_into_ready_blocks": (
        "arena/populate", "arena/arena"),  # 1.2 s
}  # fmt: skip
# random headers against attach's checks (3 s): the header format's and attach's own
ARENA_FUZZ = "tests/fuzz/test_fuzz_parsers.py::test_any_arena_header_attaches_or_raises_arena_error"


def arena_tests(name: str, files: list[str] = ARENA_FILES) -> list[str]:
    """The arena's test files less the slow tests that ``name`` does not need."""
    deselect = [
        t for t, keep in ARENA_SLOW.items() if name not in keep and t.split("::")[0] in files
    ]
    fuzz = [ARENA_FUZZ] if name in ("arena/format", "arena/arena") else []
    return files + fuzz + [arg for t in deselect for arg in ("--deselect", t)]


# The janitor's program cannot run mutated: mutmut's copy imports mutmut, which
# `python -I -S` cannot find, so every start_janitor fails there. Its list is its own
# tests (the parts run in this process) and the arena's tests that start no janitor
# (no shared-lifetime arena opened in the test process); start_janitor has no tests
# there and is measured by APPLIED below.
JANITOR_TESTS = arena_tests(
    "arena/janitor",
    [f"{ARENA_TESTS}/test_janitor.py",
     *(f for f in ARENA_FILES if not f.endswith(("arena_shared.py", "arena_lifetime.py")))],
)  # fmt: skip

# Functions whose tests need a program run with ``python -I -S`` from the module's own
# file (mutmut leaves them with no tests: see above). After the mutmut run, each of their
# mutants is written into the staging folder's plain copy of the module (``mutmut
# apply``: the module as it would ship with that one change) and these tests run
# against it, fastest first, stopping at the first failure; the copy is restored after.
APPLIED: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "engine/arena/janitor.py": (
        ("start_janitor",),
        [
            f"{ARENA_TESTS}/test_janitor.py",
            f"{ARENA_TESTS}/test_arena_lifetime.py",
            f"{ARENA_TESTS}/test_arena_shared.py",
        ],
    ),
}
# Tests that cannot run in mutmut's forked children: Mooncake's store client hangs (every
# thread waiting on a futex) in a child forked from a process that has run one, so every
# mutant these tests cover would count as a timeout. They run after mutmut's run, on each
# mutant it did not kill, in a fresh process (MUTANT_UNDER_TEST set, as mutmut's children
# have it), --children at a time: the scheduler's cluster tier (admission, hold, publish).
FRESH_PROCESS: dict[str, list[str]] = {
    "connector/scheduler_side.py": [
        "tests/connector/test_cluster_connector.py",
        "tests/connector/test_cluster_consumer.py",
    ],
    "connector/cluster_tier.py": ["tests/connector/test_cluster_connector.py"],
}
FRESH_TIMEOUT = 900  # seconds for one mutant's tests (test_cluster_connector.py: ~190 s)
APPLIED_TIMEOUT = 300  # seconds for one mutant's tests (a clean run takes ~30 s here)


SHARED_CATALOG_MODULES = (
    "catalog/shared/catalog", "catalog/shared/format", "catalog/shared/lock",
    "catalog/shared/region",
    "catalog/shared/reads", "catalog/shared/pins", "catalog/shared/lru",
    "catalog/shared/extents", "catalog/shared/recovery", "catalog/shared/verify",
    "catalog/shared/check",
    "catalog/shared/robust_mutex",
)  # fmt: skip
SHARED_CATALOG_FILES = [
    "tests/engine/catalog/test_catalog.py",
    f"{SHARED_TESTS}/test_shared_catalog.py",
    f"{SHARED_TESTS}/test_shared_catalog_lock.py",
    f"{SHARED_TESTS}/test_shared_catalog_pins.py",
    f"{SHARED_TESTS}/test_shared_catalog_lru.py",
    f"{SHARED_TESTS}/test_shared_catalog_extents.py",
    f"{SHARED_TESTS}/test_shared_catalog_check.py",  # each invariant of check() broken by hand
    # the layout's offsets, sizes, shape and dtype words
    f"{SHARED_TESTS}/test_shared_catalog_format.py",
    # what the rebuild keeps of each kind of damage
    f"{SHARED_TESTS}/test_shared_catalog_recovery.py",
    # keys from slots, one entry an item, clean reads
    f"{SHARED_TESTS}/test_shared_catalog_reads.py",
    # 30 examples under ECOFFLOAD_MUTATION (150 in CI)
    f"{SHARED_TESTS}/test_shared_catalog_stateful.py",
    # one corrupt word each, in a child with a deadline
    f"{SHARED_TESTS}/test_memory_safety_catalog.py",
    # a warm start's verification one call at a time: slices, cursor, counts, logs
    f"{SHARED_TESTS}/test_shared_catalog_verify.py",
    # a warm start's UNVERIFIED items: lookups that check them, stats, drops (issue 31)
    "tests/engine/test_warm_restart.py",
]
# The shared catalog's multi-second tests (other processes started, or a timed wait):
# mutmut runs every test that calls a mutated function until one fails, so a survivor
# costs them all. Each stays in the lists of the modules named here, whose mutants it
# is there for; the others deselect it (TESTING.md, "Mutation testing").
SHARED_CATALOG_SLOW: dict[str, tuple[str, ...]] = {
    f"{SHARED_TESTS}/test_shared_catalog.py::"
    "test_reserve_write_commit_and_lookup_in_three_processes": (),
    f"{SHARED_TESTS}/test_shared_catalog.py::test_entries_name_the_process_that_produced_them": (
        "catalog/shared/reads",),
    f"{SHARED_TESTS}/test_shared_catalog.py::"
    "test_dead_process_reservations_and_pins_are_released": (
        "catalog/shared/recovery",),
    f"{SHARED_TESTS}/test_shared_catalog_lock.py::"
    "test_a_persistent_arena_whose_holder_died_holding_the_lock_is_warm_started": (
        "catalog/shared/lock", "catalog/shared/recovery", "catalog/shared/robust_mutex"),
    f"{SHARED_TESTS}/test_shared_catalog_lock.py::"
    "test_a_long_wait_for_the_lock_sleeps_in_slices_and_warns_once_naming_the_file": (
        "catalog/shared/lock",),
}  # fmt: skip


def shared_catalog_tests(name: str) -> list[str]:
    """The shared catalog's test files less the slow tests that ``name`` does not need."""
    deselect = [t for t, keep in SHARED_CATALOG_SLOW.items() if name not in keep]
    return SHARED_CATALOG_FILES + [arg for t in deselect for arg in ("--deselect", t)]


# every planner pass's tests (the passes agree, refuse alike, align alike) and its users'
PLANNER_TESTS = [
    "tests/kernels/test_plan.py",
    "tests/kernels/test_plan_alignment.py",
    "tests/kernels/test_plan_programs.py",
    "tests/kernels/test_plan_vectorised.py",
    "tests/kernels/test_plan_small.py",
    "tests/kernels/test_plan_native.py",
    "tests/kernels/test_dma_split.py",
    "tests/fuzz/test_fuzz_parsers.py::test_block_tables_are_planned_in_bounds_or_refused_untouched",
    "tests/kernels/test_block_copy.py",
    "tests/kernels/test_memory_safety_kernels.py",
    "tests/kernels/test_step_table.py",
]

# module -> the fast tests that exercise it
MODULES: dict[str, list[str]] = {
    "kernels/plan.py": PLANNER_TESTS,
    # the step arrays' checks (issue 30): constructors, unpickling, the planner's reading
    "kernels/step_table.py": [
        "tests/kernels/test_step_table.py",
        "tests/kernels/test_memory_safety_kernels.py",
        "tests/kernels/test_plan_native.py",
        "tests/kernels/test_plan.py",
    ],
    # which pass lays out and plans a step: every pass's tests, and the user paths
    "kernels/planner.py": [
        *PLANNER_TESTS,
        "tests/kernels/test_empty_items.py",
        "tests/kernels/test_fast_pass.py",
    ],
    # item buffers and the item layout in Python
    "kernels/items.py": [
        "tests/kernels/test_empty_items.py",
        "tests/kernels/test_block_copy.py",
        "tests/kernels/test_plan_native.py",
        "tests/kernels/test_memory_safety_kernels.py",
        "tests/kernels/test_plan_alignment.py",
    ],
    # pack / unpack / plan_batch: the launch (interpreted on CPU)
    "kernels/api.py": [
        "tests/kernels/test_memory_safety_kernels.py",
        "tests/kernels/test_plan_native.py",
        "tests/kernels/test_block_copy.py",
        "tests/kernels/test_plan_alignment.py",
        "tests/kernels/test_empty_items.py",
        "tests/kernels/test_dma_split.py",
        "tests/kernels/test_fast_pass.py",
    ],
    "kernels/block_copy.py": [
        "tests/kernels/test_memory_safety_kernels.py",
        "tests/kernels/test_block_copy.py",
        "tests/profiling/test_bench.py",
    ],
    "kernels/native.py": [
        "tests/kernels/test_plan_native.py",
        "tests/kernels/test_kernel_variants.py",
    ],
    "engine/catalog/allocator.py": [
        "tests/engine/catalog/test_allocator.py",
        "tests/engine/catalog/test_catalog.py",
        "tests/engine/catalog/test_catalog_stateful.py",
    ],
    "engine/catalog/catalog.py": [
        "tests/engine/catalog/test_catalog.py",
        "tests/engine/catalog/test_catalog_stateful.py",
        "tests/engine/test_cache.py",
    ],
    "engine/transfer.py": [
        "tests/engine/test_transfer_streams.py",  # the CUDA branch, against a recording torch.cuda
        "tests/engine/test_cache.py",
        "tests/engine/test_faults.py::test_cache_writer_killed_mid_copy_never_serves_the_item",
        "tests/engine/test_faults.py::test_writer_killed_mid_save_never_exposes_the_item",
        # the per-item host fallback of a partly registered arena, and warm-up at creation
        f"{ARENA_TESTS}/test_arena_startup.py::test_mover_copies_unregistered_blocks_through_host_memory",
        f"{ARENA_TESTS}/test_arena_startup.py::test_no_device_alias_means_host_copies_and_one_warning",
        "tests/kernels/test_kernel_variants.py::test_a_cuda_mover_warms_up_when_it_is_created",
        "tests/kernels/test_step_table.py::test_a_mover_takes_one_step_table_and_names_how_to_make_one",
    ],
    # OffloadCache: the whole engine in one process, and the tables it hands its mover
    "engine/cache.py": [
        "tests/engine/test_cache.py",
        "tests/engine/test_integrity.py",
        "tests/kernels/test_step_table.py",
        "tests/kernels/test_fast_pass.py",
    ],
    # (and the cluster tier's tests, outside mutmut's run: FRESH_PROCESS below)
    "connector/scheduler_side.py": CONNECTOR_TESTS,
    "connector/worker_side.py": [*CONNECTOR_TESTS, "tests/connector/test_memory_safety_worker.py"],
    # the cluster tier's admission and hold, on a scripted tier (and with a real master
    # and two hosts, outside mutmut's run: FRESH_PROCESS above)
    "connector/cluster_tier.py": ["tests/connector/test_cluster_consumer.py"],
    # the modules of issue 22's split (arena.py, shared_catalog.py before it)
    **{f"engine/{name}.py": arena_tests(name) for name in ARENA_MODULES},
    "engine/arena/janitor.py": JANITOR_TESTS,
    **{f"engine/{name}.py": shared_catalog_tests(name) for name in SHARED_CATALOG_MODULES},
    # opening a region: its own tests (4 s: descriptors counted after gc), then the list
    "engine/catalog/shared/region.py": [
        f"{SHARED_TESTS}/test_shared_catalog_region.py",
        *shared_catalog_tests("catalog/shared/region"),
    ],
    # the binding, made once at import (no mutant of it runs otherwise), then the locking
    "engine/catalog/shared/robust_mutex.py": [
        f"{SHARED_TESTS}/test_robust_mutex.py",
        *shared_catalog_tests("catalog/shared/robust_mutex"),
    ],
    # owners' liveness: its own tests, and the shared catalog dropping a dead process's pins
    "engine/base/liveness.py": [
        "tests/engine/base/test_liveness.py",
        f"{SHARED_TESTS}/test_shared_catalog.py::test_dead_process_reservations_and_pins_are_released",
    ],
    "engine/base/items.py": [
        "tests/engine/base/test_items.py",
        "tests/engine/catalog/test_catalog.py",
        "tests/engine/test_integrity.py",
    ],
    "engine/shared_cache.py": [
        "tests/engine/test_cache.py",
        "tests/connector/test_connector_contract.py",
    ],
}
# mutmut stops a mutant's tests after (t + constant) * multiplier seconds of wall time
# (and twice that of CPU), t the listed tests' time in its stats run: 15 * (t + 1) by
# default: a hanging arena mutant (a read_ready whose two reads never agree) spins for
# 15 * (13.7 + 1) s, and a run reached 13 of 267 mutants in 7 minutes. The arena
# family's lists get 5 * (t + 10): such a hang ends in about two minutes. With
# 1 * (t + 1), message-only survivors were stopped as "timeouts"; with 3 * (t + 10), a
# few still were beside two other mutation runs (their tests wait for spawned
# processes): each timeout is read before it is counted (TESTING.md).
ARENA_TIMEOUT = "timeout_multiplier = 5.0\ntimeout_constant = 10.0\n"
ARENA_FAMILY = {f"engine/{name}.py" for name in (*ARENA_MODULES, "shared_cache")}
# The shared catalog's recovery too: nearly every listed test rebuilds a catalog (t ~ 12 s
# with its two slow tests), so a mutant looping in _recover held 15 * (t + 1) ~ 195 s.
SHORTER_TIMEOUT = ARENA_FAMILY | {"engine/catalog/shared/recovery.py"}
KILLED = {1, 3}
TIMEOUT = {-24, 24, 36, 152, 255, -9}  # the CPU-time limit (SIGXCPU, then SIGKILL): loops or stalls
CRASHED = {-11}  # the test process segfaulted on the mutant (e.g. a kernel reading out of bounds)
DETECTED = KILLED | TIMEOUT | CRASHED


def without_slow_tests(tests: list[str]) -> list[str]:
    """``tests`` with every slow test (ARENA_SLOW, SHARED_CATALOG_SLOW, ARENA_FUZZ) left out:
    ``--fast-only``. A mutant these kill, the whole list kills too, so the rate is a lower
    bound of the module's, found in a fraction of the time (a survivor costs seconds, not the
    minute of spawned processes); a survivor may still be killed by a slow test."""
    slow = {*ARENA_SLOW, *SHARED_CATALOG_SLOW, ARENA_FUZZ}
    kept = [t for t in tests if t != "--deselect" and t not in slow]
    return kept + [arg for t in sorted(slow) for arg in ("--deselect", t)]


def stage(module: str, fast_only: bool = False) -> Path:
    root = REPO / ".mutate" / module.replace("/", ".").removesuffix(".py")
    shutil.rmtree(root, ignore_errors=True)
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / "src" / "ecoffload" / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    tests = without_slow_tests(MODULES[module]) if fast_only else MODULES[module]
    selection = ", ".join(json.dumps(t) for t in tests)
    (root / "pyproject.toml").write_text(
        (REPO / "pyproject.toml").read_text()
        + "\n[tool.mutmut]\n"
        + f'source_paths = ["src/ecoffload/{module}"]\n'
        + 'also_copy = ["src"]\n'
        + f"pytest_add_cli_args_test_selection = [{selection}]\n"
        + 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:warnings"]\n'
        + (ARENA_TIMEOUT if module in SHORTER_TIMEOUT else "")
    )
    return root


def changed_functions(module: str, since: str) -> list[str]:
    """mutmut's keys (``x_name``, ``xǁClassǁname``) of the top-level functions and methods
    of ``module`` at HEAD that ``git diff -M since HEAD`` touches: a line of theirs added
    or changed, or lines removed between two of theirs; all of them if the file is new."""
    tree = ast.parse(subprocess.run(["git", "show", f"HEAD:{module}"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout)  # fmt: skip
    spans: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        functions = ast.FunctionDef | ast.AsyncFunctionDef
        defs = [(f"x_{node.name}", node)] if isinstance(node, functions) else []
        if isinstance(node, ast.ClassDef):
            defs = [(f"x\u01c1{node.name}\u01c1{f.name}", f) for f in node.body
                    if isinstance(f, functions)]  # fmt: skip
        for key, f in defs:
            first = min([f.lineno, *(d.lineno for d in f.decorator_list)])
            spans[key] = (first, f.end_lineno or f.lineno)
    diff = subprocess.run(["git", "diff", "-M", "--unified=0", since, "HEAD"], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout  # fmt: skip
    sections = re.split(r"^diff --git ", diff, flags=re.M)
    mine = [d for d in sections if re.search(rf"^\+\+\+ b/{re.escape(module)}$", d, re.M)]
    if not mine:
        return []
    if re.search(r"^--- /dev/null$", mine[0], re.M):  # new since REV: every function
        return sorted(spans)
    touched: set[int] = set()
    for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", mine[0], re.M):
        start, count = int(start), 1 if count == "" else int(count)
        touched.update(range(start, start + count) if count else (start, start + 1))
    return sorted(k for k, (a, b) in spans.items() if any(a <= n <= b for n in touched))


def run(module: str, children: int, fast_only: bool = False, since: str | None = None) -> dict:
    root = stage(module, fast_only)
    names: list[str] = []
    if since is not None:
        dotted = "ecoffload." + module.removesuffix(".py").replace("/", ".")
        names = [f"{dotted}.{key}__mutmut_*" for key in changed_functions(module, since)]
        if not names:
            return {"module": f"{module} (changed since {since})", "mutants": 0, "killed": 0,
                    "rate": 1.0, "seconds": 0, "status": {}, "survivors": [],
                    "seconds_by_survivor": {}, "applied": [], "functions": []}  # fmt: skip
    # One OpenMP thread: mutmut forks each mutant's test run from a process that has
    # already run torch ops, and libgomp's thread pool does not survive a fork (the
    # child's first parallel reduction waits forever in gomp_team_end: a "timeout").
    env = {**os.environ, "CI": "1", "PYTHONSAFEPATH": "1", "ECOFFLOAD_MUTATION": "1",
           "OMP_NUM_THREADS": "1", "ECOFFLOAD_NATIVE_CATALOG": "0",
           "ECOFFLOAD_MUTATION_TMP": str(root / "tmp")}  # fmt: skip
    (root / "tmp").mkdir()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *names],
        cwd=root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.monotonic() - start
    shutil.rmtree(root / "tmp", ignore_errors=True)  # a folder per forked session
    (root / "mutmut-run.log").write_text(proc.stdout + proc.stderr)
    meta = root / "mutants" / "src" / "ecoffload" / f"{module}.meta"
    if not meta.exists():
        sys.exit(f"{module}: mutmut produced no results; see {root / 'mutmut-run.log'}")
    recorded = json.loads(meta.read_text())
    codes = recorded["exit_code_by_key"]
    if since is not None:  # the selected functions' mutants alone (the others were not run)
        codes = {k: c for k, c in codes.items() if any(fnmatch.fnmatch(k, n) for n in names)}
    applied = run_applied(root, module, codes, env) if module in APPLIED else []
    fresh = run_fresh(root, module, codes, env, children) if module in FRESH_PROCESS else []
    seconds = time.monotonic() - start  # with APPLIED's runs
    status = Counter(
        "killed" if c in KILLED else "timeout" if c in TIMEOUT else "crashed" if c in CRASHED
        else "survived" if c == 0 else f"other {c}" for c in codes.values()
    )  # fmt: skip
    survivors = sorted(k for k, c in codes.items() if c not in DETECTED)
    # each survivor's test time: one far above its peers' waited on something (a survivor
    # costs every test that calls the function; a hang ends as a timeout, at the limit)
    took = recorded.get("durations_by_key", {})
    return {
        "module": module
        + (" (fast only)" if fast_only else "")
        + (f" (changed since {since})" if since is not None else ""),
        "functions": [n.removesuffix("__mutmut_*").rsplit(".", 1)[1] for n in names],
        "mutants": len(codes),
        "killed": status["killed"] + status["timeout"] + status["crashed"],  # detected
        "rate": (status["killed"] + status["timeout"] + status["crashed"]) / max(1, len(codes)),
        "seconds": round(seconds),
        "status": dict(status),
        "survivors": survivors,
        "seconds_by_survivor": {k: round(took.get(k, 0.0), 1) for k in survivors},
        "applied": applied,  # the mutants run through APPLIED (their codes are in the counts)
        "fresh": fresh,  # the mutants run again against FRESH_PROCESS's tests (likewise)
    }


def run_applied(root: Path, module: str, codes: dict[str, int], env: dict[str, str]) -> list[str]:
    """Run APPLIED's functions' mutants (no tests in mutmut's run) against the plain copy
    with each one written in; their exit codes replace mutmut's "no tests" (33) in ``codes``."""
    functions, tests = APPLIED[module]
    names = sorted(
        k for k, c in codes.items()
        if c == 33 and any(f".x_{f}__mutmut_" in k for f in functions)
    )  # fmt: skip
    source = root / "src" / "ecoffload" / module
    plain = source.read_text()
    env = {**env, "PYTHONPATH": "src"}  # the staging copy, not the installed package
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
              f"--basetemp={root / 'applied-tmp'}", *tests]  # fmt: skip
    clean = subprocess.run(pytest, cwd=root, env=env, capture_output=True, text=True)
    if clean.returncode:  # else every mutant would count as killed
        sys.exit(f"{module}: APPLIED's tests fail on the plain copy:\n{clean.stdout[-3000:]}")
    for name in names:
        try:
            subprocess.run([sys.executable, "-m", "mutmut", "apply", name], cwd=root, env=env,
                           check=True, capture_output=True)  # fmt: skip
            assert source.read_text() != plain, f"mutmut apply {name} changed nothing"
            test = subprocess.run(pytest, cwd=root, env=env, capture_output=True,
                                  timeout=APPLIED_TIMEOUT)  # fmt: skip
            codes[name] = test.returncode
        except subprocess.TimeoutExpired:
            codes[name] = 24  # counted as a timeout, as mutmut's CPU-time limit would be
        finally:
            source.write_text(plain)
    return names


def run_fresh(root: Path, module: str, codes: dict[str, int], env: dict[str, str],
              children: int) -> list[str]:  # fmt: skip
    """Run FRESH_PROCESS's tests on each mutant mutmut's run did not detect, each in a new
    interpreter on the mutated copy; a failing run replaces the mutant's code in ``codes``."""
    names = sorted(k for k, c in codes.items() if c not in DETECTED)
    env = {**env, "PYTHONPATH": "src"}  # the mutated copy, not the installed package
    tmp = root / "fresh-tmp"

    def pytest(name: str) -> int:
        folder = tmp / (re.sub(r"\W", "_", name) or "clean")
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   f"--basetemp={folder}", *FRESH_PROCESS[module]]  # fmt: skip
        try:
            return subprocess.run(command, cwd=root / "mutants", capture_output=True,
                                  env={**env, "MUTANT_UNDER_TEST": name},
                                  timeout=FRESH_TIMEOUT).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return 24  # counted as a timeout, as mutmut's limit would be
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    tmp.mkdir(exist_ok=True)
    if pytest(""):  # else every mutant would count as killed
        sys.exit(f"{module}: {FRESH_PROCESS[module]} fail without a mutant (run them there: "
                 f"cd {root / 'mutants'}; PYTHONPATH=src python -m pytest ...)")  # fmt: skip
    with ThreadPoolExecutor(children) as pool:
        for name, code in zip(names, pool.map(pytest, names), strict=True):
            if code:
                codes[name] = code
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES), choices=[*MODULES, []])
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once")
    parser.add_argument(
        "--fast-only", action="store_true", help="no slow tests: a lower bound of the kill rate"
    )
    parser.add_argument(
        "--changed-since", metavar="REV",
        help="only the mutants of the functions git diff REV HEAD touches, their rate alone",
    )  # fmt: skip
    args = parser.parse_args()
    results = [run(module, args.children, args.fast_only, args.changed_since)
               for module in args.modules]  # fmt: skip
    print(f"{'module':30} {'mutants':>7} {'killed':>7} {'rate':>6} {'time':>7}  status")
    for r in results:
        print(f"{r['module']:30} {r['mutants']:7} {r['killed']:7} {r['rate']:6.1%} "
              f"{r['seconds']:6}s  {r['status']}")  # fmt: skip
    for r in results:
        for name in r["survivors"]:
            print(f"survived: {name}  ({r['module']}, its tests "
                  f"{r['seconds_by_survivor'][name]} s)")  # fmt: skip
    out = REPO / ".mutate" / f"results-{int(time.time())}.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
