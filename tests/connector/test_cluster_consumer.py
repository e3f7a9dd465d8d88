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
    """Every key but those in ``absent`` is in the store; each fetch's future is
    completed by the test. Records what it was asked."""

    available = True

    def __init__(self, *_, **__) -> None:
        self.futures: list[cf.Future] = []
        self.fetches: list[ClusterFetch] = []
        self.lookups: list[list[str]] = []
        self.expected: list[dict] = []
        self.absent: set[str] = set()
        self.published: list[list[str]] = []

    def step(self) -> None:  # as the tier's: every fetch still pending is polled
        for f in self.fetches:
            self.poll(f)

    def lookup(self, keys):
        self.lookups.append(list(keys))
        time.sleep(0.002)  # an RPC: the hold log's lookup start and end differ
        return {k: 64 for k in keys if k not in self.absent}

    def fetch(self, sizes, expected=None):
        f = ClusterFetch(deadline=time.monotonic() + 60.0, future=cf.Future())
        f.reserved = {k: (1, [(0, 1)], n) for k, n in sizes.items()}
        f.times["posted"] = time.monotonic()
        self.futures.append(f.future)  # type: ignore[arg-type]
        self.fetches.append(f)
        self.expected.append(dict(expected or {}))
        return f

    def publish(self, keys):
        self.published.append(list(keys))

    def poll(self, f):
        if f.state == "pending" and f.future.done():
            f.fetched, f.reserved, f.state = set(f.reserved), {}, "done"
            f.times["committed"] = time.monotonic()
        return f.state


@pytest.fixture
def consumer(monkeypatch):
    monkeypatch.setattr(cluster_tier, "ClusterTier", ScriptedTier)
    monkeypatch.setattr(cluster_tier, "StoreClient", lambda settings: None)
    monkeypatch.setattr(cluster_tier, "HOLD_YIELD_S", BOUND_S)
    config = ClusterConfig(master="127.0.0.1:1", metadata="http://127.0.0.1:2/metadata",
                           host="127.0.0.1")  # fmt: skip
    return cluster_tier.ClusterConsumer(None, None, config, layout="l", publish=False,  # type: ignore[arg-type]
                                        item_bytes=item_bytes)  # fmt: skip


def item_bytes(modality, rows):
    """The scheduler's sizes here: 100 bytes a row for images, audio's unknown."""
    return rows * 100 if modality == "image" else None


def request(rid, *keys, modalities=("image", "audio")):
    """Item i of ``keys`` takes tokens 10 i .. 10 i + 4 and has 4 + i rows."""
    features = [SimpleNamespace(identifier=key, modality=modalities[i % len(modalities)],
                                mm_position=SimpleNamespace(offset=10 * i, length=4))
                for i, key in enumerate(keys)]  # fmt: skip
    return SimpleNamespace(request_id=rid, mm_features=features,
                           get_num_encoder_embeds=lambda index: 4 + index)  # fmt: skip


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
    assert consumer._ready == set() and consumer._fetching == {}


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


def never_local(key):
    return False


def test_each_miss_is_looked_up_once_with_its_rows_and_size(consumer):
    from ecoffload.engine.cluster.tier import Expected

    r = request("r1", "a", "b", "c")
    assert not consumer.admit(r, 0, never_local)
    assert not consumer.admit(r, 0, never_local)  # asked again before the step: noted once
    consumer.step()
    assert consumer.tier.lookups == [["a", "b", "c"]]  # ONE lookup, each key once
    # rows from vLLM's count per item; size = rows x bytes per row where the scheduler
    # knows them (audio's: unknown)
    assert consumer.tier.expected == [{"a": Expected(4, 400), "b": Expected(5, None),
                                       "c": Expected(6, 600)}]  # fmt: skip
    assert not consumer.admit(request("r2", "p", "q", "s"), 0, lambda k: k == "q")
    consumer.step()
    assert consumer.tier.lookups[-1] == ["p", "s"]  # "q" is local: never looked up


def test_a_request_whose_items_all_missed_is_not_held_for_another_s_fetch(consumer):
    consumer.tier.absent = {"z"}
    assert not consumer.admit(request("r1", "a"), 0, never_local)
    assert not consumer.admit(request("r2", "z"), 0, never_local)
    consumer.step()  # one lookup for both: "a" found (fetched), "z" not
    assert consumer._ready == {"r2"} and set(consumer._fetching) == {"r1"}


def test_publish_hands_the_saved_keys_to_the_tier(consumer):
    consumer.publish([])
    consumer.publish(["a", "b"])
    assert consumer.tier.published == [["a", "b"]]


def test_items_already_computed_are_neither_looked_up_nor_waited_for(consumer):
    first = held(consumer, "r1", "a")  # a fetch of "a" in flight
    assert consumer._inflight.keys() == {"a"}
    consumer.step()  # still in flight after another step
    assert consumer._inflight.keys() == {"a"}
    again = request("r2", "a", "b", "c")
    assert not consumer.admit(again, 0, never_local)  # waits for r1's fetch of "a": no note
    assert "r2" not in consumer._asked
    assert not consumer.admit(again, 4, never_local)  # "a" computed (tokens 0-4): "b", "c"
    consumer.step()
    assert consumer.tier.lookups[-1] == ["b", "c"]
    late = request("r3", "x", "y", "z")
    assert not consumer.admit(late, 3, never_local)  # "x" not yet computed
    consumer.step()
    assert consumer.tier.lookups[-1] == ["x", "y", "z"]
    assert consumer.admit(request("r4", "p", "q"), 14, never_local)  # all computed: admitted
    assert first.request_id in consumer._fetching


def test_a_request_admitted_once_is_never_held_again_until_forgotten(consumer):
    """vLLM asks again each step while a request runs (its chunked prefill): its items
    were settled when it was admitted."""
    consumer.tier.absent = {"a"}
    r = request("r1", "a")
    assert not consumer.admit(r, 0, never_local)
    consumer.step()  # the lookup finds nothing: admitted, to encode "a"
    assert consumer.admit(r, 0, never_local)
    lookups = len(consumer.tier.lookups)
    assert consumer.admit(r, 2, never_local)  # the next chunk: not held, not looked up
    consumer.step()
    assert len(consumer.tier.lookups) == lookups
    local = request("r2", "b")
    assert consumer.admit(local, 0, lambda k: True)  # all local: admitted at once
    assert consumer.admit(local, 0, never_local)  # and not held later
    consumer.forget("r1")  # finished: a request of that id is a new one
    assert not consumer.admit(r, 0, never_local)


def test_forgetting_a_request_leaves_no_record_of_it(consumer):
    held(consumer, "r1", "a")
    assert not consumer.admit(request("r2", "b"), 0, never_local)
    consumer.tier.absent = {"c"}
    assert not consumer.admit(request("r3", "c"), 0, never_local)
    consumer.step()  # r3's lookup found nothing: ready
    assert consumer.admit(request("r4", "d"), 0, lambda k: True)  # admitted
    assert not consumer.admit(request("r5", "e"), 0, never_local)  # noted, not looked up
    for rid in ("r1", "r2", "r3", "r4", "r5"):
        consumer.forget(rid)
    records = (consumer._asked, consumer._fetching, consumer._ready, consumer._holds,
               consumer._hold_fetch, consumer._admitted)  # fmt: skip
    assert not any(records), records


def test_a_fetch_whose_request_went_is_still_polled_to_its_end(consumer):
    """Its items are committed (and its reservations settled) though nobody waits."""
    held(consumer, "r1", "a")
    consumer.forget("r1")
    consumer.step()  # polled: still pending
    (f,) = consumer.tier.fetches
    f.future.set_result([])
    consumer.step()
    assert f.state == "done" and consumer._inflight == {}


def test_step_waits_for_the_first_of_several_fetches(consumer):
    held(consumer, "r1", "a")
    held(consumer, "r2", "b")
    first, _ = consumer.tier.futures
    threading.Timer(0.05, first.set_result, ([],)).start()
    took = timed_step(consumer)
    assert 0.04 <= took < BOUND_S * 0.75, took
    assert consumer._ready == {"r1"} and "r2" in consumer._fetching


def test_the_hold_log_gives_each_phase_in_order(consumer, caplog):
    import re

    caplog.set_level("INFO", logger="vllm.ecoffload_cluster_hold")
    r = request("r1", "a")
    assert not consumer.admit(r, 0, never_local)
    time.sleep(0.002)
    consumer.step()  # lookup (2 ms), fetch posted
    (f,) = consumer.tier.fetches
    for phase in ("started", "got", "checked"):
        time.sleep(0.002)
        f.times[phase] = time.monotonic()
    f.future.set_result([])
    time.sleep(0.002)
    consumer.step()  # committed
    time.sleep(0.002)
    assert consumer.admit(r, 0, never_local)
    (record,) = caplog.records
    message = record.getMessage()
    numbers = re.findall(r"(?<=[\s-])-?\d+\.\d+|\(\d+ steps\)", message)  # "a-b": a range
    assert len(numbers) == 9 and numbers[-1] == "(2 steps)", message
    ms = [float(n) for n in numbers[:-1]]
    # lookup start, end, posted, get start, end, checked, committed, admitted, in ms
    # after the admission noted r1: in order, each but "posted" (at once after the
    # lookup) at least the ~2 ms slept or spent before it
    gaps = [b - a for a, b in zip(ms, ms[1:], strict=False)]
    assert gaps[1] >= 0 and all(g >= 1.5 for i, g in enumerate(gaps) if i != 1), message
    assert 1.5 <= ms[0] < ms[-1] < 1000, message
    assert message.startswith("ecoffload: cluster hold of r1, ms after admission noted it")


@pytest.mark.parametrize(
    ("host", "publish", "config_publish"),
    [("10.0.0.2", True, True), (None, True, False), (None, False, True)],
)
def test_the_config_reaches_the_store_client_and_the_tier(monkeypatch, tmp_path, host, publish,
                                                          config_publish):  # fmt: skip
    """Each key of ``cluster`` where it acts: the client's settings (its host, where
    unset, this host's outward address), the tier's namespace, key, bounds and queue;
    publishing only where the instance saves and the config allows."""
    from ecoffload.engine.cluster.store import StoreSettings
    from ecoffload.engine.cluster.value import load_key, random_key_file

    made = {}

    class RecordingTier(ScriptedTier):
        def __init__(self, arena, catalog, client, **kw):
            made["tier"] = (arena, catalog, client, kw)
            super().__init__()

    monkeypatch.setattr(cluster_tier, "ClusterTier", RecordingTier)
    monkeypatch.setattr(cluster_tier, "StoreClient", lambda settings: ("client", settings))
    monkeypatch.setattr(cluster_tier, "outward_ip", lambda: "10.9.8.7")
    key = random_key_file(str(tmp_path / "cluster.key"))
    config = ClusterConfig.from_value({
        "master": "10.0.0.1:50051", "metadata": "http://10.0.0.1:8080/metadata", "host": host,
        "segment_bytes": "32MiB", "key_file": key, "fetch_timeout_s": 3, "publish": config_publish,
        "publish_queue": 7,
    })  # fmt: skip
    assert config is not None
    consumer = cluster_tier.ClusterConsumer("arena", "catalog", config, layout="lay",  # type: ignore[arg-type]
                                            publish=publish, item_bytes=item_bytes)  # fmt: skip
    arena, catalog, client, kw = made["tier"]
    assert (arena, catalog) == ("arena", "catalog") and isinstance(consumer.tier, RecordingTier)
    assert client == ("client", StoreSettings(master="10.0.0.1:50051",
                                              metadata="http://10.0.0.1:8080/metadata",
                                              host=host or "10.9.8.7", protocol="tcp",
                                              segment_bytes=32 << 20))  # fmt: skip
    assert kw == {"namespace": "lay", "key": load_key(key), "fetch_timeout_s": 3,
                  "publish": publish and config_publish, "queue_items": 7}  # fmt: skip
    assert consumer.catalog == "catalog"


def test_without_a_key_file_values_carry_no_mac(monkeypatch):
    made = {}

    def tier(*args, **kw):
        made["kw"] = kw
        return ScriptedTier()

    monkeypatch.setattr(cluster_tier, "ClusterTier", tier)
    monkeypatch.setattr(cluster_tier, "StoreClient", lambda settings: None)
    config = ClusterConfig(master="127.0.0.1:1", metadata="http://127.0.0.1:2/metadata",
                           host="127.0.0.1")  # fmt: skip
    cluster_tier.ClusterConsumer(None, None, config, layout="l", publish=True,  # type: ignore[arg-type]
                                 item_bytes=item_bytes)  # fmt: skip
    assert made["kw"]["key"] is None
