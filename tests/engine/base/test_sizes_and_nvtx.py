import contextlib

import pytest

from ecoffload.engine.base.errors import ConfigError
from ecoffload.engine.base.sizes import format_bytes, parse_bytes
from ecoffload.kernels import nvtx as nv


@pytest.mark.parametrize(
    "text,value",
    [
        (4096, 4096), ("4096", 4096), ("8GiB", 8 << 30), ("8 GiB", 8 << 30), ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000), ("64KiB", 65536), ("2k", 2000), ("1TiB", 1 << 40), ("3b", 3),
    ],
)  # fmt: skip
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "cannot read"), ("8 gigs", "cannot read"), ("-1GiB", "cannot read"), (0, "positive"),
        (-4096, "positive"), ("0.5B", "whole number"), (True, "bool"), (1.5, "float"),
        ("1e9", "cannot read"),
    ],
)  # fmt: skip
def test_parse_bytes_rejects(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_bytes(text, name="arena_bytes")


def test_format_bytes():
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"
    assert format_bytes(3 << 30) == "3.0 GiB"


def test_nvtx_off_is_a_shared_no_op():
    nv.set_enabled(False)
    assert nv.nvtx_range("a") is nv.nvtx_range("b")
    assert isinstance(nv.nvtx_range("a"), contextlib.nullcontext)

    @nv.traced("f")
    def f(x):
        return x + 1

    assert f(1) == 2


def test_nvtx_on_uses_the_ecoffload_domain():
    pytest.importorskip("nvtx")
    try:
        assert nv.set_enabled(True) and nv.enabled()
        ctx = nv.nvtx_range("ecoffload.test")
        assert not isinstance(ctx, contextlib.nullcontext)
        with ctx:
            pass
        assert nv._annotate.keywords["domain"] == "ecoffload"
    finally:
        nv.set_enabled(False)
