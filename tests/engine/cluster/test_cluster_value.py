"""engine/cluster/value.py: the header of a value in the store, and its keyed MAC."""

import os

import pytest

from ecoffload.engine.base.errors import ClusterError
from ecoffload.engine.cluster import value

PAYLOAD = [os.urandom(4096 * 3 + 17), os.urandom(63)]  # an item cut in two pieces


def sealed(key, store_key="ecoffload/ns/img-1", dtype="bfloat16", shape=(97, 64)):
    header = value.pack_header(sum(map(len, PAYLOAD)), dtype, shape)
    value.seal(header, key, store_key, PAYLOAD)
    return bytes(header)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 7, 1, 2, 3, 4, 5)], ids=["scalar", "1d", "8d"])
def test_header_round_trips(shape):
    raw = sealed(None, dtype="float32", shape=shape)
    assert len(raw) == value.HEADER_BYTES
    h = value.parse_header(raw)
    assert (h.nbytes, h.dtype, h.shape, h.mac) == (sum(map(len, PAYLOAD)), "float32", shape, None)


def test_headers_that_cannot_be_written_are_refused():
    with pytest.raises(ClusterError, match="at most 8 dimensions"):
        value.pack_header(1, "uint8", (1,) * 9)
    with pytest.raises(ClusterError, match="not an ecoffload value"):
        value.parse_header(b"\0" * value.HEADER_BYTES)


def test_mac_verifies_only_the_same_bytes_under_the_same_name_and_key(tmp_path):
    key = value.load_key(value.random_key_file(str(tmp_path / "k")))
    raw = sealed(key)
    assert value.verify(raw, key, "ecoffload/ns/img-1", PAYLOAD)
    flipped = [PAYLOAD[0][:-1] + bytes([PAYLOAD[0][-1] ^ 1]), PAYLOAD[1]]
    assert not value.verify(raw, key, "ecoffload/ns/img-1", flipped)
    assert not value.verify(raw, key, "ecoffload/ns/img-2", PAYLOAD)  # replayed elsewhere
    other = value.load_key(value.random_key_file(str(tmp_path / "k2")))
    assert not value.verify(raw, other, "ecoffload/ns/img-1", PAYLOAD)
    shape_changed = bytearray(raw)
    shape_changed[40] ^= 1  # the first dimension
    assert not value.verify(bytes(shape_changed), key, "ecoffload/ns/img-1", PAYLOAD)


def test_a_keyed_reader_refuses_unsealed_values_and_a_keyless_one_sealed_ones(tmp_path):
    key = value.load_key(value.random_key_file(str(tmp_path / "k")))
    assert not value.verify(sealed(None), key, "ecoffload/ns/img-1", PAYLOAD)
    assert not value.verify(sealed(key), None, "ecoffload/ns/img-1", PAYLOAD)
    assert value.verify(sealed(None), None, "ecoffload/ns/img-1", PAYLOAD)


def test_key_files_must_hold_a_secret(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ClusterError, match="at least 16"):
        value.load_key(str(short))
    with pytest.raises(ClusterError, match="cannot be read"):
        value.load_key(str(tmp_path / "missing"))
    path = value.random_key_file(str(tmp_path / "k"))
    assert os.stat(path).st_mode & 0o077 == 0
    assert len(value.load_key(path)) == 32
