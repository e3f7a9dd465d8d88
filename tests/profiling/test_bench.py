"""The benchmark's own logic on CPU: its prebuilt launches plan exactly as the engine does,
rows say which path they measured, and bench.json is written whatever fails."""

import json
import pathlib
import types

import pytest
import torch

from ecoffload.kernels import PACK_CONFIG, api, pack, plan_copy, triton_available
from ecoffload.profiling import bench

B = 4096


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
def test_prebuilt_launch_and_engine_call_pick_the_same_width(monkeypatch):
    widths = {}

    def recorder(name):
        return lambda items, arena, plan, **kw: widths.setdefault(name, plan.vec_bytes)

    monkeypatch.setattr(api, "launch_block_copy", recorder("engine"))
    monkeypatch.setattr(bench, "launch_block_copy", recorder("bench"))
    buf = torch.zeros(6000, dtype=torch.bfloat16)
    sources = [buf[1:1001], buf[1200:5000]]  # 2 bytes past an aligned allocation
    arena = torch.zeros(8 * B + 16, dtype=torch.uint8)[8 : 8 + 8 * B]
    tables = [[(0, 1)], [(2, 2)]]
    pack(sources, tables, arena, B, backend="triton")
    bench.prebuilt_launch(sources, tables, arena, B, PACK_CONFIG, to_arena=True)()
    assert widths["engine"] == widths["bench"] <= 2


@pytest.mark.parametrize(
    "path,group", [("kernel", "ecoffload"), ("reference", "ecoffload [reference path")]
)
def test_ecoffload_rows_name_the_path_they_measured(path, group):
    fake = types.SimpleNamespace(mover=types.SimpleNamespace(path=path))
    assert bench.Bench.ecoffload_group.fget(fake).startswith(group)


def test_kernel_only_refuses_without_the_kernel_path():
    fake = types.SimpleNamespace(mover=types.SimpleNamespace(path="reference"), arena="arena")
    with pytest.raises(RuntimeError, match="not registered"):
        bench.Bench.kernel_only(fake, [], [], PACK_CONFIG, True)


class FailingRun:
    def __init__(self, device, quick, arena_dir):
        self.rows = [bench.Row("limit", "x", "save", 1, ms=1.0, gbps=1e-6)]
        self.cuda, self.mover = False, None

    def paths(self):
        return {"arena_registered": False, "mover_path": "reference", "arena": "fake"}

    def run(self):
        raise RuntimeError("CUDA error: misaligned address")

    def close(self):
        pass


class FailingCreate:
    def __init__(self, device, quick, arena_dir):
        raise SystemExit("could not create the benchmark arena: no space")


@pytest.mark.parametrize("failing", [FailingRun, FailingCreate], ids=["run", "create"])
def test_bench_json_is_written_when_the_run_fails(tmp_path, monkeypatch, failing):
    monkeypatch.setattr(bench, "Bench", failing)
    with pytest.raises((RuntimeError, SystemExit)):
        bench.main(["--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["error"]
    if failing is FailingRun:
        assert "misaligned address" in result["error"] and len(result["rows"]) == 1
        assert result["environment"]["mover_path"] == "reference"


@pytest.mark.parametrize("block", [8192, 65536], ids=["token-row", "64KiB"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
def test_bench_tables_cover_items_exactly_and_block_copies_cover_every_byte(block, shuffle):
    unit = 8192
    item_bytes = [1, 8192, 8193, 65536, 65537, 200_000]
    fake = types.SimpleNamespace(unit=unit, item_bytes=item_bytes)
    tables = bench.Bench.tables(fake, block, shuffle, seed=1)
    blocks = sum(c for t in tables for _, c in t)
    plan = plan_copy([0] * len(item_bytes), item_bytes, tables, block_bytes=unit,
                     arena_bytes=(blocks + 64) * unit, items_bytes=max(item_bytes))  # fmt: skip
    assert plan.nbytes == sum(item_bytes)
    ptrs = [i << 32 for i in range(len(item_bytes))]
    gpu, host, sizes = bench.block_copies(ptrs, item_bytes, tables, unit, block, 1 << 40)
    assert sum(sizes) == sum(item_bytes) and max(sizes) <= block
    covered = {}
    for g, h, n in zip(gpu, host, sizes, strict=True):
        item = g >> 32
        pos = g - ptrs[item]
        assert h - (1 << 40) == arena_offset(tables[item], pos, unit)
        covered.setdefault(item, []).append((pos, n))
    for item, n in enumerate(item_bytes):
        spans = sorted(covered[item])
        assert spans[0][0] == 0 and sum(k for _, k in spans) == n
        assert all(a + k == b for (a, k), (b, _) in zip(spans, spans[1:], strict=False))


def arena_offset(table, pos, unit):
    """Where byte ``pos`` of an item lives in the arena, by its table."""
    for start, count in table:
        if pos < count * unit:
            return start * unit + pos
        pos -= count * unit
    raise AssertionError("past the table")


def test_bench_host_compares_both_paths_on_every_step_and_names_its_planner(capsys, monkeypatch):
    """One table row per step and direction, before and now measured on the same step
    (their plans agree), the planner named, and the summary line last."""
    from ecoffload.kernels import native
    from ecoffload.profiling import bench_host

    sources, tables, arena = bench_host.step(4, 3, B)
    old_segments, _, _ = bench_host.old_save(sources, tables, arena, B)
    _, _, new = bench_host.new_save(sources, tables, arena, B)
    assert old_segments.tolist() == new.segments.tolist()  # the same work, done two ways

    def rows(repeat):
        return [dict(step=f"s{i}", direction=d, extents=10**i, before_us=2.0 * i, now_us=1.0,
                     ratio=2.0 * i) for i in (1, 2) for d in ("save", "load")]  # fmt: skip

    monkeypatch.setattr(bench_host, "host_rows", rows)
    # The real-path rows copy through the interpreted kernel here (minutes): their own
    # test runs them as a user does, below.
    for name in ("real_path_rows", "scheduler_rows", "worker_rows"):
        monkeypatch.setattr(bench_host, name, lambda *args, **kwargs: [])
    assert bench_host.main(["--repeat", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    where = "C pass" if native.planner() else "Python passes"
    assert f"planning and item layout now: {where}" in out[0]
    assert "| s2 | load | 100 | 4.0 | 1.0 | 4.0x |" in out
    assert out[-1] == ("summary (before / now): save 10 ext 2.0x, load 10 ext 2.0x, "
                       "save 100 ext 4.0x, load 100 ext 4.0x")  # fmt: skip


def test_the_launch_rows_time_offload_cache_calls_on_bytes_they_checked(tmp_path, monkeypatch):
    # The rows gpu_check.sh prints first on a GPU host, run here on the CPU (reference
    # copy: the interpreted kernel would take minutes for 16 MiB) through the same code.
    from ecoffload.profiling import bench_host

    monkeypatch.setattr("ecoffload.engine.transfer.triton_available", lambda device: False)
    rows = bench_host.launch_rows(2, str(tmp_path), "cpu")
    assert [(r["step"], r["direction"]) for r in rows] == [
        ("16 items x 1 MiB, cpu", "OffloadCache.save call"),
        ("16 items x 1 MiB, cpu", "OffloadCache.load call"),
        ("save + load, back to back", "save + load"),
    ]
    assert all(r["now_us"] > 0 for r in rows)
    assert not list(tmp_path.iterdir())  # the arena went with the cache


def test_bench_host_rows_cover_each_step_both_ways():
    from ecoffload.profiling import bench_host

    rows = bench_host.host_rows(2)
    assert [(r["direction"], r["extents"]) for r in rows] == [
        (d, n) for n in (16, 2000, 19200) for d in ("save", "load")
    ]
    assert all(r["before_us"] > 0 and r["now_us"] > 0 for r in rows)


def test_the_catalog_a_b_bench_compares_two_checkouts_operation_by_operation(tmp_path):
    from ecoffload.profiling import bench_catalog_ab

    root = pathlib.Path(bench_catalog_ab.__file__).resolve().parents[1]
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "ecoffload").symlink_to(root)  # this checkout against itself
    base = bench_catalog_ab._import_base(str(tmp_path / "base"))
    assert base.__name__ == "ecoffload_base.engine.catalog.shared.catalog"
    assert base.SharedCatalog is not bench_catalog_ab.shared_catalog.SharedCatalog
    rows = bench_catalog_ab.compare(base, resident=256, rounds=2)
    assert [op for op, *_ in rows] == [
        "lookup (hit)", "lookup (miss)", "pin + unpin", "lookup(pin=True) + unpin",
        "reserve + commit (evicts)", "pin_many + unpin_many, 16 keys",
    ]  # fmt: skip
    for _, b, n, ratios in rows:
        assert b > 0 and n > 0 and len(ratios) == 2 and all(r > 0 for r in ratios)


@pytest.mark.slow
def test_bench_host_real_path_rows_run_through_the_entry_points_users_call(tmp_path):
    """``python -m ecoffload.profiling.bench_host --real-only`` as a user runs it (CPU copies,
    no interpreter): a row for each entry point, each catalog and direction, anchors beside
    the planning rows, and the JSON it writes says the same."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "ecoffload.profiling.bench_host", "--real-only", "--repeat", "2",
         "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    groups = {r["group"] for r in rows}
    expected = {"OffloadCache (full call, copy included)", "planning the catalog's tables",
                "connector scheduler hooks per step (shared catalog)",
                "connector worker hooks per step (vLLM's V1 runner code)"}  # fmt: skip
    assert expected <= groups, groups
    planning = [r for r in rows if r["group"] == "planning the catalog's tables"]
    assert {(r["catalog"], r["direction"]) for r in planning} == {
        (c, d) for c in ("in-process", "shared") for d in ("save", "load")
    }
    assert all(r["now_us"] > 0 and r["before_us"] > 0 and r["ratio"] > 0 for r in planning)
    assert all(r["now_us"] > 0 for r in rows)
