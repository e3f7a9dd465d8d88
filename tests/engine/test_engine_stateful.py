"""Hypothesis drives the whole engine with real bytes against a simple model.

Operations: save (single and batched), load, reserve-then-abort (a failed
save), pin, unpin, evict, and completing copies: every copy stays in flight
(tests/support/copy_gate.py) until a step completes it, some at once, some steps
later. After every step: the catalog's invariants hold (no block owned twice,
owned + free = all blocks, pinned and writing items never evicted, non-ready
items never visible), an item whose save is in flight is WRITING and never
served, an item whose load is in flight stays pinned, and every ready item's
bytes in the arena equal what was saved, bit for bit; every load returns
exactly the saved bytes once its copy completed.

Profiles (HYPOTHESIS_PROFILE): "ci" (default, a few thousand operations) and
"long" (>= 100,000 operations: `make soak`).
"""

import os
import tempfile
from collections import Counter

import pytest
import torch
from copy_gate import CopyGate
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ecoffload.engine import OffloadCache
from ecoffload.engine.catalog.catalog import ItemState
from ecoffload.kernels import reference_unpack

B = 4096
NUM_BLOCKS = 40
KEYS = st.sampled_from([f"k{i}" for i in range(16)])
SIZES = st.integers(1, 9 * B)
PROFILES = {
    "ci": settings(max_examples=60, stateful_step_count=40, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow]),
    "long": settings(max_examples=2600, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow]),
}  # fmt: skip
MIN_OPERATIONS = {"ci": 1000, "long": 100_000}


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip


class EngineMachine(RuleBasedStateMachine):
    operations = 0

    @initialize()
    def open_cache(self):
        self.dir = tempfile.mkdtemp(prefix="ecoffload-engine-sm-")
        self.cache = OffloadCache.create("engine", arena_bytes=NUM_BLOCKS * B, block_bytes=B,
                                         directory=self.dir)  # fmt: skip
        self.gate = CopyGate.install(self.cache.mover)
        self.saved: dict[str, torch.Tensor] = {}  # ready key -> bytes it was saved with
        self.pins: dict[str, int] = {}  # pins taken by the pin rule
        self.saving: list[tuple] = []  # (copy, {key: bytes}) saves in flight
        self.loading: list[tuple] = []  # (copy, {key: loaded tensor}) loads in flight
        self.load_pins: Counter[str] = Counter()

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()
            assert os.listdir(self.dir) == []  # nothing leaked
            os.rmdir(self.dir)

    def _sync_model(self):
        """Drop model entries the engine evicted; pinned ones must never go."""
        for key in list(self.saved):
            if self.cache.catalog.state(key) is None:
                assert not self.pins.get(key), f"pinned item {key} was evicted"
                assert not self.load_pins[key], f"item {key} evicted while being loaded"
                del self.saved[key]
                self.pins.pop(key, None)

    def _settle(self):
        """Account for the copies that completed (the engine has polled since)."""
        done = [batch for copy, batch in self.saving if copy.ran]
        self.saving = [(copy, batch) for copy, batch in self.saving if not copy.ran]
        for batch in done:
            for key, tensor in batch.items():
                assert self.cache.catalog.state(key) is ItemState.READY, f"{key} not committed"
                self.saved[key] = tensor
        done = [got for copy, got in self.loading if copy.ran]
        self.loading = [(copy, got) for copy, got in self.loading if not copy.ran]
        for got in done:
            for key, tensor in got.items():
                assert torch.equal(tensor, self.saved[key]), f"{key}: loaded bytes differ"
                self.load_pins[key] -= 1

    @rule(items=st.dictionaries(KEYS, st.tuples(SIZES, st.integers(0, 2**31)), min_size=1,
                                max_size=4), complete=st.booleans())  # fmt: skip
    def save(self, items, complete):
        EngineMachine.operations += 1
        tensors = {k: random_bytes(n, seed) for k, (n, seed) in items.items()}
        in_flight = {k for _, batch in self.saving for k in batch}
        result = self.cache.save(tensors)
        self._sync_model()
        for key in result.saved:
            assert self.cache.catalog.state(key) is ItemState.WRITING  # its copy is in flight
            assert key not in self.cache.catalog
        if result.saved:
            self.saving.append((self.gate.copies[-1], {k: tensors[k] for k in result.saved}))
        for key in result.already_cached:
            assert key in self.saved or key in in_flight
        for key in result.no_room:
            assert self.cache.catalog.state(key) is None
        if complete:
            self.complete_all()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=5, unique=True), complete=st.booleans())
    def load(self, keys, complete):
        EngineMachine.operations += 1
        got = self.cache.load(keys)
        self._settle()
        assert set(got) == {k for k in keys if k in self.saved}  # in-flight saves not served
        if got:
            self.loading.append((self.gate.copies[-1], got))
            self.load_pins.update(got.keys())
        if complete:
            self.complete_all()

    @rule(n=st.integers(1, 3))
    def complete_some(self, n):
        """The oldest copies in flight complete; the engine notices at its next poll."""
        EngineMachine.operations += 1
        self.gate.complete(n)
        self.cache.poll()
        self._settle()

    def complete_all(self):
        self.cache.flush()
        self._settle()
        assert not self.saving and not self.loading

    @rule(key=KEYS, nbytes=SIZES)
    def failed_save(self, key, nbytes):
        EngineMachine.operations += 1
        if self.cache.catalog.state(key) is not None:
            return
        if self.cache.catalog.reserve(key, nbytes) is not None:
            self._sync_model()
            assert key not in self.cache.catalog  # writing: invisible
            self.cache.catalog.abort(key)

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def pin(self, data):
        EngineMachine.operations += 1
        key = data.draw(st.sampled_from(sorted(self.saved)))
        self.cache.catalog.pin(key)
        self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        EngineMachine.operations += 1
        key = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.cache.catalog.unpin(key)
        self.pins[key] -= 1

    def _unpinned(self):
        return sorted(k for k in self.saved if not self.pins.get(k) and not self.load_pins[k])

    @precondition(lambda self: self._unpinned())
    @rule(data=st.data())
    def evict(self, data):
        EngineMachine.operations += 1
        key = data.draw(st.sampled_from(self._unpinned()))
        self.cache.catalog.evict(key)
        del self.saved[key]

    @invariant()
    def engine_agrees_with_model(self):
        if not hasattr(self, "cache"):
            return
        catalog = self.cache.catalog
        catalog.check()
        writing = {k: t for _, batch in self.saving for k, t in batch.items()}
        for entry in catalog.entries():
            if entry.key in writing:
                assert entry.state is ItemState.WRITING and entry.key not in catalog
                continue
            assert entry.state is ItemState.READY  # no save is left half-done
            assert entry.pins == self.pins.get(entry.key, 0) + self.load_pins[entry.key]
            out = torch.empty(entry.nbytes, dtype=torch.uint8)
            reference_unpack(self.cache.arena.host, [entry.extents], B, [out])
            assert torch.equal(out, self.saved[entry.key]), f"arena bytes of {entry.key} differ"
        assert set(self.saved) | set(writing) == {e.key for e in catalog.entries()}


@pytest.fixture
def profile():
    return os.environ.get("HYPOTHESIS_PROFILE", "ci")


def test_engine_state_machine(profile):
    EngineMachine.operations = 0
    run_state_machine_as_test(EngineMachine, settings=PROFILES[profile])
    print(f"\nengine state machine: {EngineMachine.operations} operations ({profile} profile)")
    assert EngineMachine.operations >= MIN_OPERATIONS[profile]
