"""BlockMover's CUDA decisions, checked on CPU against a recording stand-in of
torch.cuda's stream API: which stream waits on what, where outputs are allocated,
which tensors are kept alive until the copy completes, which events are reused;
which device, streams, arena view, backend and launch settings a CUDA mover uses.
The stand-in makes another device (cuda:1) current, so a stream or allocation
taken from the current device instead of the mover's shows in the log.

A GPU never reports these mistakes as errors: a load that waits for queued
compute is only slow, and a source freed while its copy still reads it only
corrupts an item now and then. So the decisions themselves are the test.
"""

import contextlib

import pytest
import torch

from ecoffload.engine import transfer
from ecoffload.engine.arena.arena import Arena
from ecoffload.kernels.step_table import StepTable

B = 4096


class FakeEvent:
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.name, self.log, self.complete = f"event{FakeEvent.count}", log, False

    def record(self, stream):
        self.complete = False
        self.log.append(("record", self.name, stream.name))

    def query(self):
        return self.complete

    def synchronize(self):
        self.complete = True


class FakeStream:
    def __init__(self, name, log, device=0):
        self.name, self.log, self.device = name, log, device

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class FakeCuda:
    """Stands in for torch.cuda's devices, streams and events; logs what the mover does.

    Two devices: the mover's, cuda:0, whose current stream is "caller", and cuda:1,
    the current device (what ``device=None`` means), whose current stream is "other".
    """

    CURRENT_DEVICE = 1

    def __init__(self, monkeypatch):
        self.log, self.events = [], []
        self.streams = {0: FakeStream("caller", self.log, 0), 1: FakeStream("other", self.log, 1)}
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.CURRENT_DEVICE)
        monkeypatch.setattr(torch.cuda, "Stream", self._new_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_of)
        monkeypatch.setattr(torch.cuda, "Event", self._event)
        monkeypatch.setattr(torch.cuda, "stream", self._stream)
        used_on = lambda tensor, stream: self.log.append(("used_on", stream.name))  # noqa: E731
        monkeypatch.setattr(torch.Tensor, "record_stream", used_on)
        self._real_empty_items = transfer.empty_items
        monkeypatch.setattr(transfer, "empty_items", self._empty_items)

    def _index(self, device):
        if device is None:
            return self.CURRENT_DEVICE
        device = torch.device(device)
        assert device.type == "cuda", device
        return self.CURRENT_DEVICE if device.index is None else device.index

    def current_of(self, device=None):
        return self.streams[self._index(device)]

    @property
    def current(self):
        """The current stream of the mover's device, cuda:0."""
        return self.streams[0]

    def _new_stream(self, device=None):
        return FakeStream("copy", self.log, self._index(device))

    def _event(self, **kwargs):
        self.events.append(FakeEvent(self.log))
        return self.events[-1]

    @contextlib.contextmanager
    def _stream(self, stream):
        before, self.streams[stream.device] = self.streams[stream.device], stream
        try:
            yield
        finally:
            self.streams[stream.device] = before

    def _empty_items(self, specs, device):
        device = torch.device("cpu") if device is None else torch.device(device)
        where = self.current_of(device).name if device.type == "cuda" else device.type
        self.log.append(("alloc", where))  # allocated with its device's current stream
        return self._real_empty_items(specs, "cpu")


@pytest.fixture
def cuda(monkeypatch, arena_dir):
    fake = FakeCuda(monkeypatch)
    arena = Arena.create("streams", block_bytes=B, num_blocks=16, directory=arena_dir,
                         processes=1, register_cuda="never")  # fmt: skip
    mover = transfer.BlockMover(arena, "cuda:0")
    real_copy = mover._copy

    def logged_copy(tensors, tables, *, to_arena):
        fake.log.append(("copy", fake.current.name))
        real_copy(tensors, tables, to_arena=to_arena)

    mover._copy = logged_copy
    yield fake, mover
    arena.close()


def test_save_runs_after_the_caller_s_queued_work_on_the_copy_stream(cuda):
    fake, mover = cuda
    src = torch.arange(B, dtype=torch.int32)
    want = src.clone()
    done = mover.save([src], StepTable.of_pairs([[(1, 4)]]))
    fence = mover._fence.name
    assert fake.log == [
        ("record", fence, "caller"),  # the producer's work so far...
        ("wait", "copy", fence),  # ...is what the copy waits for
        ("copy", "copy"),
        ("record", done._event.name, "copy"),
    ]
    assert torch.equal(mover.arena.host[B : 5 * B].view(torch.int32), want)
    assert torch.equal(src, want)  # a save only reads its sources


def test_save_keeps_its_sources_alive_until_the_copy_completes(cuda):
    _, mover = cuda
    src = torch.zeros(B, dtype=torch.uint8)
    done = mover.save([src], StepTable.of_pairs([[(0, 1)]]))
    assert done._keep_alive == [src]  # the caller may drop its reference now
    assert not done.done() and done._keep_alive == [src]
    done._event.complete = True
    assert done.done() and done._keep_alive == ()


def test_load_does_not_wait_for_queued_compute_and_the_caller_waits_for_it(cuda):
    fake, mover = cuda
    mover.arena.host[:B].copy_(torch.arange(B, dtype=torch.uint8))
    (out,), done = mover.load(StepTable.of_pairs([[(0, 1)]]), [(torch.uint8, (B,))])
    event = done._event.name
    assert fake.log == [
        ("alloc", "copy"),  # memory of the copy stream: free without waiting for the caller
        ("copy", "copy"),
        ("record", event, "copy"),
        ("used_on", "caller"),  # freed later by the caller: reused after its work
        ("wait", "caller", event),  # what the caller enqueues next sees the data
    ]
    assert not any(entry[:2] == ("wait", "copy") for entry in fake.log)
    assert torch.equal(out, torch.arange(B, dtype=torch.uint8))


def test_events_are_reused_once_their_copy_was_seen_complete(cuda):
    fake, mover = cuda
    first = mover.save([torch.zeros(B, dtype=torch.uint8)], StepTable.of_pairs([[(0, 1)]]))
    event = first._event
    second = mover.save([torch.zeros(B, dtype=torch.uint8)], StepTable.of_pairs([[(1, 1)]]))
    assert second._event is not event  # the first is still in flight
    event.complete = True
    assert first.done()
    _, third = mover.load(StepTable.of_pairs([[(0, 1)]]), [(torch.uint8, (B,))])
    assert third._event is event  # back from the pool
    created = len(fake.events)
    for _ in range(5):
        third._event.complete = True
        third.wait()
        _, third = mover.load(StepTable.of_pairs([[(0, 1)]]), [(torch.uint8, (B,))])
    assert len(fake.events) == created  # a steady stream of copies creates no events


def test_saves_and_loads_are_named_ranges_on_the_nsight_timeline(cuda, nvtx_timeline):
    _, mover = cuda
    timeline = nvtx_timeline
    mover.save([torch.zeros(B, dtype=torch.uint8)], StepTable.of_pairs([[(0, 1)]]))
    mover.load(StepTable.of_pairs([[(0, 1)]]), [(torch.uint8, (B,))])
    assert timeline == ["ecoffload.save", "ecoffload.pack", "end", "end",  # the launch inside
                        "ecoffload.load", "ecoffload.unpack", "end", "end"]  # fmt: skip


class Spy:
    """Records which arena view, backend and launch settings each pack/unpack gets."""

    def __init__(self, monkeypatch, views):
        self.calls, self.views = [], views
        for name in ("pack", "unpack"):
            monkeypatch.setattr(transfer, name, self._wrap(name, getattr(transfer, name)))

    def _wrap(self, name, real):
        def spy(*args, **kwargs):
            arena = args[2] if name == "pack" else args[0]
            view = next(k for k, v in self.views.items() if v is arena)
            self.calls.append((name, view, kwargs.get("backend"), kwargs.get("config")))
            real(*args, **kwargs)

        return spy


def test_without_a_registered_arena_a_cuda_mover_copies_by_reference_through_host(
    cuda, monkeypatch
):
    _, mover = cuda
    assert mover.path == "reference"
    spy = Spy(monkeypatch, {"host": mover.arena.host})
    src = torch.arange(2 * B, dtype=torch.int16).view(torch.uint8)[: B + 3].clone()
    mover.save([src], StepTable.of_pairs([[(2, 2)]]))
    (out,), _ = mover.load(StepTable.of_pairs([[(2, 2)]]), [(torch.uint8, (B + 3,))])
    assert torch.equal(out, src)
    assert spy.calls == [("pack", "host", "reference", transfer.PACK_CONFIG),
                         ("unpack", "host", "reference", transfer.UNPACK_CONFIG)]  # fmt: skip


class AliasArena:
    """A registered arena as a CUDA mover sees it: blocks 0-7 through the device alias,
    blocks 8-15 in a chunk whose registration failed (host only). The alias is a
    buffer of its own here, so a copy through the wrong view shows."""

    block_bytes, path, registered = B, "alias-arena", True

    def __init__(self):
        self.host = torch.zeros(16 * B, dtype=torch.uint8)
        self.alias = torch.zeros(16 * B, dtype=torch.uint8)
        self.views = []

    def covers(self, table):
        return all(start + count <= 8 for start, count in table)

    def host_tensor(self):
        return self.host

    def device_view(self, device):
        self.views.append(device)
        return self.alias


def test_a_registered_arena_is_copied_through_its_device_alias_with_the_mover_s_settings(
    monkeypatch,
):
    FakeCuda(monkeypatch)
    arena = AliasArena()
    save_config = transfer.LaunchConfig(num_programs=3, num_warps=2, tile_bytes=1024)
    load_config = transfer.LaunchConfig(num_programs=5, num_warps=1, tile_bytes=2048)
    mover = transfer.BlockMover(arena, "cuda:0", pack_config=save_config,
                                unpack_config=load_config, warm_up=False)  # fmt: skip
    assert mover.path == "kernel"
    spy = Spy(monkeypatch, {"host": arena.host, "alias": arena.alias})
    g = torch.Generator().manual_seed(3)
    items = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
             for n in (2 * B - 7, B, B + 1)]  # fmt: skip
    tables = StepTable.of_pairs(
        [[(1, 2)], [(9, 1)], [(6, 1), (12, 1)]]
    )  # the last two touch the failed chunk
    mover.save(items, tables)
    assert spy.calls == [("pack", "host", "reference", None),  # the host fallback: reference
                         ("pack", "alias", "auto", save_config)]  # fmt: skip
    assert torch.equal(arena.alias[B : 3 * B - 7], items[0])
    assert torch.equal(arena.host[9 * B : 10 * B], items[1])
    assert torch.equal(arena.host[6 * B : 7 * B], items[2][:B])
    assert torch.equal(arena.host[12 * B : 12 * B + 1], items[2][B:])
    assert not arena.host[B : 3 * B].any() and not arena.alias[6 * B :].any()
    outputs, _ = mover.load(tables, [(torch.uint8, (t.numel(),)) for t in items])
    for got, want in zip(outputs, items, strict=True):
        assert torch.equal(got, want)
    assert spy.calls[2:] == [("unpack", "host", "reference", None),
                             ("unpack", "alias", "auto", load_config)]  # fmt: skip
    assert arena.views == [torch.device("cuda", 0)] * 2  # the mover's device, once per copy


class Unregistered:
    registered = False


def test_a_mover_runs_on_its_own_device_whichever_is_current(monkeypatch):
    fake = FakeCuda(monkeypatch)
    assert transfer.BlockMover(Unregistered()).device == torch.device("cpu")
    registered = AliasArena()
    default = transfer.BlockMover(registered, warm_up=False)  # the current CUDA device
    assert default.device == torch.device("cuda", fake.CURRENT_DEVICE)
    assert default.stream.device == fake.CURRENT_DEVICE
    no_index = transfer.BlockMover(Unregistered(), "cuda")
    assert no_index.device == torch.device("cuda", fake.CURRENT_DEVICE)
    assert no_index.stream.device == fake.CURRENT_DEVICE
    mover = transfer.BlockMover(Unregistered(), "cuda:0")
    assert mover.device == torch.device("cuda", 0) and mover.stream.device == 0
