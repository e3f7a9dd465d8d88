"""BlockMover's CUDA stream order, checked on CPU against a recording stand-in of
torch.cuda's stream API: which stream waits on what, where outputs are allocated,
which tensors are kept alive until the copy completes, which events are reused.

A GPU never reports these mistakes as errors: a load that waits for queued
compute is only slow, and a source freed while its copy still reads it only
corrupts an item now and then. So the decisions themselves are the test.
"""

import contextlib

import pytest
import torch

from ecoffload.engine import transfer
from ecoffload.engine.arena import Arena

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
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class FakeCuda:
    """Stands in for torch.cuda's streams and events; logs what the mover does."""

    def __init__(self, monkeypatch):
        self.log, self.events = [], []
        self.current = FakeStream("caller", self.log)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("copy", self.log))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "Event", self._event)
        monkeypatch.setattr(torch.cuda, "stream", self._stream)
        used_on = lambda tensor, stream: self.log.append(("used_on", stream.name))  # noqa: E731
        monkeypatch.setattr(torch.Tensor, "record_stream", used_on)
        self._real_empty_items = transfer.empty_items
        monkeypatch.setattr(transfer, "empty_items", self._empty_items)

    def _event(self, **kwargs):
        self.events.append(FakeEvent(self.log))
        return self.events[-1]

    @contextlib.contextmanager
    def _stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def _empty_items(self, specs, device):
        self.log.append(("alloc", self.current.name))
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
    done = mover.save([src], [[(1, 4)]])
    fence = mover._fence.name
    assert fake.log == [
        ("record", fence, "caller"),  # the producer's work so far...
        ("wait", "copy", fence),  # ...is what the copy waits for
        ("copy", "copy"),
        ("record", done._event.name, "copy"),
    ]
    assert torch.equal(mover.arena.host[B : 5 * B].view(torch.int32), src)


def test_save_keeps_its_sources_alive_until_the_copy_completes(cuda):
    _, mover = cuda
    src = torch.zeros(B, dtype=torch.uint8)
    done = mover.save([src], [[(0, 1)]])
    assert done._keep_alive == [src]  # the caller may drop its reference now
    assert not done.done() and done._keep_alive == [src]
    done._event.complete = True
    assert done.done() and done._keep_alive == ()


def test_load_does_not_wait_for_queued_compute_and_the_caller_waits_for_it(cuda):
    fake, mover = cuda
    mover.arena.host[:B].copy_(torch.arange(B, dtype=torch.uint8))
    (out,), done = mover.load([[(0, 1)]], [(torch.uint8, (B,))])
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
    first = mover.save([torch.zeros(B, dtype=torch.uint8)], [[(0, 1)]])
    event = first._event
    second = mover.save([torch.zeros(B, dtype=torch.uint8)], [[(1, 1)]])
    assert second._event is not event  # the first is still in flight
    event.complete = True
    assert first.done()
    _, third = mover.load([[(0, 1)]], [(torch.uint8, (B,))])
    assert third._event is event  # back from the pool
    created = len(fake.events)
    for _ in range(5):
        third._event.complete = True
        third.wait()
        _, third = mover.load([[(0, 1)]], [(torch.uint8, (B,))])
    assert len(fake.events) == created  # a steady stream of copies creates no events
