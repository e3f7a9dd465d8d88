"""Populate (engine/arena/populate.py) on a mapping of its own, without an arena: how a
data area is cut into chunks and threads, what a resumed populate starts from, the
ready prefix it publishes, and what it says (progress, the end, a failure).

The arena's tests (test_arena_startup.py) run the same populate through
``Arena.create``; these look at the numbers and the words.
"""

import errno
import logging
import mmap
import os
import re
import threading

import pytest

from ecoffload.engine.arena import format as arena_format
from ecoffload.engine.arena import populate
from ecoffload.engine.arena.populate import PARALLEL_POPULATE_BYTES, Populator
from ecoffload.engine.base.errors import ArenaError

P = mmap.PAGESIZE
LOG = "ecoffload.engine.arena.arena"


@pytest.fixture
def mapping(tmp_path, monkeypatch):
    """A shared mapping of 16 pages after a header-sized first part, and its file.

    The madvise binding is made afresh: made once per process, it would otherwise come
    from whatever ran first (under mutmut, the fork server, before any mutant)."""
    monkeypatch.setattr(populate, "_libc_madvise", None)
    path = str(tmp_path / "area")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, arena_format.HEADER_BYTES + 16 * P)
    mm = mmap.mmap(fd, arena_format.HEADER_BYTES + 16 * P)
    yield fd, mm, path
    mm.close()
    os.close(fd)


def test_threads_default_to_one_below_the_parallel_size_and_never_exceed_the_chunks(
    mapping, monkeypatch
):
    _, mm, path = mapping
    assert Populator(mm, 0, PARALLEL_POPULATE_BYTES - 1, None, path).threads == 1
    many = Populator(mm, 0, PARALLEL_POPULATE_BYTES, None, path)
    assert many.threads == min(8, os.cpu_count() or 1)
    chunks = -(-PARALLEL_POPULATE_BYTES // populate.POPULATE_CHUNK)
    assert many._chunks[0] == (0, populate.POPULATE_CHUNK) and len(many._chunks) == chunks
    two = Populator(mm, 0, populate.POPULATE_CHUNK + 1, 5, path)  # 2 chunks: 2 threads
    assert two.threads == 2 and two._chunks[1] == (populate.POPULATE_CHUNK, 1)
    assert Populator(mm, 0, P, 0, path).threads == 1
    # the size decides, wherever the area starts: just below it at 1 MiB is still one
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert Populator(mm, 1 << 20, (1 << 20) + PARALLEL_POPULATE_BYTES - 1, None, path).threads == 1


@pytest.mark.parametrize("cpus,threads", [(16, 8), (None, 1)], ids=["many-cpus", "unknown"])
def test_a_large_populate_takes_at_most_8_threads_and_1_when_the_cpus_are_unknown(
    mapping, monkeypatch, cpus, threads
):
    _, mm, path = mapping
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert Populator(mm, 0, PARALLEL_POPULATE_BYTES, None, path).threads == threads


def test_a_resumed_populate_starts_at_its_prefix_and_publishes_from_there(mapping, monkeypatch):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "POPULATE_CHUNK", 4 * P)
    start = arena_format.HEADER_BYTES
    p = Populator(mm, start, start + 16 * P, 1, path, done=6 * P)
    assert p._chunks == [(start + 6 * P, 4 * P), (start + 10 * P, 4 * P), (start + 14 * P, 2 * P)]
    assert p._ready() == 6 * P  # nothing new yet: what was done
    p.run_first()
    assert arena_format.read_ready(mm, 16 * P) == 10 * P and p.seconds is None
    p.run()
    assert arena_format.read_ready(mm, 16 * P) == 16 * P and p.seconds is not None


def test_progress_and_the_end_are_logged_with_numbers(mapping, monkeypatch, caplog):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "POPULATE_CHUNK", 4 * P)
    monkeypatch.setattr(populate, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.DEBUG, logger=LOG):
        Populator(mm, 0, 16 * P, 1, path).run()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG]
    mib = 16 * P / 2**30
    for (level, line), percent in zip(lines, (25, 50, 75), strict=False):
        assert level == logging.INFO
        assert re.fullmatch(
            rf"arena {re.escape(path)}: pre-faulted {percent}% \({percent * mib / 100:.1f} of "
            rf"{mib:.1f} GiB\) at \d+\.\d\d GiB/s, ETA \d+\.\d s", line,
        ), line  # fmt: skip
    level, last = lines[-1]
    assert len(lines) == 4 and level == logging.DEBUG  # 4 chunks: a small populate, quietly
    assert re.fullmatch(
        rf"arena {re.escape(path)}: pre-faulted 0\.0 GiB in \d+\.\d\d s \(\d+\.\d\d GiB/s, "
        r"1 thread\(s\)\)", last,
    ), last  # fmt: skip


def test_the_end_of_a_populate_of_more_than_four_chunks_is_logged_at_info(
    mapping, monkeypatch, caplog
):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "POPULATE_CHUNK", 2 * P)
    with caplog.at_level(logging.INFO, logger=LOG):
        Populator(mm, 0, 16 * P, 2, path).run()
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert line.startswith(f"arena {path}: pre-faulted 0.0 GiB in ") and "2 thread(s)" in line


def test_a_page_that_cannot_be_faulted_stops_populate_at_its_prefix_and_says_so(
    mapping, monkeypatch, caplog
):
    fd, mm, path = mapping
    monkeypatch.setattr(populate, "POPULATE_CHUNK", 4 * P)
    p = Populator(mm, 0, 16 * P, 1, path)
    p.run_first()  # the header's first 4 pages are ready
    os.ftruncate(fd, 8 * P)  # pages 8 on would now raise SIGBUS: madvise says EFAULT
    with caplog.at_level(logging.ERROR, logger=LOG), pytest.raises(ArenaError) as err:
        p.run()
    reason = f"[Errno {errno.EFAULT}] pre-faulting {path}: {os.strerror(errno.EFAULT)}"
    assert str(err.value) == f"{reason}; is there enough free memory for the arena?"
    assert p.failure.errno == errno.EFAULT
    assert arena_format.read_ready(mm, 16 * P) == 8 * P  # chunks 0 and 1 stay ready
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert line == (
        f"arena {path}: populate stopped at 0 of 0 MiB ({reason}); only the ready part is used"
    )
    assert not p._step()  # failed: no more chunks are taken


def test_without_madvise_every_page_is_touched_and_the_data_kept_zero(mapping, monkeypatch):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL
    mm[:] = b"\x01" * len(mm)
    p = Populator(mm, P, 5 * P, 1, path)
    p.run()
    touched = [i for i in range(len(mm) // P) if mm[i * P] == 0]
    assert touched == [1, 2, 3, 4]  # the first byte of each page of the area, no other
    assert mm[P + 1 : 2 * P] == b"\x01" * (P - 1)


def test_populate_threads_are_named_daemons_and_stop_within_their_chunk(mapping, monkeypatch):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "POPULATE_CHUNK", P)
    release, entered, real = threading.Event(), threading.Semaphore(0), populate.prefault

    def held(*args):
        entered.release()
        assert release.wait(30), "the test never released the populate"
        real(*args)

    monkeypatch.setattr(populate, "prefault", held)
    p = Populator(mm, 0, 16 * P, 2, path)
    p.start()
    try:
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # both in a chunk
        threads = [t for t in threading.enumerate() if t.name.startswith("ecoffload-populate-")]
        assert sorted(t.name for t in threads) == ["ecoffload-populate-0", "ecoffload-populate-1"]
        assert all(t.daemon for t in threads)  # never keep the interpreter alive
    finally:
        p._stop.set()
        release.set()
        p.stop()
    assert not any(t.is_alive() for t in threads)
    assert arena_format.read_ready(mm, 16 * P) == 2 * P  # the two chunks in flight, no more


GIB, MIB = 1 << 30, 1 << 20


def timed_populate(monkeypatch, mm, path, start, total, chunk, done, finished_at, fail_at=None):
    """A Populator over ``total`` bytes at ``start`` (nothing faulted: prefault is a
    stand-in) on a clock of its own: chunk ``i`` finishes at ``finished_at[i]`` s,
    the populate begins at 50 s; the chunk at ``fail_at`` raises ENOMEM instead."""
    clock = [50.0]
    monkeypatch.setattr(populate, "time", type("Clock", (), {"monotonic": lambda: clock[0]}))
    monkeypatch.setattr(populate, "POPULATE_CHUNK", chunk)
    p = Populator(mm, start, start + total, 1, path, done=done)
    offsets = [o for o, _ in p._chunks]

    def faulted(_mm, _base, offset, size, _path):
        if offset == fail_at:
            raise OSError(errno.ENOMEM, f"pre-faulting {_path}: {os.strerror(errno.ENOMEM)}")
        clock[0] = finished_at[offsets.index(offset)]

    monkeypatch.setattr(populate, "prefault", faulted)
    return p


@pytest.mark.parametrize(
    "done,finished_at,expected",
    [
        pytest.param(  # 4.5 GiB in 5 chunks: its end at INFO; a line every 0.25 s
            0, [50.1, 50.25, 50.4, 50.6, 50.8], [
                (logging.INFO, "pre-faulted 44% (2.0 of 4.5 GiB) at 8.00 GiB/s, ETA 0.3 s"),
                (logging.INFO, "pre-faulted 88% (4.0 of 4.5 GiB) at 6.67 GiB/s, ETA 0.1 s"),
                (logging.INFO, "pre-faulted 4.5 GiB in 0.80 s (5.63 GiB/s, 1 thread(s))"),
            ], id="five-chunks",
        ),
        pytest.param(  # resumed after its first 1.5 GiB: the rate counts what this run faulted
            3 * GIB // 2, [50.5, 50.75, 51.0], [
                (logging.INFO, "pre-faulted 55% (2.5 of 4.5 GiB) at 2.00 GiB/s, ETA 1.0 s"),
                (logging.INFO, "pre-faulted 77% (3.5 of 4.5 GiB) at 2.67 GiB/s, ETA 0.4 s"),
                (logging.DEBUG, "pre-faulted 4.5 GiB in 1.00 s (3.00 GiB/s, 1 thread(s))"),
            ], id="resumed-three-chunks",
        ),
    ],
)  # fmt: skip
def test_progress_and_end_lines_carry_the_sizes_rate_and_times_of_the_populate(
    mapping, monkeypatch, caplog, done, finished_at, expected
):
    _, mm, path = mapping
    monkeypatch.setattr(populate, "PROGRESS_EVERY_S", 0.25)
    p = timed_populate(monkeypatch, mm, path, 3 * MIB, 9 * GIB // 2, GIB, done, finished_at)
    with caplog.at_level(logging.DEBUG, logger=LOG):
        p.run()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG]
    assert lines == [(level, f"arena {path}: {line}") for level, line in expected]
    assert p.seconds == finished_at[-1] - 50.0
    assert arena_format.read_ready(mm, 5 * GIB) == 9 * GIB // 2


def test_a_failure_names_the_ready_and_whole_size_in_mib(mapping, monkeypatch, caplog):
    _, mm, path = mapping
    start = 3 * MIB
    p = timed_populate(monkeypatch, mm, path, start, 8 * MIB, MIB, 0, [50.0 + i for i in range(8)],
                       fail_at=start + 3 * MIB)  # fmt: skip
    with caplog.at_level(logging.ERROR, logger=LOG), pytest.raises(ArenaError):
        p.run()
    reason = f"[Errno {errno.ENOMEM}] pre-faulting {path}: {os.strerror(errno.ENOMEM)}"
    assert [r.getMessage() for r in caplog.records if r.name == LOG] == [
        f"arena {path}: populate stopped at 3 of 8 MiB ({reason}); only the ready part is used"
    ]
    assert arena_format.read_ready(mm, 8 * MIB) == 3 * MIB
