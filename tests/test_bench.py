"""The benchmark's own logic on CPU: its prebuilt launches plan exactly as the engine does,
rows say which path they measured, and bench.json is written whatever fails."""

import json
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
