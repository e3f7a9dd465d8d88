"""GPU tests: the registered arena, its device alias, the compiled kernels and
stream ordering. Marked `gpu`; they skip cleanly without CUDA. Run: pytest -m gpu"""

import random
import time

import pytest
import torch

from ecoffload.engine import OffloadCache
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.transfer import BlockMover
from ecoffload.kernels import (
    LaunchConfig,
    empty_items,
    kernel_variants,
    pack,
    plan_batch,
    reference_pack,
    triton_available,
    unpack,
)
from ecoffload.kernels.block_copy import _block_copy_kernel
from ecoffload.kernels.step_table import StepTable

pytestmark = pytest.mark.gpu
B = 4096
POISON = 0xA5


@pytest.fixture
def arena(arena_dir):
    pytest.importorskip("cupy")
    with Arena.create("gpu", block_bytes=B, num_blocks=1024, directory=arena_dir,
                      register_cuda="always") as a:  # fmt: skip
        yield a


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu()
    )


def test_device_alias_shares_bytes_with_host(arena):
    assert arena.registered and arena.device.is_cuda
    assert arena.device.numel() == arena.host.numel()
    arena.host[:16] = torch.arange(16, dtype=torch.uint8)
    assert arena.device[:16].cpu().tolist() == list(range(16))
    arena.device[16:32] = 7
    torch.cuda.synchronize()
    assert (arena.host[16:32] == 7).all()


@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_through_registered_arena(arena, shuffle, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (0, 64, torch.bfloat16), (1, 64, torch.bfloat16), (3, 63, torch.bfloat16),
        (5, 7, torch.float32), (40, 1000, torch.float16), (257, 4096, torch.bfloat16),
    ]  # fmt: skip
    items = []
    for rows, hidden, dtype in shapes:
        n = rows * hidden * dtype.itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        items.append(raw.view(dtype).view(rows, hidden).cuda())
    blocks = list(range(arena.num_blocks))
    if shuffle:
        rng.shuffle(blocks)
    tables = []
    for t in items:
        need = -(-t.nbytes // B)
        tables.append([(b, 1) for b in blocks[:need]])
        blocks = blocks[need:]
    arena.host.fill_(POISON)
    expected = arena.host.clone()
    reference_pack([t.cpu() for t in items], tables, expected, B)
    pack(items, tables, arena.device, B, config=LaunchConfig(8, 8))
    torch.cuda.synchronize()
    assert torch.equal(arena.host, expected)  # blocks outside the tables still poisoned
    outputs = empty_items([(t.dtype, t.shape) for t in items], "cuda")
    for out in outputs:
        if out.numel():
            out.view(torch.uint8).fill_(POISON)
    unpack(arena.device, tables, B, outputs, config=LaunchConfig(16, 4))
    torch.cuda.synchronize()
    for out, src in zip(outputs, items, strict=True):
        assert same_bytes(out, src)


def test_load_is_ordered_before_the_next_kernel_on_the_callers_stream(arena):
    mover = BlockMover(arena, "cuda")
    table = StepTable.of_pairs([[(0, 256)]])  # 1 MiB
    for i in range(20):
        src = torch.full((256 * B // 4,), float(i), device="cuda")
        mover.save([src], table).wait()
        (out,), _ = mover.load(table, [(torch.float32, (256 * B // 4,))])
        total = out.sum()  # enqueued right away on the caller's stream, no host sync
        assert total.item() == float(i) * out.numel(), f"round {i} read stale data"


def test_save_waits_for_the_producer_on_the_callers_stream(arena):
    mover = BlockMover(arena, "cuda")
    a = torch.randn(512, 512, device="cuda")  # 1 MiB: 256 of the 1024 blocks
    for i in range(5):
        src = (a @ a).mul_(0).add_(i)  # produced by kernels still in flight
        mover.save([src], StepTable.of_pairs([[(0, src.nbytes // B)]])).wait()
        assert (arena.host[: src.nbytes].view(torch.float32) == i).all()


def test_offload_cache_on_gpu(arena_dir):
    pytest.importorskip("cupy")
    with OffloadCache.create("cache", arena_bytes="16MiB", directory=arena_dir,
                             register_cuda="always") as cache:  # fmt: skip
        assert cache.mover.path == "kernel"
        data = {f"k{i}": torch.randn(100 + i, 512, device="cuda").to(torch.bfloat16)
                for i in range(8)}  # fmt: skip
        cache.save(data)
        cache.flush()
        got = cache.load(list(data))
        for key, tensor in got.items():
            assert tensor.is_cuda and torch.equal(tensor, data[key])


def test_unregistered_arena_falls_back_to_host_copies(arena_dir):
    with OffloadCache.create("host", arena_bytes="4MiB", directory=arena_dir,
                             register_cuda="never", device="cuda") as cache:  # fmt: skip
        assert cache.mover.path == "reference"
        data = {"a": torch.randn(64, 256, device="cuda")}
        cache.save(data)
        cache.flush()
        assert torch.equal(cache.load(["a"])["a"], data["a"])


def test_the_kernel_runs_compiled_not_interpreted():
    assert type(_block_copy_kernel).__name__ == "JITFunction", (
        "the Triton interpreter is on (TRITON_INTERPRET=1?): kernel tests would not run compiled"
    )
    assert triton_available(torch.device("cuda"))


def _compiled_variants() -> int:
    """Kernels compiled so far for the current device (Triton's in-memory cache)."""
    caches = _block_copy_kernel.device_caches[torch.cuda.current_device()]
    return len(next(c for c in caches if isinstance(c, dict)))


def test_no_kernel_compiles_after_the_movers_warm_up(arena):
    mover = BlockMover(arena, "cuda")  # compiles every variant it can launch
    warmed = _compiled_variants()
    assert warmed >= len(kernel_variants(mover.pack_config, mover.unpack_config))
    gen = torch.Generator().manual_seed(7)
    storage = torch.randint(0, 256, (64 * B,), dtype=torch.uint8, generator=gen).cuda()
    for start in (0, 1, 2, 3, 4, 6, 8, 12, 16):  # every access width, any base alignment
        for count in (1, 2, 16, 17, 40):  # segment counts Triton would have specialised
            items = [storage[start + 1100 * i : start + 1100 * i + 1000] for i in range(count)]
            tables = StepTable.of_pairs([[(i, 1)] for i in range(count)])
            mover.save(items, tables).wait()
            outputs, done = mover.load(tables, [(torch.uint8, (1000,))] * count)
            done.wait()
            assert all(torch.equal(o, t) for o, t in zip(outputs, items, strict=True))
    assert _compiled_variants() == warmed, "a launch compiled a new kernel variant mid-serving"


@pytest.mark.parametrize("item_offset", [1, 2, 4, 8])
@pytest.mark.parametrize("arena_offset", [0, 2, 4])
def test_misaligned_views_on_both_sides_round_trip_compiled(arena, item_offset, arena_offset):
    """Views whose addresses allow only narrow accesses: a 16-byte access would be a
    sticky 'misaligned address' error; the plan's width keeps every access legal."""
    gen = torch.Generator().manual_seed(item_offset * 10 + arena_offset)
    storage = torch.randint(0, 256, (3 * B + 64,), dtype=torch.uint8, generator=gen).cuda()
    item = storage[item_offset : item_offset + 3 * B - 5]
    view = arena.device[arena_offset : arena_offset + 8 * B]
    _, plan = plan_batch([item], [[(2, 3)]], view, B)
    assert plan.vec_bytes <= min(item.data_ptr() & -item.data_ptr(), 16)
    arena.host.fill_(POISON)
    pack([item], [[(2, 3)]], view, B)
    torch.cuda.synchronize()
    assert torch.equal(arena.host[arena_offset + 2 * B : arena_offset + 5 * B - 5], item.cpu())
    assert (arena.host[: arena_offset + 2 * B] == POISON).all()
    assert (arena.host[arena_offset + 5 * B - 5 :] == POISON).all()
    out = torch.full((3 * B + 64,), POISON, dtype=torch.uint8, device="cuda")
    target = out[item_offset : item_offset + 3 * B - 5]
    unpack(view, [[(2, 3)]], B, [target])
    torch.cuda.synchronize()
    assert torch.equal(target, item)
    assert (out[:item_offset] == POISON).all() and (out[item_offset + 3 * B - 5 :] == POISON).all()


def test_save_and_load_return_to_the_host_behind_queued_compute_and_loads_overlap_it(arena):
    """The hot path never waits for the model: the segment table goes up from pinned
    memory, a save only orders itself after the producer, a load after nothing."""
    mover = BlockMover(arena, "cuda")
    src = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    tables = StepTable.of_pairs([[(0, 128)]])
    mover.save([src], tables).wait()  # warm: compiled, pools filled
    a = torch.randn(4096, 4096, device="cuda")
    compute_done = torch.cuda.Event()
    for _ in range(40):  # tens of ms of queued compute on the caller's stream
        a = a @ a / 64
    compute_done.record()
    start = time.perf_counter()
    saved = mover.save([src], tables)
    (out,), loaded = mover.load(tables, [(torch.bfloat16, (64, 4096))])
    host_s = time.perf_counter() - start
    assert not compute_done.query(), "the matmuls finished too early to tell"
    assert host_s < 0.005, f"save + load held the host {host_s * 1e3:.1f} ms behind compute"
    loaded.wait()  # the load ran beside the matmuls...
    assert not compute_done.query(), "the load waited for the queued compute"
    saved.wait()  # ...the save after them (it must read what they produced)
    assert compute_done.query()
    assert same_bytes(out, src)
