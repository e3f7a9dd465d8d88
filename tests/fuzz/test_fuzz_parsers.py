"""Fuzzing everything that parses: size strings, connector config, arena headers,
block tables. Each either yields a valid value or raises the specific error
type; nothing else escapes, and a refused table never touches the arena.

The generators aim at the inputs that matter: configs that are mostly valid
(one bad value at a time), headers that a real ``Arena.create`` wrote with one
field changed at a time (consistently, so some must attach, or not), block
tables that cover their items exactly with real extents, then get one defect
(an overlap with another item's real extent, an extent out of range, a block
too few or too many) for both backends, the Triton kernel in the interpreter
included. Each property runs inside a test that then checks what the run
reached (REACHED) against a floor, so a generator that drifts away from the
interesting cases fails instead of passing vacuously.
"""

import os
import tempfile
from collections import Counter

import pytest
import torch
from hypothesis import Phase, event, example, given, settings
from hypothesis import strategies as st

from ecoffload.connector.config import DEFAULTS, OffloadConfig
from ecoffload.engine.arena import arena as arena_mod
from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena.arena import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    Arena,
    process_start_time,
)
from ecoffload.engine.base.errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaLayoutMismatch,
    ArenaStaleError,
    ConfigError,
)
from ecoffload.engine.base.sizes import parse_bytes
from ecoffload.kernels import PlanError, pack, plan_copy, unpack

REACHED: Counter[str] = Counter()
MUTATION = bool(os.environ.get("ECOFFLOAD_MUTATION"))  # `make mutate`: fewer table examples


def reached(name: str) -> None:
    REACHED[name] += 1
    event(name)


def check_floors(prefix: str, floors: dict[str, int]) -> None:
    got = {k: REACHED[f"{prefix}{k}"] for k in floors}
    print(f"\n{prefix} reached: {got}")
    low = {k: (got[k], f) for k, f in floors.items() if got[k] < f and not MUTATION}
    assert not low, f"the run reached fewer than the floor of (reached, floor): {low}"


B = 4096
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.integers(), max_size=3), st.binary(max_size=8),
)  # fmt: skip
SIZE_TEXT = st.one_of(
    st.text(max_size=16),
    st.builds(lambda n, u, sp: f"{n}{sp}{u}", st.integers(-5, 10**6),
              st.sampled_from(["", "B", "k", "KB", "KiB", "mib", "G", "GiB", "TiB", "x", "iB"]),
              st.sampled_from(["", " ", "  "])),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(value=st.one_of(ANY_VALUE, SIZE_TEXT))
def test_parse_bytes_returns_a_positive_int_or_config_error(value):
    try:
        n = parse_bytes(value)
    except ConfigError:
        return
    assert isinstance(n, int) and n > 0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10**6), unit=st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_parse_bytes_units(n, unit):
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    assert parse_bytes(f"{n}{unit}") == n * scale[unit]


NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}"
VALID_VALUES = {
    "arena_bytes": st.one_of(st.integers(1, 512).map(lambda n: n * 4096),
                             st.sampled_from(["256KiB", "1MiB", "64 MiB", "4GiB", "8192"])),
    "block_bytes": st.one_of(st.integers(1, 16).map(lambda n: n * 4096),
                             st.sampled_from(["4KiB", "64KiB", "8 KiB", "4096"])),
    "arena_dir": st.just(tempfile.gettempdir()),
    "arena_name": st.one_of(st.none(), st.from_regex(NAME, fullmatch=True).filter(
        lambda n: ".." not in n)),
    "num_programs": st.one_of(st.none(), st.integers(1, 64)),
    "populate": st.sampled_from(["background", "eager", "lazy"]),
    "persistent": st.booleans(),
}  # fmt: skip


@st.composite
def extra_configs(draw):
    """Mostly valid configs: every key valid, then at most one defect."""
    keys = draw(st.lists(st.sampled_from(sorted(VALID_VALUES)), unique=True))
    extra = {k: draw(VALID_VALUES[k]) for k in keys}
    defect = draw(st.sampled_from(["none", "none", "value", "unknown-key"]))
    if defect == "value":
        extra[draw(st.sampled_from(sorted(DEFAULTS)))] = draw(st.one_of(ANY_VALUE, SIZE_TEXT))
    elif defect == "unknown-key":
        extra[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in DEFAULTS))] = 1
    return defect, extra


@settings(max_examples=300, deadline=None)
@given(case=extra_configs())
@example(case=("value", {"arena_name": 1}))  # found by the fuzzer: a non-string name crashed
def _config_property(case):
    defect, extra = case
    try:
        config = OffloadConfig.from_extra_config(extra, default_name="e")
    except ConfigError:
        fits = (
            parse_bytes(extra.get("arena_bytes", DEFAULTS["arena_bytes"]))
            >= parse_bytes(extra.get("block_bytes", DEFAULTS["block_bytes"]))
            if defect == "none"
            else False
        )
        assert not fits, f"a valid config was refused: {extra}"
        reached("config:refused")
        return
    reached("config:valid" if defect == "none" else "config:defect-accepted")
    assert config.block_bytes % 4096 == 0 and config.arena_bytes % config.block_bytes == 0
    assert config.num_blocks >= 1 and os.path.isdir(config.arena_dir)
    if defect == "none":
        assert config.block_bytes == parse_bytes(extra.get("block_bytes", DEFAULTS["block_bytes"]))
        if extra.get("arena_name"):
            assert config.arena_name == extra["arena_name"]


def test_connector_config_is_valid_or_config_error():
    for key in [k for k in REACHED if k.startswith("config:")]:
        del REACHED[key]
    _config_property()
    check_floors("config:", {"valid": 100, "refused": 40})


B_ARENA = 3  # blocks of the arenas the header fuzzer creates
LAYOUT = "fuzz-layout-key"
DEAD_PID = 2**31 - 1  # above any pid_max: never a live process
PAGE = 4096
# (field, new value, file size change in bytes, expected outcome): one field at a
# time. None as the outcome: the header is still consistent and must attach.
HEADER_CHANGES = [
    ("magic", b"ECOFFLD\x02", 0, ("magic", ArenaLayoutMismatch)),
    ("magic", b"garbage!", 0, ("magic", ArenaLayoutMismatch)),
    ("magic", b"\0" * 8, 0, ("unwritten", ArenaAttachTimeout)),
    ("version", FORMAT_VERSION + 1, 0, ("format_version", ArenaLayoutMismatch)),
    ("version", FORMAT_VERSION - 1, 0, ("format_version", ArenaLayoutMismatch)),
    ("version", 0, 0, ("format_version", ArenaLayoutMismatch)),
    ("header_bytes", 512, 0, ("header_bytes", ArenaLayoutMismatch)),
    ("block_bytes", 2 * B, B_ARENA * B, None),  # another block size, file grown to match
    ("block_bytes", 2 * B, 0, ("file_size", ArenaLayoutMismatch)),
    ("block_bytes", 0, -B_ARENA * B, ("block_bytes", ArenaLayoutMismatch)),
    ("block_bytes", 3, 3 * B_ARENA - B_ARENA * B, ("block_bytes", ArenaLayoutMismatch)),
    ("num_blocks", B_ARENA + 1, B, None),
    ("num_blocks", B_ARENA + 1, 0, ("file_size", ArenaLayoutMismatch)),
    ("num_blocks", 0, -B_ARENA * B, ("num_blocks", ArenaLayoutMismatch)),
    ("num_blocks", 2**40, 0, ("file_size", ArenaLayoutMismatch)),
    ("data_offset", 2 * HEADER_BYTES, HEADER_BYTES, None),  # a wider header, consistent
    ("data_offset", HEADER_BYTES + 17, 17, ("file_size", ArenaLayoutMismatch)),
    ("data_offset", 0, 0, ("file_size", ArenaLayoutMismatch)),
    ("creator_pid", DEAD_PID, 0, ("stale", ArenaStaleError)),
    ("creator_pid", 0, 0, None),  # creator unknown: not judged stale
    ("creator_start", 1, 0, ("stale", ArenaStaleError)),  # the pid was reused
    ("nonce", 0, 0, None),
    ("nonce", 2**64 - 1, 0, None),
    ("processes", 0, 0, None),
    ("processes", 2, 0, None),  # this attach completes the count: the name goes
    ("processes", 2**32 - 1, 0, None),
    ("attached", 0, 0, None),
    ("attached", 2**32 - 1, 0, None),  # a counter at its limit stays at it
    ("key_len", 0, 0, ("layout_key", ArenaLayoutMismatch)),
    ("key_len", len(LAYOUT) - 1, 0, ("layout_key", ArenaLayoutMismatch)),
    ("key_len", 2**32 - 1, 0, ("layout_key", ArenaLayoutMismatch)),
    ("owner_pid", os.getpid(), 0, None),
    ("owner_pid", DEAD_PID, 0, None),
    ("owner_start", 2**64 - 1, 0, None),
    ("file", None, -1, ("file_size", ArenaLayoutMismatch)),
    ("file", None, B, ("file_size", ArenaLayoutMismatch)),
    ("file", None, PAGE - (HEADER_BYTES + B_ARENA * B) - 1, ("unwritten", ArenaAttachTimeout)),
    ("key", b"fuzz-layout-kez", 0, ("layout_key", ArenaLayoutMismatch)),
    ("tail", b"\xff" * 32, 0, None),  # bytes after the key are not part of it
    (None, None, 0, None),
]


CHECKED_BEFORE_KEY = {"magic", "unwritten", "stale", "format_version", "header_bytes"}


@settings(max_examples=200, deadline=None)
@given(
    change=st.sampled_from(HEADER_CHANGES),
    processes=st.sampled_from([0, 3]),
    key_given=st.sampled_from(["same", "same", "missing", "any"]),
)
def _header_property(arena_dir, change, processes, key_given):
    field, value, grow, expected = change
    creator = Arena.create(
        "fuzz", block_bytes=B, num_blocks=B_ARENA, layout_key=LAYOUT, directory=arena_dir,
        processes=processes, register_cuda="never",
    )  # fmt: skip
    try:
        path = creator.path
        fd = os.open(path, os.O_RDWR)
        try:
            header = arena_mod.Header(*arena_format.HEADER.unpack_from(os.pread(fd, 128, 0)))
            if field in arena_mod.Header._fields:
                header = header._replace(**{field: value})
                os.pwrite(fd, arena_format.HEADER.pack(*header), 0)
            elif field == "key":
                os.pwrite(fd, value, 128)
            elif field == "tail":
                os.pwrite(fd, value, 128 + len(LAYOUT))
            if grow:
                os.ftruncate(fd, os.fstat(fd).st_size + grow)
        finally:
            os.close(fd)
        if key_given == "missing" and (expected is None or expected[0] not in CHECKED_BEFORE_KEY):
            expected = ("layout_key", ArenaLayoutMismatch)  # no key given: a keyed arena is refused
        if key_given == "missing" and (field, value) == ("key_len", 0):
            expected = None  # the header now says "no key": so does the attacher
        if key_given == "any" and expected and expected[0] == "layout_key":
            expected = None  # the explicit opt-out takes any key
        key = {"same": LAYOUT, "missing": None, "any": arena_mod.ANY_LAYOUT}[key_given]
        try:
            arena = Arena.attach("fuzz", directory=arena_dir, layout_key=key, timeout_s=0.02,
                                 register_cuda="never")  # fmt: skip
        except ArenaError as err:
            assert expected is not None, f"consistent header refused ({field}={value}): {err}"
            name, kind = expected
            assert isinstance(err, kind), f"{field}={value}: {err!r}, expected {kind.__name__}"
            if kind is ArenaLayoutMismatch:
                assert err.field == name, f"{field}={value}: {err}"
            reached(f"header:refused {name}")
            reached("header:refused")
            return
        with arena:  # only a consistent header may attach, and it reads as written
            assert expected is None, f"{field}={value} attached, expected {expected}"
            assert arena.nbytes == header.block_bytes * header.num_blocks
            assert arena.host.numel() == arena.nbytes and arena.nonce == header.nonce
            arena.host[-1] = 7  # the whole data area is mapped
            reached("header:attached")
            if field is not None:
                reached("header:attached after a change")
    finally:
        creator.close()
        if os.path.exists(path):
            os.unlink(path)


def test_any_arena_header_attaches_or_raises_arena_error(arena_dir):
    for key in [k for k in REACHED if k.startswith("header:")]:
        del REACHED[key]
    _header_property(arena_dir)
    check_floors("header:", {"attached": 40, "attached after a change": 25, "refused": 60,
                             "refused stale": 3, "refused file_size": 10})  # fmt: skip


def test_create_writes_the_header_the_fuzzer_changes(arena_dir):
    with Arena.create("h", block_bytes=2 * B, num_blocks=5, layout_key=LAYOUT, processes=3,
                      directory=arena_dir, register_cuda="never") as a:  # fmt: skip
        raw = os.pread(a._fd, HEADER_BYTES, 0)
    header = arena_mod.Header(*arena_format.HEADER.unpack_from(raw))
    assert header == arena_mod.Header(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, 2 * B, 5, HEADER_BYTES, os.getpid(),
        process_start_time(os.getpid()), a.nonce, 3, 1, len(LAYOUT), 0, 0,
    )  # fmt: skip
    assert raw[128 : 128 + len(LAYOUT)] == LAYOUT.encode() and not any(raw[128 + len(LAYOUT) :])


ARENA_BLOCKS = 16
DEFECTS = ["none", "overlap", "out-of-range", "short", "long", "bad-count"]


@st.composite
def table_cases(draw, defect):
    """Items with tables of real extents that cover them exactly, then ``defect``."""
    sizes = draw(st.lists(st.integers(1, 4 * B + 5), min_size=2, max_size=4))
    if draw(st.booleans()):  # an empty item among them: no blocks, no extents
        sizes.insert(draw(st.integers(0, len(sizes))), 0)
    runs, start = [], 0  # the arena cut into runs of 1-4 blocks, in a shuffled order
    while start < ARENA_BLOCKS:
        n = min(draw(st.integers(1, 4)), ARENA_BLOCKS - start)
        runs.append(range(start, start + n))
        start += n
    order = [b for run in draw(st.permutations(runs)) for b in run]
    tables, used = [], 0
    for n in sizes:
        need = -(-n // B)
        if used + need > ARENA_BLOCKS:
            break
        mine = order[used : used + need]
        used += need
        extents = []
        for block in mine:
            if extents and extents[-1][0] + extents[-1][1] == block:
                extents[-1] = (extents[-1][0], extents[-1][1] + 1)
            else:
                extents.append((block, 1))
        tables.append(extents)
    sizes = sizes[: len(tables)]
    free = order[used:]
    blocks = [[b for s, c in t for b in range(s, s + c)] for t in tables]
    owners = [i for i, b in enumerate(blocks) if b]
    if defect == "overlap" and sum(map(len, blocks)) >= 2:
        i = draw(st.sampled_from(owners))  # item i's block b goes to item j too
        j = draw(st.sampled_from([k for k in owners if k != i or len(blocks[k]) > 1]))
        b = draw(st.sampled_from(blocks[i]))
        pos = draw(st.sampled_from([p for p, x in enumerate(blocks[j]) if x != b]))
        blocks[j][pos] = b
        tables[j] = [(x, 1) for x in blocks[j]]
    elif defect == "out-of-range" and owners:
        j = draw(st.sampled_from(owners))
        bad = draw(st.sampled_from([-1, ARENA_BLOCKS, ARENA_BLOCKS + 7, -(2**40)]))
        tables[j] = [(x, 1) for x in blocks[j][:-1]] + [(bad, 1)]
    elif defect == "short" and owners:
        j = draw(st.sampled_from(owners))
        tables[j] = [(x, 1) for x in blocks[j][:-1]]
    elif defect == "long" and free:
        j = draw(st.integers(0, len(tables) - 1))
        tables[j] = tables[j] + [(free[0], 1)]
    elif defect == "bad-count" and owners:
        j = draw(st.sampled_from(owners))
        tables[j] = tables[j] + [(blocks[j][0], draw(st.sampled_from([0, -1])))]
    else:
        defect = "none"
    return sizes, tables, defect


def items_for(sizes):
    g = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    return [torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


@settings(max_examples=8 if MUTATION else 60, deadline=None,
          phases=(Phase.explicit, Phase.generate) if MUTATION else tuple(Phase))  # fmt: skip
@given(data=st.data())
def _tables_property(backend, defect, data):
    sizes, tables, defect = data.draw(table_cases(defect))
    items = items_for(sizes)
    arena = torch.zeros(ARENA_BLOCKS * B, dtype=torch.uint8)
    try:
        pack(items, tables, arena, B, backend=backend)
    except PlanError as err:
        assert defect != "none", f"a valid table was refused: {err}"
        assert not arena.any(), "a refused table wrote to the arena"
        if defect == "overlap":
            assert "blocks given twice" in str(err)
        reached(f"tables:{backend} refused {defect}")
        return
    assert defect == "none", f"a table with a defect ({defect}) was packed: {tables}"
    listed = {b for t in tables for s, c in t for b in range(s, s + c)}
    for block in set(range(ARENA_BLOCKS)) - listed:
        assert not arena[block * B : (block + 1) * B].any(), f"block {block} outside the tables"
    for item, table in zip(items, tables, strict=True):
        stream = torch.cat([arena[s * B : (s + c) * B] for s, c in table] or [item[:0]])
        assert torch.equal(stream[: item.numel()], item)
    outputs = [torch.full_like(item, 0) for item in items]
    unpack(arena, tables, B, outputs, backend=backend)
    assert all(torch.equal(o, i) for o, i in zip(outputs, items, strict=True))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    plan = plan_copy(offsets, sizes, tables, block_bytes=B, arena_bytes=ARENA_BLOCKS * B,
                     items_bytes=sum(sizes))  # fmt: skip
    spans = sorted((int(a), int(a + n)) for _, a, n, _ in plan.segments.tolist())
    assert all(0 <= a < b <= ARENA_BLOCKS * B for a, b in spans)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False))
    reached(f"tables:{backend} packed")
    if any(len(t) > 1 for t in tables):
        reached(f"tables:{backend} packed multi-extent")
    if any(c > 1 for t in tables for _, c in t):
        reached(f"tables:{backend} packed multi-block extent")


@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_block_tables_are_planned_in_bounds_or_refused_untouched(backend, defect):
    prefix = f"tables:{backend} "
    for key in [k for k in REACHED if k.startswith(prefix)]:
        del REACHED[key]
    _tables_property(backend, defect)
    if defect == "none":
        check_floors(
            prefix, {"packed": 35, "packed multi-extent": 4, "packed multi-block extent": 4}
        )
    else:
        check_floors(prefix, {f"refused {defect}": 35})
