"""No compile mid-serving: the kernel's compiled variants depend only on what the plan
decides (direction, access width, tile, warps), never on the segment count or the base
pointers' alignment, and the warm-up compiles exactly the variants launches can ask for."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from ecoffload.kernels import (
    PACK_CONFIG,
    UNPACK_CONFIG,
    VEC_WIDTHS,
    LaunchConfig,
    api,
    block_copy,
    pack,
    triton_available,
    unpack,
)
from ecoffload.kernels.block_copy import KernelVariant

B = 4096

# The specialization key Triton computes for a launch, from the kernel's real binder
# with the sm_90 backend (no GPU needed). The interpreter compiles nothing, so this
# runs in a subprocess without TRITON_INTERPRET.
SPEC_SCRIPT = r"""
import json, sys, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from ecoffload.kernels.block_copy import _block_copy_kernel as kernel

class Ptr:  # what the binder reads of a tensor argument
    def __init__(self, address, dtype):
        self.address, self.dtype = address, dtype
    def data_ptr(self):
        return self.address

binder = create_function_from_signature(
    kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
keys = []
for items, arena, segs, progs in json.loads(sys.argv[1]):
    _, spec, _ = binder(Ptr(items, torch.uint8), Ptr(arena, torch.uint8), Ptr(segs, torch.int64),
                        Ptr(progs, torch.int64), TO_ARENA=True, VEC=2, TILE_BYTES=16384)
    keys.append(repr(spec))
print("KEYS", json.dumps(keys))
"""

LAUNCHES = [
    # items base, arena base, segment rows, program rows (after 1, 16, 37, 4096 segments)
    (0x7F0000010000, 0x7E0000000000, 0x7D0000000000, 0x7D0000000000 + 8 * 4 * 1),
    (0x7F0000010002, 0x7E0000000000, 0x7D0000000000, 0x7D0000000000 + 8 * 4 * 16),
    (0x7F0000010006, 0x7E0000001002, 0x7D0000000200, 0x7D0000000200 + 8 * 4 * 37),
    (0x7F0000010000, 0x7E0000000000, 0x7D0000000000, 0x7D0000000000 + 8 * 4 * 4096),
]


def test_segment_count_and_base_alignment_do_not_select_a_new_variant():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", SPEC_SCRIPT, json.dumps(LAUNCHES)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("importing the kernel took more than 300 s")
    if out.returncode and ("ImportError" in out.stderr or "AttributeError" in out.stderr):
        pytest.skip(f"this Triton has another binder API: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("KEYS"))
    keys = json.loads(line.removeprefix("KEYS "))
    assert len(set(keys)) == 1, "\n".join(keys)


class RecordingKernel:
    """Stands in for the Triton kernel: records the variant each launch selects."""

    def __init__(self):
        self.launched = set()

    def __getitem__(self, grid):
        def launch(*args, TO_ARENA, VEC, TILE_BYTES, num_warps):
            self.launched.add(KernelVariant(TO_ARENA, VEC, TILE_BYTES, num_warps))

        return launch


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
def test_warm_up_compiles_exactly_the_variants_launches_select(monkeypatch):
    compiled = []
    with pytest.MonkeyPatch.context() as mp:  # as if compiling for a GPU
        mp.setattr(api, "_interpreted", lambda: False)
        mp.setattr(api, "compile_variants", lambda variants, device: compiled.extend(variants))
        api.warm_up(torch.device("cuda", 0))
    assert len(compiled) == len(set(compiled)) == 2 * len(VEC_WIDTHS)

    kernel = RecordingKernel()
    monkeypatch.setattr(block_copy, "_block_copy_kernel", kernel)
    storage = torch.zeros(64 * B, dtype=torch.uint8)
    arena = torch.zeros(64 * B, dtype=torch.uint8)
    rng = random.Random(0)
    for start in [0, 1, 2, 4, 8, 16, 3, 6, 12, 256] + [rng.randrange(4096) for _ in range(20)]:
        items = [storage[start : start + 5000], storage[start + 8192 : start + 8192 + 70]]
        tables = [[(0, 2)], [(7, 1)]]
        pack(items, tables, arena, B, backend="triton")
        unpack(arena, tables, B, items, backend="triton")
    assert kernel.launched == set(compiled)  # every width reached, each one warmed


def test_warm_up_follows_the_mover_configs(monkeypatch):
    compiled = []
    monkeypatch.setattr(api, "_interpreted", lambda: False)
    monkeypatch.setattr(api, "compile_variants", lambda variants, device: compiled.extend(variants))
    api.warm_up(torch.device("cuda", 0), pack_config=LaunchConfig(4, 2, tile_bytes=4096),
                unpack_config=UNPACK_CONFIG)  # fmt: skip
    assert {(v.to_arena, v.tile_bytes, v.num_warps) for v in compiled} == {
        (True, 4096, 2),
        (False, UNPACK_CONFIG.tile_bytes, UNPACK_CONFIG.num_warps),
    }
    assert PACK_CONFIG.num_warps != 2  # the configs given, not the defaults


def test_warm_up_under_the_interpreter_compiles_nothing(monkeypatch):
    monkeypatch.setattr(api, "_interpreted", lambda: True)
    monkeypatch.setattr(api, "compile_variants", lambda *a: pytest.fail("compiled"))
    assert api.warm_up(torch.device("cuda", 0)) == []


def test_warm_up_on_a_cpu_device_compiles_nothing(monkeypatch):
    monkeypatch.setattr(api, "_interpreted", lambda: False)
    monkeypatch.setattr(api, "compile_variants", lambda *a: pytest.fail("compiled"))
    assert api.warm_up(torch.device("cpu")) == []


class FakeArena:
    def __init__(self, registered):
        self.registered = registered


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "not-registered"])
def test_a_cuda_mover_warms_up_when_it_is_created(monkeypatch, registered):
    from ecoffload.engine import transfer

    calls = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: None)
    monkeypatch.setattr(transfer, "warm_up", lambda device, **kw: calls.append((device, kw)))
    config = LaunchConfig(4, 2)
    mover = transfer.BlockMover(FakeArena(registered), "cuda:1", pack_config=config)
    assert mover.path == ("kernel" if registered else "reference")
    if registered:
        assert calls == [(torch.device("cuda", 1),
                          {"pack_config": config, "unpack_config": UNPACK_CONFIG})]  # fmt: skip
    else:
        assert calls == []  # the reference path launches no kernel
    transfer.BlockMover(FakeArena(registered), "cuda:1", warm_up=False)
    assert len(calls) == (1 if registered else 0)
