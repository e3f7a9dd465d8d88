"""Fuzzing everything that parses: size strings, connector config, arena headers,
block tables. Each either yields a valid value or raises the specific error
type; nothing else escapes, and a refused table never touches the arena."""

import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ecoffload.connector.config import DEFAULTS, OffloadConfig
from ecoffload.engine import arena as arena_mod
from ecoffload.engine.arena import HEADER_BYTES, MAGIC, Arena
from ecoffload.engine.errors import ArenaError, ConfigError
from ecoffload.engine.sizes import parse_bytes
from ecoffload.kernels import PlanError, pack, plan_copy

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


@example(extra={"arena_name": 1})  # found by this test: a non-string name crashed
@settings(max_examples=300, deadline=None)
@given(extra=st.dictionaries(st.one_of(st.sampled_from(sorted(DEFAULTS)), st.text(max_size=8)),
                             st.one_of(ANY_VALUE, SIZE_TEXT), max_size=5))  # fmt: skip
def test_connector_config_is_valid_or_config_error(extra):
    try:
        config = OffloadConfig.from_extra_config(extra, engine_id="e")
    except ConfigError:
        return
    assert config.block_bytes % 4096 == 0 and config.arena_bytes % config.block_bytes == 0
    assert config.num_blocks >= 1 and os.path.isdir(config.arena_dir)


HEADER_FIELDS = st.tuples(
    st.sampled_from([MAGIC, b"\0" * 8, b"ECOFFLD\x02", b"garbage!"]),
    st.sampled_from([1, 0, 2, 2**32 - 1]),  # version
    st.sampled_from([HEADER_BYTES, 0, 512]),
    st.sampled_from([B, 0, 3, 2**63]),  # block bytes
    st.sampled_from([1, 0, 2**40]),  # blocks
    st.sampled_from([HEADER_BYTES, 0, 17, 2**62]),  # data offset
    st.sampled_from([0, os.getpid(), 2**31 - 1]),  # creator pid
    st.integers(0, 2**64 - 1),  # creator start
    st.integers(0, 2**64 - 1),  # nonce
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 5, 4000, 2**32 - 1]),  # key length
    st.sampled_from([0, os.getpid(), 2**31 - 1]),  # owner pid
    st.integers(0, 2**64 - 1),  # owner start
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fields=HEADER_FIELDS,
    tail=st.binary(min_size=0, max_size=64),
    extra=st.sampled_from([0, B, 2 * B]),
)
def test_any_arena_header_attaches_or_raises_arena_error(arena_dir, fields, tail, extra):
    path = os.path.join(arena_dir, "fuzz")
    try:
        with open(path, "wb") as f:
            f.write(arena_mod._HEADER.pack(*fields) + tail)
            f.truncate(HEADER_BYTES + extra)
        os.chmod(path, 0o600)
        try:
            arena = Arena.attach("fuzz", directory=arena_dir, timeout_s=0.02, register_cuda="never")
        except ArenaError:
            return
        with arena:  # only a consistent header may attach
            assert fields[0] == MAGIC and arena.nbytes == extra
    finally:
        os.unlink(path)


EXTENT = st.tuples(st.integers(-2, 20), st.integers(-1, 6))


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5 * B), min_size=0, max_size=4),
    tables=st.lists(st.lists(EXTENT, max_size=4), min_size=0, max_size=4),
)
def test_block_tables_are_planned_in_bounds_or_refused_untouched(sizes, tables):
    items = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate(sizes)]
    arena = torch.zeros(16 * B, dtype=torch.uint8)
    try:
        pack(items, tables, arena, B, backend="reference")
    except PlanError:
        assert not arena.any(), "a refused table wrote to the arena"
        return
    listed = {b for t in tables for s, c in t for b in range(s, s + c)}
    for block in set(range(16)) - listed:
        assert not arena[block * B : (block + 1) * B].any(), f"block {block} outside the tables"
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    plan = plan_copy(offsets, sizes, tables, block_bytes=B, arena_bytes=16 * B,
                     items_bytes=sum(sizes))  # fmt: skip
    spans = sorted((int(a), int(a + n)) for _, a, n, _ in plan.segments.tolist())
    assert all(0 <= a < b <= 16 * B for a, b in spans)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False))


def test_header_struct_is_what_the_fuzzer_packs():
    assert arena_mod._HEADER.size == struct.calcsize("<8sIIQQQqQQIIIqQ") <= 128
    with pytest.raises(struct.error):
        arena_mod._HEADER.pack(MAGIC, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
