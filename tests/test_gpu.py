"""GPU tests: the registered arena, its device alias, the compiled kernels and
stream ordering. Marked `gpu`; they skip cleanly without CUDA. Run: pytest -m gpu"""

import random

import pytest
import torch

from ecoffload.engine import OffloadCache
from ecoffload.engine.arena import Arena
from ecoffload.engine.transfer import BlockMover
from ecoffload.kernels import LaunchConfig, empty_items, pack, reference_pack, unpack

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
    table = [[(0, 256)]]  # 1 MiB
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
        mover.save([src], [[(0, src.nbytes // B)]]).wait()
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
