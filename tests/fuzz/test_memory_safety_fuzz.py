"""Seeded fuzzers that keep the memory-safety boundaries where they are (in CI).

* The planner: random invalid steps (int64 limits, overlapping extents and items,
  malformed step arrays) planned with the C pass and with the Python passes
  alone must get the same answer: the same plan, or PlanError from both.
* The shared catalog: random words damaged with the dirty flag clear (a warm
  start's verification words among them: every slot's mark, the header's counts,
  cursor and start time), then random operations through the C paths and the
  Python ones, each with a deadline; the catalog's check passes after a rebuild.
  The catalog knows its data area (zeros), so lookups and ``verify_step`` check
  items a warm start (``begin_verify``) marked UNVERIFIED, with right and wrong
  CRCs.

Budgets: each fuzzer stops at its example count or after ``FUZZ_SECONDS`` (whichever
first; about 10 s each on a 2-vCPU VM); ``ECOFFLOAD_FUZZ_SECONDS`` and
``ECOFFLOAD_FUZZ_SEED`` widen or replay a run. Every failure names its seed.
"""

import contextlib
import os
import random
import signal
import time
import zlib

import numpy as np
import pytest
from catalogs import B, open_shared
from deadline import in_child

from ecoffload.engine.base.errors import CatalogError
from ecoffload.engine.catalog.shared.catalog import SharedCatalog
from ecoffload.engine.catalog.shared.format import (
    H_CLASSES,
    H_EVICTABLE,
    H_FREE_BLOCKS,
    H_HITS,
    H_LRU_HEAD,
    H_LRU_TAIL,
    H_MASK,
    H_PIN_FREE,
    H_SLOT_FREE,
    H_TICK,
    H_VERIFY_BYTES,
    H_VERIFY_CURSOR,
    H_VERIFY_DROPPED,
    H_VERIFY_ITEMS,
    H_VERIFY_LEFT,
    H_VERIFY_LEFT_BYTES,
    H_VERIFY_T0,
    PIN_WORDS,
    S_VERIFY,
    SLOT_WORDS,
    meta_bytes,
)
from ecoffload.kernels import PlanError, native
from ecoffload.kernels.planner import plan_copy
from ecoffload.kernels.step_table import StepTable

FUZZ_SECONDS = float(os.environ.get("ECOFFLOAD_FUZZ_SECONDS", "10"))
SEED = int(os.environ.get("ECOFFLOAD_FUZZ_SEED", "30"))
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
BLOCK = 64


def odd_int(rng: random.Random, around: int) -> int:
    """A value near a boundary: 0, +-1, the size, int64's limits, or a plain one."""
    plain = rng.randrange(-4, max(around, 0) + 4)
    return rng.choice([0, 1, -1, around - 1, around, around + 1, I64_MAX, I64_MIN,
                       I64_MAX - 1, 2**62, -(2**62), plain])  # fmt: skip


def random_step(rng: random.Random) -> dict:
    """A step, valid or mostly so, then damaged a few ways at random."""
    blocks = rng.choice([4, 16, 64])
    items = rng.randrange(0, 5)
    sizes = [rng.randrange(0, 4 * BLOCK) for _ in range(items)]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + rng.choice([0, 0, 16, 3])
    free = list(range(blocks))
    rng.shuffle(free)
    tables = []
    for n in sizes:
        need = -(-n // BLOCK)
        mine, free = free[:need], free[need:]
        tables.append([(b, 1) for b in mine])
    step = dict(offsets=offsets, sizes=sizes, tables=tables, block_bytes=BLOCK,
                arena_bytes=blocks * BLOCK, items_bytes=at, tile_bytes=rng.choice([16, 64, 1024]),
                num_programs=rng.choice([1, 3, 8]), items_base=rng.choice([0, 16, 4096, 7]),
                arena_base=rng.choice([0, 64, 2]), bounds=None)  # fmt: skip
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        damage = rng.randrange(10)
        flat = [(i, j) for i, t in enumerate(tables) for j in range(len(t))]
        if damage == 0 and flat:  # an extent's start or count at a boundary
            i, j = rng.choice(flat)
            s, c = tables[i][j]
            tables[i][j] = (odd_int(rng, blocks), c) if rng.random() < 0.5 else (s, odd_int(rng, 4))
        elif damage == 1 and flat:  # an extent given twice (or overlapping)
            i, j = rng.choice(flat)
            k = rng.randrange(len(tables))
            tables[k].append(tables[i][j])
        elif damage == 2 and items:  # an item's size or offset at a boundary
            i = rng.randrange(items)
            if rng.random() < 0.5:
                sizes[i] = odd_int(rng, sizes[i])
            else:
                offsets[i] = odd_int(rng, step["items_bytes"])
        elif damage == 3 and items > 1:  # items overlapping in the items buffer
            i, k = rng.sample(range(items), 2)
            offsets[i] = offsets[k]
            step["items_bytes"] = max(step["items_bytes"], offsets[k] + max(sizes[i], sizes[k]))
        elif damage == 4:  # a launch parameter at a boundary
            name = rng.choice(["block_bytes", "arena_bytes", "items_bytes", "tile_bytes",
                               "num_programs", "items_base", "arena_base"])  # fmt: skip
            step[name] = odd_int(rng, step[name])
        elif damage == 5:  # malformed bounds (a step table's)
            bounds = [0]
            for t in tables:
                bounds.append(bounds[-1] + len(t))
            k = rng.randrange(len(bounds))
            bounds[k] = odd_int(rng, bounds[k]) if rng.random() < 0.7 else bounds[k] - 1
            step["bounds"] = bounds
        elif damage == 6 and flat:  # a count that makes the item's blocks too many
            i, j = rng.choice(flat)
            s, c = tables[i][j]
            tables[i][j] = (s, c + rng.choice([1, 2, blocks]))
    return step


def answer(step: dict, as_step_table: bool):
    """plan_copy's answer: ("plan", rows, fields) or ("PlanError",)."""
    tables = step["tables"]
    kw = {k: step[k] for k in ("block_bytes", "arena_bytes", "items_bytes", "tile_bytes",
                                "num_programs", "items_base", "arena_base")}  # fmt: skip
    try:
        if as_step_table:
            table = StepTable.from_tables(tables)
            if step["bounds"] is not None:  # past the constructors' checks: the planner's
                table.bounds = np.array(step["bounds"], np.int64)
            tables = table
        plan = plan_copy(step["offsets"], step["sizes"], tables, **kw)
    except PlanError:
        return ("PlanError",)
    return ("plan", plan.table.tolist(), tuple(plan[1:]))


def test_the_c_pass_and_the_python_passes_agree_on_random_invalid_steps(monkeypatch):
    c_pass = native.planner()
    if c_pass is None:
        pytest.skip("the planner's C pass is not built on this host")
    rng = random.Random(SEED)
    stop, examples, refused = time.monotonic() + FUZZ_SECONDS, 0, 0
    while examples < 20_000 and time.monotonic() < stop:
        seed = rng.randrange(2**32)
        step = random_step(random.Random(seed))
        for as_step_table in (False, True):
            if step["bounds"] is not None and not as_step_table:
                continue
            try:
                monkeypatch.setattr(native, "planner", lambda: c_pass)
                with_c = answer(step, as_step_table)
                monkeypatch.setattr(native, "planner", lambda: None)
                python = answer(step, as_step_table)
            except Exception as e:  # anything but a plan or PlanError is a finding
                raise AssertionError(f"seed {seed}: {type(e).__name__}: {e}\n{step}") from e
            assert with_c == python, f"seed {seed} ({'step table' if as_step_table else 'lists'})"
            refused += with_c[0] == "PlanError"
        examples += 1
    assert examples >= 200 and refused, (examples, refused)  # it ran, and found refusals


# --- the shared catalog ---------------------------------------------------------------

KEYS = ["a", "bb", "c", "dd", "e"]
MAX_ITEMS, MAX_PINS, BLOCKS = 6, 4, 24


class Hung(BaseException):
    """An operation ran past its deadline (raised by the child's interval timer)."""


def _hung(signum, frame):
    raise Hung()


def damage_words(c: SharedCatalog, rng: random.Random) -> list[str]:
    """Set a few index-like or counter words to boundary values; what was damaged."""
    lay, w, i = c.layout, c._w, c._i
    done = []
    for _ in range(rng.randrange(1, 4)):
        kind = rng.randrange(4)
        if kind == 0:  # a header word
            at = rng.choice([H_LRU_HEAD, H_LRU_TAIL, H_SLOT_FREE, H_PIN_FREE, H_MASK,
                             H_FREE_BLOCKS, H_EVICTABLE, H_TICK, H_HITS,
                             H_CLASSES + rng.randrange(6), *VERIFY_HEADER])  # fmt: skip
            value = odd_int(rng, rng.choice([lay.max_items, lay.max_pins, lay.num_blocks]))
            w[at] = value
        elif kind == 1:  # a slot's word, its verification mark one time in three
            word = S_VERIFY if rng.random() < 1 / 3 else rng.randrange(14)
            at = c._sl + rng.randrange(lay.max_items) * SLOT_WORDS + word
            w[at] = value = odd_int(rng, rng.choice([lay.max_items, lay.num_blocks, 4, 2]))
        elif kind == 2:  # a pin record's word
            at = c._pn + rng.randrange(lay.max_pins) * PIN_WORDS + rng.choice([0, 1, 4])
            w[at] = value = odd_int(rng, lay.max_pins)
        else:  # a per-block word (int32): extent chains, free extents
            at = rng.randrange(6 * lay.num_blocks)
            value = rng.choice([-1, 0, 1, at % lay.num_blocks, lay.num_blocks,
                                lay.num_blocks + 1, 2**31 - 1, -(2**31)])  # fmt: skip
            i[at] = value
        done.append(f"{'hspb'[kind]}{at}={value}")
    return done


VERIFY_HEADER = [H_VERIFY_LEFT, H_VERIFY_LEFT_BYTES, H_VERIFY_ITEMS, H_VERIFY_BYTES,
                 H_VERIFY_DROPPED, H_VERIFY_CURSOR, H_VERIFY_T0]  # fmt: skip

OPS = ["reserve", "commit", "commit_crc", "abort", "lookup", "lookup_pin", "pin", "unpin",
       "unpin_many", "evict", "entry", "entries", "stats", "reap", "add_ready",
       "begin_verify", "verify_step", "verification"]  # fmt: skip


def commit_crc(c: SharedCatalog, key: str, rng: random.Random) -> None:
    """Commit ``key`` with the CRC-32 of its bytes (zeros), or a wrong one."""
    n = c.entry(key).nbytes
    right = rng.random() < 0.7 and 0 <= n <= BLOCKS * B
    c.commit(key, checksum=zlib.crc32(bytes(n)) if right else rng.randrange(2**32))


def warm_start(c: SharedCatalog, rng: random.Random) -> None:
    """Items committed with CRCs (some wrong), then marked UNVERIFIED by a warm start."""
    for key in KEYS:
        with contextlib.suppress(CatalogError):
            c.reserve(key, rng.randrange(1, 5) * B)
            commit_crc(c, key, rng)
    c.begin_verify()


def random_op(c: SharedCatalog, rng: random.Random, fast) -> str:
    key = rng.choice(KEYS)
    c._fast = fast if rng.random() < 0.5 else None  # the C paths, or the Python ones
    op = rng.choice(OPS)
    if op == "reserve":
        c.reserve(key, rng.randrange(1, 5) * B)
    elif op == "lookup":
        c.lookup(key)
    elif op == "lookup_pin":
        c.lookup(key, pin=True)
    elif op == "unpin_many":
        c.unpin_many([key, rng.choice(KEYS)])
    elif op == "commit_crc":
        commit_crc(c, key, rng)
    elif op == "verify_step":
        c.verify_step(rng.choice([1, B, 1 << 20]))
    elif op == "verification":
        c.verification().fraction  # noqa: B018 - its division, on whatever the words hold
    elif op in ("entries", "stats", "reap", "begin_verify"):
        getattr(c, op)()
    elif op == "add_ready":
        c.add_ready(BLOCKS)
    else:
        getattr(c, op)(key)
    return f"{op}({key!r}, {'C' if c._fast is not None else 'Python'})"


def open_with_data(path) -> SharedCatalog:
    """A shared catalog whose file holds its data area too (zeros) and that knows where:
    lookups and verify_step read items' bytes, as on an arena."""
    layout = dict(max_key_bytes=2, max_items=MAX_ITEMS, max_pins=MAX_PINS)
    c = open_shared(path, BLOCKS, **layout)
    meta = meta_bytes(BLOCKS, B, **layout)
    os.truncate(path, meta + BLOCKS * B)
    c._data_at = (meta, BLOCKS * B)
    return c


def test_random_damage_then_random_operations_never_hang_and_leave_a_catalog_that_checks(
    tmp_path,
):
    rng = random.Random(SEED)
    stop, rounds, refused = time.monotonic() + FUZZ_SECONDS, 0, 0
    while rounds < 400 and time.monotonic() < stop:
        seed = rng.randrange(2**32)
        path = tmp_path / f"c{rounds}"
        c = open_with_data(path)
        fast = c._fast
        r = random.Random(seed)
        if r.random() < 0.5:  # half the rounds: after a warm start, items left to verify
            warm_start(c, r)
        for _ in range(8):  # a lived-in catalog: items in every state, pins
            with contextlib.suppress(CatalogError):
                random_op(c, r, fast)
        c._fast = fast

        def run(c=c, r=r, fast=fast):
            damaged = damage_words(c, r)
            signal.signal(signal.SIGALRM, _hung)
            outcomes = []
            for _ in range(6):
                signal.setitimer(signal.ITIMER_REAL, 2.0)  # each operation's deadline
                try:
                    op = random_op(c, r, fast)
                    outcomes.append(f"{op}: ok")
                except CatalogError as e:
                    outcomes.append(f"{type(e).__name__}")
                except ValueError as e:  # a counter at int64's limit: a memoryview refuses
                    if "memoryview" not in str(e):
                        raise
                    outcomes.append("ValueError(limit)")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            return f"ok {damaged} {outcomes}"

        report = in_child(run, deadline_s=15.0, memory_bytes=256 << 20)
        assert report.startswith("ok"), f"seed {seed}: {report}"
        refused += "CatalogCorruptError" in report
        c._fast = None
        c.recover()  # what the next locker would do if an operation left it dirty
        c.check()
        c.close()
        os.unlink(path)
        rounds += 1
    assert rounds >= 20 and refused, (rounds, refused)  # it ran, and met damage
