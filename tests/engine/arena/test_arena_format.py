"""The arena file's format and an opener's checks (engine/arena/format.py), called
directly: each refusal's whole message (what was expected, what was found, what to
do), and the limits of what a header may say.

Headers are packed into a plain buffer here; the arena's own tests (test_arena.py)
reach the same checks through real files, create and attach.
"""

import os
import re

import pytest

from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena.format import (
    ANY_LAYOUT,
    FORMAT_VERSION,
    HEADER,
    HEADER_BYTES,
    KEY_OFFSET,
    MAGIC,
    Header,
    check_free_space,
    check_header,
    wait_for_header,
)
from ecoffload.engine.base.errors import (
    ArenaAttachTimeout,
    ArenaError,
    ArenaLayoutMismatch,
    ArenaStaleError,
)

B = 4096
PATH = "/dev/shm/a"  # only named in messages: no file is made


def header(key=b"", **fields) -> bytearray:
    """A header of 2 blocks of B bytes right after it, with ``fields`` changed."""
    h = Header(MAGIC, FORMAT_VERSION, HEADER_BYTES, B, 2, HEADER_BYTES, 1, 1, 7, 0, 1,
               len(key), 0, 0)._replace(**fields)  # fmt: skip
    buf = bytearray(HEADER_BYTES)
    HEADER.pack_into(buf, 0, *h)
    buf[KEY_OFFSET : KEY_OFFSET + len(key)] = key
    return buf


def refusal(buf, size=HEADER_BYTES + 2 * B, *, block_bytes=None, num_blocks=None, key=""):
    with pytest.raises(ArenaLayoutMismatch) as err:
        check_header(PATH, buf, block_bytes, num_blocks, key, size)
    return err.value


def says(field, found, expected) -> str:
    return (
        f"arena {PATH}: header field {field!r} is {found!r}, expected {expected!r}. Another "
        "model, dtype, block size or ecoffload version created it: use another arena name, "
        "or stop the processes using it and remove the file."
    )


def test_a_valid_header_passes_and_one_block_is_enough():
    check_header(PATH, header(), B, 2, "", HEADER_BYTES + 2 * B)
    check_header(PATH, header(num_blocks=1), None, None, ANY_LAYOUT, HEADER_BYTES + B)
    check_header(PATH, header(b'{"a":1}'), None, None, {"a": 1}, HEADER_BYTES + 2 * B)


@pytest.mark.parametrize(
    "fields,size,field,found,expected",
    [
        ({"block_bytes": B + 1}, HEADER_BYTES + 2 * B + 2, "block_bytes", B + 1,
         f"a positive multiple of {B}"),
        ({"block_bytes": 0}, HEADER_BYTES, "block_bytes", 0, f"a positive multiple of {B}"),
        ({"num_blocks": 0}, HEADER_BYTES, "num_blocks", 0, "a positive count"),
        ({}, HEADER_BYTES + 3 * B, "file_size", HEADER_BYTES + 3 * B, HEADER_BYTES + 2 * B),
        ({"data_offset": HEADER_BYTES + 8}, HEADER_BYTES + 8 + 2 * B, "file_size",
         HEADER_BYTES + 8 + 2 * B, HEADER_BYTES + 8 + 2 * B),
    ],
    ids=["block-not-a-page-multiple", "no-block-bytes", "no-blocks", "size", "data-unaligned"],
)  # fmt: skip
def test_a_header_the_file_cannot_hold_is_refused_naming_the_field(
    fields, size, field, found, expected
):
    err = refusal(header(**fields), size)
    assert (err.path, err.field, err.found, err.expected) == (PATH, field, found, expected)
    assert str(err) == says(field, found, expected)


def test_an_expectation_that_differs_is_named_with_both_values():
    err = refusal(header(), block_bytes=2 * B)
    assert str(err) == says("block_bytes", B, 2 * B) and err.path == PATH
    err = refusal(header(), num_blocks=3)
    assert str(err) == says("num_blocks", 2, 3)
    err = refusal(header(version=FORMAT_VERSION + 1))
    assert str(err) == says("format_version", FORMAT_VERSION + 1, FORMAT_VERSION)


def test_a_layout_key_that_is_not_utf8_is_shown_replaced_not_raised():
    err = refusal(header(b"k\xff"), key="k")
    assert (err.field, err.found, err.expected) == ("layout_key", "k\ufffd", "k")


def test_any_layout_names_itself():
    assert repr(ANY_LAYOUT) == "ANY_LAYOUT"


def test_a_missing_directory_and_too_little_free_space_are_refused_with_the_remedy(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ArenaError) as err:
        check_free_space(missing, B)
    assert str(err.value) == f"arena directory {missing} does not exist"
    total = 1 << 60
    with pytest.raises(ArenaError) as err:
        check_free_space(str(tmp_path), total)
    assert re.fullmatch(
        rf"arena needs {total} bytes but {re.escape(str(tmp_path))} has \d+ free: give the "
        "arena fewer bytes or free space there", str(err.value),
    )  # fmt: skip
    check_free_space(str(tmp_path), 0)


def test_waiting_for_a_header_that_never_comes_says_why_and_what_to_do(tmp_path):
    path = str(tmp_path / "a")
    with pytest.raises(ArenaAttachTimeout) as err:
        wait_for_header(path, 0.0, 0.5)
    assert str(err.value) == (
        f"no valid arena at {path} after 0.5 s (the file does not exist): start the creating "
        "process first, or raise the attach timeout"
    )
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes(10))
        with pytest.raises(ArenaAttachTimeout, match=re.escape("(the file has 10 bytes, not")):
            wait_for_header(path, 0.0, 0.0)
        os.pwrite(fd, header(creator_pid=0, magic=bytes(8)), 0)  # sized, magic not yet written
        with pytest.raises(ArenaAttachTimeout, match=re.escape("(the header is not written yet):")):
            wait_for_header(path, 0.0, 0.0)
        pid = _dead_pid()  # a creator that died before writing the magic
        os.pwrite(fd, header(creator_pid=pid, magic=bytes(8)), 0)
        with pytest.raises(ArenaStaleError) as err:
            wait_for_header(path, 0.0, 0.0)
        assert (err.value.path, err.value.inode, err.value.pid) == (path, os.fstat(fd).st_ino, pid)
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_path_that_is_no_regular_file_is_refused_by_name(tmp_path):
    with pytest.raises(ArenaError) as err:
        arena_format.check_owner(str(tmp_path), os.stat(tmp_path))
    assert str(err.value) == f"{tmp_path} is not a regular file"


def test_the_ready_prefix_is_read_capped_at_the_data_area():
    buf = bytearray(HEADER_BYTES)
    arena_format.write_ready(buf, 5 * B)
    assert arena_format.read_ready(buf, 8 * B) == 5 * B
    assert arena_format.read_ready(buf, 2 * B) == 2 * B


def test_a_waited_for_file_that_is_not_an_arena_is_named_in_the_refusal(tmp_path):
    path = str(tmp_path / "a")
    with open(path, "wb") as f:
        f.write(b"NOTOURS!" + bytes(HEADER_BYTES))
    os.chmod(path, 0o644)
    with pytest.raises(ArenaError) as err:
        wait_for_header(path, 0.0, 0.0)
    assert str(err.value) == (
        f"{path} has mode 644, expected 600: other users could read or change cached data; "
        "remove the file and let ecoffload create it"
    )
    os.chmod(path, 0o600)
    with pytest.raises(ArenaLayoutMismatch) as err:
        wait_for_header(path, 0.0, 0.0)
    assert (err.value.path, err.value.field, err.value.found) == (path, "magic", b"NOTOURS!")
    assert err.value.expected == MAGIC
    os.chown(path, 65534, 65534)
    with pytest.raises(ArenaError) as err:
        wait_for_header(path, 0.0, 0.0)
    assert str(err.value) == (
        f"{path} belongs to uid 65534, this process runs as uid {os.getuid()}: refusing to "
        "share memory with another user"
    )


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_shared_lifetime_arena_outlives_its_creator_for_a_waiting_attacher(tmp_path):
    path = str(tmp_path / "a")
    buf = header(creator_pid=_dead_pid())
    arena_format.write_lifetime(buf, arena_format.SHARED_LIFETIME)
    with open(path, "wb") as f:
        f.write(buf + bytes(2 * B))
    os.chmod(path, 0o600)
    fd, mm = wait_for_header(path, 0.0, 0.0)  # not stale: any holder keeps it
    mm.close()
    os.close(fd)
    arena_format.write_lifetime(buf, 0)  # the same file made by Arena.create: stale
    with open(path, "r+b") as f:
        f.write(buf)
    with pytest.raises(ArenaStaleError):
        wait_for_header(path, 0.0, 0.0)


def test_names_are_refused_with_the_rule():
    assert arena_format.check_arena_name("a.b-c_1") == "a.b-c_1"
    for bad in ("../x", 7):
        with pytest.raises(ArenaError) as err:
            arena_format.check_arena_name(bad)
        assert str(err.value) == (
            f"arena name {bad!r} is not allowed: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, with no '/' and no '..'"
        )


def test_a_layout_key_is_canonical_json_with_any_value_as_text():
    class Dtype:
        def __str__(self):
            return "torch.bfloat16"

    key = {"model": "m", "dtype": Dtype(), "hidden": 128}
    assert arena_format.layout_key_text(key) == (
        '{"dtype":"torch.bfloat16","hidden":128,"model":"m"}'
    )
    assert arena_format.layout_key_text("as given") == "as given"
