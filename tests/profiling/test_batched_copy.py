"""The batched copy-engine anchor's descriptors, on CPU: ``CUdeviceptr`` objects (plain ints
are refused by cuda-bindings 12.9/13.x), one attribute set with the right direction hints,
both return conventions; and, where cuda-bindings is installed, the real binding accepts
the prepared arguments (it fails only at loading the driver)."""

import types

import pytest
import torch

from ecoffload.profiling.batched_copy import BatchedCopy


class CUdeviceptr:
    def __init__(self, value):
        if not isinstance(value, int):
            raise TypeError(f"CUdeviceptr needs an int, got {type(value).__name__}")
        self.value = value


class Attrs:
    srcAccessOrder = dstLocHint = srcLocHint = flags = None


class Location:
    type = id = None


def fake_driver(calls, result):
    def batch_async(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):
        for name, ptrs in (("dsts", dsts), ("srcs", srcs)):
            if not all(isinstance(p, CUdeviceptr) for p in ptrs):
                raise TypeError(f"Argument '{name}' is not instance of type CUdeviceptr")
        calls.append((dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream))
        return result

    return types.SimpleNamespace(
        CUdeviceptr=CUdeviceptr,
        CUmemcpyAttributes=Attrs,
        CUmemLocation=Location,
        CUmemcpySrcAccessOrder=types.SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM="stream"),
        CUmemLocationType=types.SimpleNamespace(
            CU_MEM_LOCATION_TYPE_DEVICE="device", CU_MEM_LOCATION_TYPE_HOST="host"
        ),
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        CUstream=lambda handle: ("stream", handle),
        cuMemcpyBatchAsync=batch_async,
    )


@pytest.mark.parametrize("result", [(0, 2**64 - 1), (0,)], ids=["12.x", "13.x"])
@pytest.mark.parametrize("to_host", [True, False], ids=["save", "load"])
def test_prepared_batch_is_passed_as_the_bindings_expect(result, to_host):
    calls = []
    copier = BatchedCopy(torch.device("cuda", 1), driver=fake_driver(calls, result))
    batch = copier.prepare([0x1000, 0x2000], [0x3000, 0x4000], [64, 8], to_host=to_host)
    assert [p.value for p in batch.dsts] == [0x1000, 0x2000]
    assert [p.value for p in batch.srcs] == [0x3000, 0x4000]
    (attr,) = batch.attrs
    src, dst = (attr.srcLocHint, attr.dstLocHint)
    assert (src.type, dst.type) == (("device", "host") if to_host else ("host", "device"))
    assert (src.id if to_host else dst.id) == 1  # the GPU side names the copier's device
    copier(batch, types.SimpleNamespace(cuda_stream=77))
    (call,) = calls
    assert call[2:4] == ([64, 8], 2) and call[5:] == ([0], 1, ("stream", 77))


def test_failure_reports_the_error_and_the_failed_copy():
    copier = BatchedCopy(torch.device("cuda", 0), driver=fake_driver([], (1, 3)))
    batch = copier.prepare([1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], to_host=True)
    with pytest.raises(RuntimeError, match=r"cuMemcpyBatchAsync failed: 1 \(copy 3\)"):
        copier(batch, 0)


def test_empty_batch_issues_no_call():
    calls = []
    copier = BatchedCopy(torch.device("cuda", 0), driver=fake_driver(calls, (0,)))
    copier(copier.prepare([], [], [], to_host=False), 0)
    assert calls == []


@pytest.mark.parametrize(
    "dsts,srcs,sizes,match",
    [([1], [2, 3], [4], "as many"), ([1], [2], [0], "positive size")],
    ids=["lengths", "zero-size"],
)
def test_bad_batches_are_refused(dsts, srcs, sizes, match):
    copier = BatchedCopy(torch.device("cuda", 0), driver=fake_driver([], (0,)))
    with pytest.raises(ValueError, match=match):
        copier.prepare(dsts, srcs, sizes, to_host=True)


def test_real_bindings_accept_the_prepared_arguments():
    driver = pytest.importorskip("cuda.bindings.driver")
    if torch.cuda.is_available():
        pytest.skip("a real driver would run the copy: covered by the GPU benchmark")
    copier = BatchedCopy(torch.device("cuda", 0))
    batch = copier.prepare([0x1000], [0x2000], [64], to_host=True)
    with pytest.raises(Exception) as failed:  # no driver here: past the argument checks
        copier(batch, 0)
    assert not isinstance(failed.value, TypeError), failed.value
    with pytest.raises(TypeError, match="CUdeviceptr"):  # what plain ints get
        driver.cuMemcpyBatchAsync([0x1000], [0x2000], [64], 1, batch.attrs, [0], 1,
                                  driver.CUstream(0))  # fmt: skip
