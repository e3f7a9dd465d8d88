"""Compile the kernel for an H100/H200 (sm_90) without a GPU, exactly as a launch would
(the plan from real tensors' addresses, the arguments through Triton's own binder), and
read its PTX: 16-byte global accesses when every address allows them, never wider
accesses than the plan's width (a misaligned vector access kills a GPU context), and
64-bit address arithmetic."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, re, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import create_function_from_signature
from ecoffload.kernels import plan_batch
from ecoffload.kernels.block_copy import _block_copy_kernel as kernel

B = 4096
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
binder = create_function_from_signature(kernel.signature, kernel.params, backend)


def access_widths(ptx):
    # bytes per global data access; scalar 64-bit loads are the int64 segment table
    widths = set()
    for op in re.findall(r"\b(?:ld|st)\.global[\w.:]*", ptx):
        vec = re.search(r"\.v(\d)", op)
        bits = int(re.findall(r"\.[bufs](\d+)", op)[-1])
        if op.startswith("ld") and not vec and bits == 64:
            continue
        widths.add((int(vec.group(1)) if vec else 1) * bits // 8)
    return sorted(widths)


def compiled(items, arena, tables, to_arena, num_warps=4):
    base, plan = plan_batch(items, tables, arena, B)
    kwargs = dict(TO_ARENA=to_arena, VEC=plan.vec_bytes, TILE_BYTES=plan.tile_bytes,
                  num_warps=num_warps)
    rows = 4 * plan.num_segments
    bound, spec, opts = binder(base, arena, plan.table[:rows], plan.table[rows:], **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(kernel, signature, constexprs, attrs)
    ptx = compile(src, target=target, options=options.__dict__).asm["ptx"]
    return {
        "vec": plan.vec_bytes,
        "widths": access_widths(ptx),
        "mulwide32": len(re.findall(r"mul\.wide\.s32|mad\.wide\.s32", ptx)),
    }


aligned = torch.zeros(3 * B, dtype=torch.uint8)
arena = torch.zeros(8 * B, dtype=torch.uint8)
bf16 = torch.zeros(B, dtype=torch.bfloat16)  # [1:]: 8190 bytes, 2 blocks
cases = {
    "aligned-pack": compiled([aligned], arena, [[(0, 3)]], True, num_warps=8),
    "aligned-unpack": compiled([aligned], arena, [[(0, 3)]], False),
    "bf16-offset-1-pack": compiled([bf16[1:]], arena, [[(2, 2)]], True),
    "bf16-offset-1-unpack": compiled([bf16[1:]], arena, [[(2, 2)]], False),
    "arena-offset-4": compiled([aligned], torch.zeros(8 * B + 4, dtype=torch.uint8)[4:],
                               [[(0, 3)]], True),
}
print("RESULT", json.dumps(cases))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        pytest.fail("compiling the kernel took more than 600 s")
    if out.returncode and "ptxas" in out.stderr:
        pytest.skip(f"no ptxas for sm_90 in this Triton install: {out.stderr[-300:]}")
    if out.returncode and ("ImportError" in out.stderr or "_pack_args" in out.stderr):
        pytest.skip(f"this Triton has another compile API: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("case", ["aligned-pack", "aligned-unpack"])
def test_main_loop_uses_16_byte_accesses(compiled, case):
    assert compiled[case]["vec"] == 16
    assert max(compiled[case]["widths"]) == 16, compiled[case]


@pytest.mark.parametrize(
    "case,most", [("bf16-offset-1-pack", 2), ("bf16-offset-1-unpack", 2), ("arena-offset-4", 4)]
)
def test_no_access_is_wider_than_every_address_allows(compiled, case, most):
    result = compiled[case]
    assert result["vec"] <= most
    assert max(result["widths"]) <= result["vec"], result


def test_address_math_is_64_bit(compiled):
    for case, result in compiled.items():
        assert result["mulwide32"] == 0, f"{case}: 32-bit index math widened into an address"
