"""``ecoffload arenas / inspect / verify / rm`` against live shared arenas of other processes.

Each arena is held by a separate Python process (an ``OffloadCache`` with the
shared catalog, as the connector's instances open it) that saved three items
with CRC-32s, pins one and holds one reservation still WRITING, then waits.
The command runs as installed (the ``ecoffload`` console script). Read-only
commands must leave every byte of the arena file as it was, also when they
meet a dead holder's pins and reservations (which opening the catalog would
release).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig

import pytest

from ecoffload.engine.arena.arena import Arena

B = 4096
ITEMS = {"img-0": 3 * B + 100, "img-1": B, "img-2": 2 * B}  # bytes of each saved item
WRITING = "img-w"  # reserved, never committed

HOLDER = f"""
import sys, torch
from ecoffload.engine import OffloadCache
name, directory, persistent = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
sizes = {ITEMS!r}
c = OffloadCache.create(name, arena_bytes=32 * {B}, block_bytes={B}, directory=directory,
                        shared=True, persistent=persistent, integrity=True,
                        layout_key={{"model": "tiny", "dtype": "uint8"}})
c.save({{k: torch.full((n,), i + 1, dtype=torch.uint8) for i, (k, n) in enumerate(sizes.items())}})
c.flush()
assert c.catalog.lookup("img-1", pin=True) is not None
assert c.catalog.reserve({WRITING!r}, 2 * {B}) is not None
print("ready", flush=True)
sys.stdin.read()  # holds the arena until stdin closes (or it is killed)
c.close()
"""


class Holder:
    """A process holding a shared arena with items, a pin and a WRITING reservation."""

    def __init__(self, name, directory, *, persistent=False):
        self.path = os.path.join(directory, name)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, name, directory, "1" if persistent else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"holder failed: {line!r}"

    @property
    def pid(self):
        return self.proc.pid

    def kill(self):
        self.proc.kill()
        self.proc.wait(60)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def holders():
    started = []

    def start(name, directory, **kwargs):
        started.append(Holder(name, directory, **kwargs))
        return started[-1]

    yield start
    for holder in started:
        holder.close()
        Arena.remove_shared(os.path.basename(holder.path), directory=os.path.dirname(holder.path))


def ecoffload(*args):
    """The installed console script, ``--json`` (the exit code and the parsed output)."""
    script = os.path.join(sysconfig.get_path("scripts"), "ecoffload")
    out = subprocess.run([script, *args, "--json"], capture_output=True, text=True, timeout=300)
    return out.returncode, (json.loads(out.stdout) if out.stdout.strip() else None), out.stderr


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_arenas_lists_each_live_arena_with_its_holders(arena_dir, holders):
    live = holders("live", arena_dir)
    kept = holders("kept", arena_dir, persistent=True)
    before = digest(live.path), digest(kept.path)
    code, report, err = ecoffload("arenas", arena_dir)
    assert code == 0, err
    rows = {a["name"]: a for a in report["arenas"]}
    assert set(rows) == {"live", "kept"}
    for row, holder in ((rows["live"], live), (rows["kept"], kept)):
        assert row["block_bytes"] == B and row["num_blocks"] == 32
        assert row["layout_key"] == '{"dtype":"uint8","model":"tiny"}'
        assert row["shared_lifetime"] and row["has_catalog"] and row["format_version"] >= 3
        assert row["ready_fraction"] == 1.0
        assert row["items"] == len(ITEMS) + 1 and row["items_ready"] == len(ITEMS)
        assert row["bytes_used"] == sum(ITEMS.values())
        assert row["blocks_free"] == 32 - sum(-(-n // B) for n in ITEMS.values()) - 2
        assert [h["pid"] for h in row["holders"]] == [holder.pid]
        assert "ecoffload.engine" in row["holders"][0]["command"]
        assert row["size_bytes"] == os.path.getsize(holder.path)
    assert (rows["live"]["persistent"], rows["kept"]["persistent"]) == (False, True)
    assert rows["live"]["janitor_pid"] and rows["kept"]["janitor_pid"] is None
    assert (digest(live.path), digest(kept.path)) == before


def test_inspect_shows_states_pins_producers_and_free_room_and_changes_nothing(arena_dir, holders):
    live = holders("live", arena_dir)
    before = digest(live.path)
    code, report, err = ecoffload("inspect", "live", "--dir", arena_dir)
    assert code == 0, err
    assert digest(live.path) == before
    assert report["items_by_state"] == {"writing": 1, "ready": len(ITEMS), "unverified": 0}
    items = {i["key"]: i for i in report["items"]}
    assert {k: items[k]["nbytes"] for k in ITEMS} == ITEMS
    assert items[WRITING]["state"] == "writing"
    assert report["pins"] == [
        {"key": "img-1", "pid": live.pid, "start_time": report["pins"][0]["start_time"],
         "count": 1, "alive": True}
    ]  # fmt: skip
    assert report["producers"] == [{"key": WRITING, "pid": live.pid, "alive": True}]
    ages = [i["lru_age"] for i in report["items"]]
    assert ages == sorted(ages, reverse=True)  # least recently used first
    assert items["img-1"]["lru_age"] < items["img-0"]["lru_age"]  # the pin used it last
    free = report["free_extents"]
    assert free["blocks"] == report["arena"]["blocks_free"]
    assert free["largest"] == max(n for _, n in free["extents"])
    assert report["check"] == {"ok": True, "error": None}
    assert report["consistent"] is True  # an idle arena: two equal copies


def test_a_copy_without_a_second_equal_one_is_marked_not_consistent(arena_dir, holders):
    from ecoffload.engine.survey import CatalogSnapshot

    live = holders("live", arena_dir)
    rushed, settled = CatalogSnapshot.take(live.path, timeout_s=0), CatalogSnapshot.take(live.path)
    assert (rushed.consistent, settled.consistent) == (False, True)
    assert rushed.items() == settled.items()  # nothing changed: the same view
    assert rushed.verify().ok is False and settled.verify().ok is True


def test_a_dead_holder_s_pins_and_reservation_are_shown_and_verify_releases_them_in_a_copy(
    arena_dir, holders
):
    dead = holders("kept", arena_dir, persistent=True)
    dead.kill()  # SIGKILL: its pin and its reservation stay in the persistent arena
    assert dead.proc.returncode == -signal.SIGKILL
    before = digest(dead.path)

    code, report, err = ecoffload("inspect", "kept", "--dir", arena_dir)
    assert code == 0, err
    assert report["arena"]["holders"] == []
    assert [(p["key"], p["pid"], p["alive"]) for p in report["pins"]] == [
        ("img-1", dead.pid, False)
    ]
    assert report["producers"] == [{"key": WRITING, "pid": dead.pid, "alive": False}]

    code, report, err = ecoffload("verify", "kept", "--dir", arena_dir)
    assert code == 0, err
    assert report["ok"] and report["check_error"] is None
    assert report["released_dead_reservations"] == [WRITING]
    assert report["items_before"] == len(ITEMS) + 1 and report["items_kept"] == len(ITEMS)
    assert report["dropped_crc_mismatch"] == 0
    assert digest(dead.path) == before  # the copy was released, not the arena

    code, report, err = ecoffload("rm", "kept", "--dir", arena_dir)
    assert (code, report["removed"], report["holders"]) == (0, True, []), err
    assert not os.path.exists(dead.path)


def test_verify_reports_an_item_a_warm_restart_would_drop(arena_dir, holders):
    holder = holders("kept", arena_dir, persistent=True)
    _, report, _ = ecoffload("inspect", "kept", "--dir", arena_dir)
    holder.close()  # the last holder leaves; the persistent arena stays
    header = report["arena"]
    data_offset = header["size_bytes"] - header["num_blocks"] * header["block_bytes"]
    code, clean, err = ecoffload("verify", "kept", "--dir", arena_dir)
    assert (code, clean["ok"]) == (0, True), err
    first_block = _first_block_of(holder.path, "img-0")
    with open(holder.path, "r+b") as f:  # a stray write while nobody held the file
        f.seek(data_offset + first_block * B + 5)
        f.write(b"\xee")
    code, report, _ = ecoffload("verify", "kept", "--dir", arena_dir)
    assert code == 1
    assert (report["ok"], report["dropped_crc_mismatch"]) == (False, 1)
    assert report["items_kept"] == len(ITEMS) - 1
    assert ecoffload("rm", "kept", "--dir", arena_dir)[0] == 0


def _first_block_of(path, key):
    from ecoffload.engine.survey import CatalogSnapshot

    snapshot = CatalogSnapshot.take(path)
    with snapshot.opened() as catalog:
        return catalog.entry(key).extents[0].start


def test_rm_refuses_while_a_process_holds_the_arena_and_names_it(arena_dir, holders):
    live = holders("live", arena_dir)
    before = digest(live.path)
    code, report, err = ecoffload("rm", "live", "--dir", arena_dir)
    assert code == 1
    assert report["removed"] is False
    assert [h["pid"] for h in report["holders"]] == [live.pid]
    assert os.path.exists(live.path) and digest(live.path) == before
    script = os.path.join(sysconfig.get_path("scripts"), "ecoffload")
    plain = subprocess.run([script, "rm", "live", "--dir", arena_dir], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert plain.returncode == 1 and f"pid {live.pid}" in plain.stderr
    live.close()  # the last holder of a non-persistent arena: the name goes with it
    assert not os.path.exists(live.path)


def test_an_unknown_name_is_reported_not_raised(arena_dir):
    for command in ("inspect", "verify", "rm"):
        code, report, err = ecoffload(command, "nothing-here", "--dir", arena_dir)
        assert (code, report) == (2, None)
        assert "expected an arena file" in err and "ecoffload arenas" in err
    code, report, _ = ecoffload("arenas", arena_dir)
    assert (code, report) == (0, {"directory": arena_dir, "arenas": []})
