"""Per-program work: each persistent program copies one contiguous range of the
step's tiles and reads only the segment rows of that range; the copy stays bit-exact
whatever the program count."""

import random

import pytest
import torch
from test_block_copy import DEVICE, POISON, allocate, random_item

from ecoffload.kernels import LaunchConfig, pack, plan_copy, triton_available, unpack
from ecoffload.kernels.reference import reference_pack

B = 4096


def walk(plan, program):
    """The rows one program reads, following the kernel's loop over the plan."""
    seg, tile, end = plan.programs[program].tolist()
    rows = []
    while tile < end:
        _, _, nbytes, first = plan.segments[seg].tolist()
        n_vec = nbytes // plan.vec_bytes * plan.vec_bytes
        tiles = -(-n_vec // plan.tile_bytes) + (n_vec < nbytes)
        rows.append(seg)
        tile = first + min(end - first, tiles)
        seg += 1
    return rows


def fragmented_plan(num_programs, items=12, seed=0):
    rng = random.Random(seed)
    blocks = list(range(400))
    rng.shuffle(blocks)
    sizes = [rng.choice([1, 4095, 4096, 3 * B + 17, 9 * B]) for _ in range(items)]
    tables, offsets, off = [], [], 0
    for n in sizes:
        need = -(-n // B)
        tables.append([(b, 1) for b in blocks[:need]])
        blocks = blocks[need:]
        offsets.append(off)
        off += n
    return plan_copy(offsets, sizes, tables, block_bytes=B, arena_bytes=400 * B,
                     items_bytes=off, tile_bytes=1024, num_programs=num_programs)  # fmt: skip


@pytest.mark.parametrize("programs", [1, 2, 3, 8, 16, 1000])
def test_programs_split_the_tiles_into_contiguous_equal_ranges(programs):
    plan = fragmented_plan(programs)
    rows = plan.programs.tolist()
    assert plan.num_programs == len(rows) == min(programs, plan.num_tiles)
    assert rows[0][1] == 0 and rows[-1][2] == plan.num_tiles
    for (_, _, end), (_, begin, _) in zip(rows, rows[1:], strict=False):
        assert end == begin  # contiguous, no tile twice, none skipped
    lengths = [end - begin for _, begin, end in rows]
    assert max(lengths) - min(lengths) <= 1
    first_tiles = plan.segments[:, 3].tolist()
    for seg, begin, _ in rows:  # the first segment holds the program's first tile
        assert first_tiles[seg] <= begin
        assert seg + 1 == len(first_tiles) or begin < first_tiles[seg + 1]


@pytest.mark.parametrize("programs", [1, 4, 16])
def test_each_program_reads_only_the_rows_of_its_own_range(programs):
    plan = fragmented_plan(programs, items=40)
    reads = [walk(plan, p) for p in range(plan.num_programs)]
    # Every row is read by the programs whose range overlaps it: at most one
    # extra read per program boundary, instead of every program reading all rows.
    assert sorted({r for rs in reads for r in rs}) == list(range(plan.num_segments))
    assert sum(len(rs) for rs in reads) <= plan.num_segments + plan.num_programs - 1


def test_an_empty_step_launches_no_program():
    plan = plan_copy([0, 0], [0, 0], [[], []], block_bytes=B, arena_bytes=4 * B,
                     items_bytes=0, num_programs=8)  # fmt: skip
    assert plan.num_programs == 0 and plan.programs.numel() == 0


@pytest.mark.kernel
@pytest.mark.skipif(not triton_available(DEVICE), reason="Triton cannot run here")
@pytest.mark.parametrize("programs", [1, 2, 7, 64])
def test_any_program_count_copies_bit_exactly(programs):
    gen = torch.Generator().manual_seed(programs)
    items = [random_item(gen, rows, 63, torch.bfloat16) for rows in (1, 40, 130, 7, 300)]
    tables = allocate(items, 64, shuffle=True, seed=programs)
    config = LaunchConfig(num_programs=programs, num_warps=4, tile_bytes=1024)
    arena = torch.full((64 * B,), POISON, dtype=torch.uint8, device=DEVICE)
    expected = arena.clone()
    reference_pack(items, tables, expected, B)
    pack(items, tables, arena, B, config=config)
    assert torch.equal(arena, expected)  # outside the tables: still poison
    outs = [torch.full_like(t, float("nan")) for t in items]
    unpack(arena, tables, B, outs, config=config)
    for got, want in zip(outs, items, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
