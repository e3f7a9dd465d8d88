"""The device alias decision on CPU, with a stand-in CuPy: built with an explicit device id,
one per device and cached, and refused (never copied) when torch does not alias the
registered range on the requested device."""

import sys
import types

import pytest
import torch

from ecoffload.engine.arena import cuda_host
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.arena.cuda_host import HostRegistration
from ecoffload.engine.base.errors import ArenaError

HOST_PTR = 0x7F0000000000
NBYTES = 1 << 20


class FakeAlias:
    """What torch would give for a CuPy array: a device and a data pointer."""

    def __init__(self, device, ptr, nbytes):
        self.device, self._ptr, self._nbytes = device, ptr, nbytes

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._nbytes


def fake_cupy(log):
    cupy = types.ModuleType("cupy")
    runtime = types.SimpleNamespace(
        hostRegister=lambda ptr, size, flags: log.append(("register", ptr, size, flags)),
        hostUnregister=lambda ptr: log.append(("unregister", ptr)),
        pointerGetAttributes=lambda ptr: types.SimpleNamespace(devicePointer=ptr),  # UVA
    )

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            log.append(("device", self.index))

        def __exit__(self, *exc):
            return False

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            log.append(("memory", ptr, size, device_id))
            self.ptr, self.size, self.device_id = ptr, size, device_id

    def memory_pointer(memory, offset):
        return types.SimpleNamespace(mem=memory, ptr=memory.ptr + offset)

    def ndarray(shape, dtype, memptr):
        return types.SimpleNamespace(shape=shape, dtype=dtype, data=memptr)

    cupy.cuda = types.SimpleNamespace(
        runtime=runtime, Device=Device, UnownedMemory=UnownedMemory, MemoryPointer=memory_pointer
    )
    cupy.ndarray, cupy.uint8 = ndarray, "uint8"
    return cupy


def faithful_torch(array):
    """torch.from_dlpack of a CuPy array: the memory's device id and pointer."""
    mem = array.data.mem
    return FakeAlias(torch.device("cuda", mem.device_id), array.data.ptr, array.shape[0])


@pytest.fixture
def log(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
    monkeypatch.setattr(cuda_host, "_as_torch", faithful_torch)
    return calls


def test_alias_is_built_with_the_device_id_and_cached_per_device(log):
    reg = HostRegistration(HOST_PTR, NBYTES)
    a0 = reg.device_alias(torch.device("cuda", 0))
    a1 = reg.device_alias("cuda:1")
    assert reg.device_alias(torch.device("cuda", 0)) is a0
    assert reg.device_alias(torch.device("cuda", 1)) is a1
    memories = [c for c in log if c[0] == "memory"]
    assert memories == [("memory", HOST_PTR, NBYTES, 0), ("memory", HOST_PTR, NBYTES, 1)]
    assert [c for c in log if c[0] == "device"] == [("device", 0), ("device", 1)]
    assert a1.device == torch.device("cuda", 1) and a1.data_ptr() == HOST_PTR
    reg.close()
    assert ("unregister", HOST_PTR) in log


def test_alias_on_another_pointer_is_refused(log, monkeypatch):
    reg = HostRegistration(HOST_PTR, NBYTES)
    copied = lambda array: FakeAlias(torch.device("cuda", 0), 0x10000, NBYTES)  # a GPU copy
    monkeypatch.setattr(cuda_host, "_as_torch", copied)
    with pytest.raises(ArenaError, match="copies instead of aliasing"):
        reg.device_alias(torch.device("cuda", 0))
    reg.close()


def test_alias_on_another_device_is_refused(log, monkeypatch):
    reg = HostRegistration(HOST_PTR, NBYTES)
    wrong = lambda array: FakeAlias(torch.device("cuda", 0), HOST_PTR, NBYTES)
    monkeypatch.setattr(cuda_host, "_as_torch", wrong)
    with pytest.raises(ArenaError, match="expected cuda:1"):
        reg.device_alias(torch.device("cuda", 1))
    assert reg._aliases == {}  # nothing cached after a refusal
    reg.close()


def test_cpu_device_is_refused(log):
    reg = HostRegistration(HOST_PTR, NBYTES)
    with pytest.raises(ArenaError, match="needs a CUDA device"):
        reg.device_alias(torch.device("cpu"))
    reg.close()


def test_arena_device_view_reuses_one_alias_per_device(log, monkeypatch, arena_dir):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with Arena.create("alias", block_bytes=4096, num_blocks=4, directory=arena_dir,
                      register_cuda="always") as arena:  # fmt: skip
        assert arena.registered
        views = [arena.device_view(torch.device("cuda", i % 2)) for i in range(6)]
        assert views[0] is views[2] is views[4] is arena.device
        assert views[1] is views[3] is views[5]
        assert len([c for c in log if c[0] == "memory"]) == 2  # one per device, not per call
