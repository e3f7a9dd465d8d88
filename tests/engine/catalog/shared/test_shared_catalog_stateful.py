"""Hypothesis drives the shared catalog (in a temporary file) with random operations
against a simple model.

After every step: no block owned twice, owned + free = all blocks, a pinned or
writing item is never evicted, a non-ready item is never visible, and the
catalog agrees with the model on every key's state and pin count. (The
in-process catalog's machine, aimed at pins under pressure with exact LRU
victims and reached-state floors, is tests/engine/catalog/test_catalog_stateful.py.)
"""

import os
import tempfile

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ecoffload.engine.base.errors import CatalogError
from ecoffload.engine.catalog.allocator import BlockAllocator
from ecoffload.engine.catalog.catalog import Catalog, ItemState
from ecoffload.engine.catalog.shared import catalog as shared_catalog

MUTATION = bool(os.environ.get("ECOFFLOAD_MUTATION"))
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
B = 4096
NUM_BLOCKS = 32
KEYS = st.sampled_from([f"k{i}" for i in range(12)])


class CatalogMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.catalog = self.make_catalog()
        self.model: dict[str, dict] = {}  # key -> {"state", "pins", "blocks"}
        self.protected: set[str] = set()  # pinned or writing right now

    def make_catalog(self):
        return Catalog(BlockAllocator(NUM_BLOCKS, B))

    def _blocks(self, nbytes):
        return -(-nbytes // B)

    @rule(key=KEYS, nbytes=st.integers(1, 12 * B))
    def reserve(self, key, nbytes):
        protected_before = {
            k for k, m in self.model.items() if m["state"] == "writing" or m["pins"]
        }
        if key in self.model:
            try:
                self.catalog.reserve(key, nbytes)
            except CatalogError:
                return
            raise AssertionError("duplicate reserve accepted")
        entry = self.catalog.reserve(key, nbytes)
        need = self._blocks(nbytes)
        evictable = sum(
            m["blocks"] for m in self.model.values() if m["state"] == "ready" and not m["pins"]
        )
        free = NUM_BLOCKS - sum(m["blocks"] for m in self.model.values())
        if free + evictable < need:
            assert entry is None
            return
        assert entry is not None
        for k in list(self.model):
            if self.catalog.state(k) is None:
                assert k not in protected_before, f"evicted protected item {k}"
                del self.model[k]
        self.model[key] = {"state": "writing", "pins": 0, "blocks": need}

    @rule(key=KEYS)
    def commit(self, key):
        if self.model.get(key, {}).get("state") == "writing":
            self.catalog.commit(key)
            self.model[key]["state"] = "ready"
        else:
            self._expect_error(self.catalog.commit, key)

    @rule(key=KEYS)
    def abort(self, key):
        if self.model.get(key, {}).get("state") == "writing":
            self.catalog.abort(key)
            del self.model[key]
        else:
            self._expect_error(self.catalog.abort, key)

    @rule(key=KEYS)
    def lookup(self, key):
        entry = self.catalog.lookup(key)
        visible = self.model.get(key, {}).get("state") == "ready"
        assert (entry is not None) == visible

    @rule(key=KEYS)
    def pin(self, key):
        if self.model.get(key, {}).get("state") == "ready":
            self.catalog.pin(key)
            self.model[key]["pins"] += 1
        else:
            self._expect_error(self.catalog.pin, key)

    @rule(key=KEYS)
    def unpin(self, key):
        m = self.model.get(key)
        if m and m["state"] == "ready" and m["pins"]:
            self.catalog.unpin(key)
            m["pins"] -= 1
        else:
            self._expect_error(self.catalog.unpin, key)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def evict(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[key]
        if m["state"] == "ready" and not m["pins"]:
            self.catalog.evict(key)
            del self.model[key]
        else:
            self._expect_error(self.catalog.evict, key)

    def _expect_error(self, op, key):
        before = self.catalog.state(key)
        try:
            op(key)
        except CatalogError:
            assert self.catalog.state(key) == before
            return
        raise AssertionError(f"{op.__name__}({key}) should have failed")

    @invariant()
    def agrees_with_model(self):
        self.catalog.check()  # no block owned twice, owned + free == all
        for key, m in self.model.items():
            assert self.catalog.state(key) is ItemState(m["state"])
            assert self.catalog.entry(key).pins == m["pins"]
            assert (key in self.catalog) == (m["state"] == "ready")
        assert len(self.catalog) == len(self.model)


class SharedCatalogMachine(CatalogMachine):
    def make_catalog(self):
        self._dir = tempfile.TemporaryDirectory()
        path = os.path.join(self._dir.name, "catalog")
        size = shared_catalog.meta_bytes(NUM_BLOCKS, B)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            return shared_catalog.SharedCatalog(fd, 0, size, num_blocks=NUM_BLOCKS, block_bytes=B)
        finally:
            os.close(fd)

    def teardown(self):
        self.catalog.close()
        self._dir.cleanup()


# `make mutate` (ECOFFLOAD_MUTATION): fewer examples and no shrinking, a mutant only needs
# a failure; this test is called by nearly every mutant of the shared catalog's modules.
SharedCatalogMachine.TestCase.settings = settings(
    max_examples=30 if MUTATION else 150,
    stateful_step_count=60,
    deadline=None,
    phases=NO_SHRINK if MUTATION else tuple(Phase),
)
TestSharedCatalogStateful = SharedCatalogMachine.TestCase
