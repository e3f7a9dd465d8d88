"""connector/cluster_tier.py: ClusterConsumer waits on the fetch a held request
needs (at most HOLD_YIELD_S per step, shared by the step's admissions and its step()),
and on nothing else; a fetch that ends during its request's admission, or ended
since the last step, admits the request in that step. Decisions only: a scripted
tier (lookup hits, fetch returns a future the test completes), no store, no vLLM.

The bound is raised to 0.4 s here so that "waited the bound", "returned as soon as
the fetch completed" and "did not wait" are told apart on a loaded machine.
"""

import concurrent.futures as cf
import threading
import time
from types import SimpleNamespace

import pytest

from ecoffload.connector import cluster_tier
from ecoffload.connector.config import ClusterConfig
from ecoffload.engine.cluster.tier import ClusterFetch

BOUND_S = 0.4


class ScriptedTier:
    """Every key is in the store; each fetch's future is completed by the test."""

    available = True

    def __init__(self, *_, **__) -> None:
        self.futures: list[cf.Future] = []

    def step(self) -> None:
        pass

    def lookup(self, keys):
        return dict.fromkeys(keys, 64)

    def fetch(self, sizes, expected=None):
        f = ClusterFetch(deadline=time.monotonic() + 60.0, future=cf.Future())
        f.reserved = {k: (1, [(0, 1)], n) for k, n in sizes.items()}
        f.times["posted"] = time.monotonic()
        self.futures.append(f.future)  # type: ignore[arg-type]
        return f

    def poll(self, f):
        if f.state == "pending" and f.future.done():
            f.fetched, f.reserved, f.state = set(f.reserved), {}, "done"
        return f.state


@pytest.fixture
def consumer(monkeypatch):
    monkeypatch.setattr(cluster_tier, "ClusterTier", ScriptedTier)
    monkeypatch.setattr(cluster_tier, "StoreClient", lambda settings: None)
    monkeypatch.setattr(cluster_tier, "HOLD_YIELD_S", BOUND_S)
    config = ClusterConfig(master="127.0.0.1:1", metadata="http://127.0.0.1:2/metadata",
                           host="127.0.0.1")  # fmt: skip
    return cluster_tier.ClusterConsumer(None, None, config, layout="l", publish=False,  # type: ignore[arg-type]
                                        item_bytes=lambda modality, rows: None)  # fmt: skip


def request(rid, key):
    pos = SimpleNamespace(offset=0, length=4)
    feature = SimpleNamespace(identifier=key, mm_position=pos, modality="image")
    return SimpleNamespace(request_id=rid, mm_features=[feature],
                           get_num_encoder_embeds=lambda index: 4)  # fmt: skip


def held(consumer, rid="r1", key="img"):
    """A request held on a fetch in flight: admitted False, its lookup and fetch posted
    (the next admission or step() is the next step's)."""
    r = request(rid, key)
    assert not consumer.admit(r, 0, lambda k: False)
    consumer.step()  # the lookup hits, the fetch is posted
    return r


def timed(call, *args):
    t0 = time.monotonic()
    out = call(*args)
    return out, time.monotonic() - t0


def timed_step(consumer):
    return timed(consumer.step)[1]


def test_the_bound_is_a_fraction_of_the_switch_interval():
    assert 0 < cluster_tier.HOLD_YIELD_S <= 0.002


def test_admission_waits_the_bound_for_a_fetch_that_does_not_complete(consumer):
    r = held(consumer)
    admitted, took = timed(consumer.admit, r, 0, lambda k: False)
    assert not admitted  # still held: its fetch is pending
    assert BOUND_S * 0.9 <= took < BOUND_S + 0.5, took
    assert timed_step(consumer) < BOUND_S / 4  # the step's bound is spent: no second wait


def test_admission_admits_as_soon_as_the_fetch_completes(consumer):
    """The fetch ends while its request's admission waits: admitted in this step, not
    one engine iteration later."""
    r = held(consumer)
    (future,) = consumer.tier.futures
    threading.Timer(0.05, future.set_result, ([],)).start()
    admitted, took = timed(consumer.admit, r, 0, lambda k: False)
    assert admitted and 0.04 <= took < BOUND_S * 0.75, took
    assert consumer._fetching == {}  # committed (polled) by the admission itself


def test_held_requests_share_one_bound_per_step(consumer):
    one, two = held(consumer, "r1", "a"), held(consumer, "r2", "b")  # two fetches in flight
    assert len(consumer.tier.futures) == 2
    t0 = time.monotonic()
    assert not consumer.admit(one, 0, lambda k: False)
    assert not consumer.admit(two, 0, lambda k: False)
    consumer.step()
    took = time.monotonic() - t0
    assert BOUND_S * 0.9 <= took < BOUND_S * 1.5, took  # once, not three times
    _, again = timed(consumer.admit, one, 0, lambda k: False)  # the next step: a new bound
    assert again >= BOUND_S * 0.9, again


def test_step_waits_the_bound_when_no_admission_did(consumer):
    """vLLM did not reach the held request this step (no admission): step() yields."""
    held(consumer)
    took = timed_step(consumer)
    assert BOUND_S * 0.9 <= took < BOUND_S + 0.5, took


def test_step_proceeds_as_soon_as_the_fetch_completes(consumer):
    r = held(consumer)
    (future,) = consumer.tier.futures
    threading.Timer(0.05, future.set_result, ([],)).start()
    took = timed_step(consumer)
    assert 0.04 <= took < BOUND_S * 0.75, took
    admitted, took = timed(consumer.admit, r, 0, lambda k: False)
    assert admitted and took < BOUND_S / 4  # committed by the step: admitted, no wait


def test_step_without_a_held_request_does_not_wait(consumer):
    r = held(consumer)
    consumer.forget(r.request_id)  # its fetch runs on alone; nobody waits on it
    assert timed_step(consumer) < BOUND_S / 4
    assert len(consumer.tier.futures) == 1 and not consumer.tier.futures[0].done()


def test_step_with_only_local_hits_does_not_wait(consumer):
    _, took = timed(consumer.admit, request("r2", "local"), 0, lambda k: True)
    assert took < BOUND_S / 4
    assert timed_step(consumer) < BOUND_S / 4
    assert consumer.tier.futures == []


def test_a_fetch_ended_since_the_last_step_admits_its_request_without_waiting(consumer):
    r = held(consumer)
    (future,) = consumer.tier.futures
    future.set_result([])  # the get returned after the step that posted it
    admitted, took = timed(consumer.admit, r, 0, lambda k: False)
    assert admitted and took < BOUND_S / 4
    assert consumer._fetching == {}  # committed (polled) by the admission itself


def test_a_request_admitted_after_a_fetch_logs_its_hold_once(consumer, caplog):
    caplog.set_level("INFO", logger="vllm.ecoffload_cluster_hold")
    r = held(consumer)
    consumer.tier.futures[0].set_result([])
    consumer.step()
    assert consumer.admit(r, 0, lambda k: False)
    assert consumer.admit(request("r2", "local"), 0, lambda k: True)  # no fetch: no line
    (record,) = caplog.records
    message = record.getMessage()
    assert "cluster hold of r1" in message and "(2 steps)" in message, message
    posted, admitted = (float(message.split(word)[1].split()[0].rstrip(",")) for word in
                        ("fetch posted ", "admitted "))  # fmt: skip
    assert 0 <= posted <= admitted, message
