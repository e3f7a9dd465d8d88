"""CUDA host registration following the ready prefix (engine/arena/registration.py)
on a CPU host: the registrar's spans against a recording registration, its thread,
and an arena whose registration cannot start (CUDA made to look available, CuPy
missing: the real failure of a host without the cuda extra).

``Registrar`` is driven directly: each ``step(ready)`` must register only bytes
below ``ready``, in order, in spans that grow from one populate chunk to ``span``.
"""

import logging
import sys
import threading
import time

import pytest
import torch

from ecoffload.engine.arena import populate
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.arena.registration import Registrar
from ecoffload.engine.base.errors import ArenaError

C = 4096  # a populate chunk in these tests
LOG = "ecoffload.engine.arena.arena"


class Recording:
    """Stands in for a CUDA host registration: records the spans and devices asked for;
    the spans at ``fail`` offsets and, with ``no_alias``, the alias raise."""

    def __init__(self, fail=(), no_alias=False, device_index=0):
        self.spans: list[tuple[int, int]] = []
        self.devices: list[torch.device] = []
        self.fail, self.no_alias, self.device_index = set(fail), no_alias, device_index

    def register(self, offset, size):
        self.spans.append((offset, size))
        if offset in self.fail:
            raise RuntimeError(f"cudaErrorHostMemoryAlreadyRegistered at {offset}")

    def device_alias(self, device):
        self.devices.append(device)
        if self.no_alias:
            raise RuntimeError("torch.as_tensor refused the pointer")
        return torch.empty(0, dtype=torch.uint8)


@pytest.fixture
def registrar(monkeypatch):
    monkeypatch.setattr(populate, "POPULATE_CHUNK", C)
    reg = Recording()
    return reg, Registrar(reg, 16 * C, "/dev/shm/a", 4 * C)


def test_each_step_registers_only_below_the_ready_prefix_in_growing_spans(registrar):
    reg, r = registrar
    for ready, spans in [
        (C, [(0, C)]),  # the first chunk at once
        (2 * C, [(C, C)]),  # a span as long as what is registered: worth a call
        (3 * C, []),  # one chunk more is not: wait for a longer span
        (4 * C, [(2 * C, 2 * C)]),
        (5 * C, []),
        (16 * C, [(4 * C, 4 * C), (8 * C, 4 * C), (12 * C, 4 * C)]),  # all ready: spans
    ]:
        before = len(reg.spans)
        r.step(ready)
        assert reg.spans[before:] == spans, ready
        assert r.end == (sum(reg.spans[-1]) if reg.spans else 0) <= ready
    assert r.registered_bytes == 16 * C and r.covers([(0, 16)], C)


def test_the_registrar_thread_is_named_a_daemon_ends_when_done_and_stops_at_once(registrar):
    reg, r = registrar
    seen = threading.Event()  # nothing ready until the thread was seen: it cannot end first
    r.start(lambda: 16 * C if seen.is_set() else 0)
    (thread,) = [t for t in threading.enumerate() if t.name == "ecoffload-register"]
    assert thread.daemon  # never keeps the interpreter alive
    seen.set()
    thread.join(10)
    assert not thread.is_alive() and r.end == 16 * C  # done: the thread ends by itself
    idle = Registrar(reg, 16 * C, "/dev/shm/a", 4 * C)
    idle.start(lambda: 0)  # nothing ever ready
    t0 = time.monotonic()
    idle.stop()
    assert time.monotonic() - t0 < 5 and not any(
        t.name == "ecoffload-register" for t in threading.enumerate()
    )


def test_an_arena_whose_registration_cannot_start_warns_or_with_always_refuses(
    arena_dir, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy: `import cupy` fails
    with pytest.raises(ImportError) as missing:
        import cupy  # noqa: F401
    reason = str(missing.value)
    kw = {"block_bytes": C, "num_blocks": 4, "directory": arena_dir}
    with (
        caplog.at_level(logging.WARNING, logger=LOG),
        Arena.create("a", register_cuda="auto", **kw) as a,
    ):
        assert not a.registered and a._registration is None and a.device is None
        with pytest.raises(ArenaError) as err:
            a.device_view(torch.device("cpu"))
        assert str(err.value) == f"arena {a.path} is not registered with CUDA: no device view"
    assert [r.getMessage() for r in caplog.records if "registration" in r.msg] == [
        f"arena {a.path}: CUDA host registration failed ({reason}); transfers fall back to "
        "unregistered copies. Install ecoffload[cuda12] or [cuda13] for CuPy."
    ]
    # the record (kept by caplog) holds the error but no frame on the mapping: unmapped
    assert "still alive" not in caplog.text
    with open("/proc/self/maps") as maps:
        assert a.path not in maps.read()
    with pytest.raises(ArenaError) as err:
        Arena.create("a", register_cuda="always", **kw)
    assert str(err.value) == f"CUDA host registration of {a.path} failed: {reason}"
    assert isinstance(err.value.__cause__, ImportError)
    with open("/proc/self/maps") as maps:  # the error kept here: unmapped all the same
        assert a.path not in maps.read()


def test_without_cuda_always_is_refused_and_auto_stays_host_only(arena_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = {"block_bytes": C, "num_blocks": 4, "directory": arena_dir}
    with pytest.raises(ArenaError) as err:
        Arena.create("a", register_cuda="always", **kw)
    assert str(err.value) == "register_cuda='always' but CUDA is not available"
    with Arena.create("a", register_cuda="auto", **kw) as a:
        assert not a.registered and a.registered_fraction == 0.0 and not a.covers([(0, 1)])


def test_a_span_that_fails_stays_host_only_with_one_warning_then_debug_lines(monkeypatch, caplog):
    monkeypatch.setattr(populate, "POPULATE_CHUNK", C)
    reg = Recording(fail={C, 3 * C})
    r = Registrar(reg, 4 * C, "/dev/shm/a", C)
    with caplog.at_level(logging.DEBUG, logger=LOG):
        r.step(4 * C)
    assert reg.spans == [(0, C), (C, C), (2 * C, C), (3 * C, C)] and r.end == 4 * C
    assert r.failed == [(C, 2 * C), (3 * C, 4 * C)] and r.registered_bytes == 2 * C
    assert str(r.first_error) == f"cudaErrorHostMemoryAlreadyRegistered at {C}"
    assert [(x.levelno, x.getMessage()) for x in caplog.records if x.name == LOG] == [
        (logging.WARNING,
         f"arena /dev/shm/a: CUDA host registration failed for bytes [{C}, {2 * C}) "
         f"(cudaErrorHostMemoryAlreadyRegistered at {C}); copies of blocks there fall back "
         "to host memory, the rest use the registered alias"),
        (logging.DEBUG,
         f"arena /dev/shm/a: registration of [{3 * C}, +{C}) failed too: "
         f"cudaErrorHostMemoryAlreadyRegistered at {3 * C}"),
    ]  # fmt: skip
    assert r.covers([(0, 1), (2, 1)], C) and not r.covers([(1, 1)], C)
    assert not r.covers([(2, 2)], C)


@pytest.mark.parametrize("index,device", [(None, 3), (2, 2)], ids=["current", "given"])
def test_the_alias_is_made_on_the_registration_s_device_or_the_current_one(
    monkeypatch, index, device
):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    reg = Recording(device_index=index)
    r = Registrar(reg, C, "/dev/shm/a", C)
    r.step(C)
    assert reg.devices == [torch.device("cuda", device)] and r.alias is not None


def test_without_a_device_alias_nothing_more_is_registered_and_nothing_covered(monkeypatch, caplog):
    monkeypatch.setattr(populate, "POPULATE_CHUNK", C)
    reg = Recording(fail={0}, no_alias=True)
    r = Registrar(reg, 4 * C, "/dev/shm/a", C)
    with caplog.at_level(logging.WARNING, logger=LOG):
        r.step(4 * C)
    first = r.first_error
    assert str(first) == "cudaErrorHostMemoryAlreadyRegistered at 0"  # the first one kept
    assert reg.spans == [(0, C), (C, C)] and r.end == 4 * C and r.alias is None
    assert not r.covers([(2, 1)], C)
    assert caplog.records[-1].getMessage() == (
        "arena /dev/shm/a: CUDA host registration failed: no device alias (torch.as_tensor "
        "refused the pointer); transfers fall back to host copies"
    )
    alone = Registrar(Recording(no_alias=True), 4 * C, "/dev/shm/a", C)
    alone.step(C)
    assert str(alone.first_error) == "torch.as_tensor refused the pointer"
