"""Read-only views of arena files for operators: what is there, who holds it, is it sound.

Nothing here changes an arena or takes its lock:

* :func:`arena_paths`, :func:`summarize`, :func:`holders` read the header
  and the catalog's counters (a value may be one update old) and find
  holders in ``/proc`` (every process with the file open or mapped, by
  device and inode).
* :meth:`CatalogSnapshot.take` copies the catalog's metadata region through
  a read-only mapping until two copies in a row are equal (no update ran in
  between), or marks the last copy not consistent after a bound; everything
  else works on the copy: items by state, pins and their owners, LRU ages,
  producers, free extents.
* :meth:`CatalogSnapshot.verify` runs what a warm restart of a persistent
  arena runs (``SharedCatalog`` open: recovery of a dirty catalog, release of
  dead processes' reservations and pins; ``verify``: the CRC-32 of every item
  that has one; ``check``: every invariant) on a private copy (a memfd) of the
  region, reading the arena's data area through a read-only mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from .arena import janitor
from .arena.format import (
    DEFAULT_DIR,
    HEADER_BYTES,
    KEY_OFFSET,
    MAGIC,
    PERSISTENT,
    SHARED_LIFETIME,
    check_arena_name,
    read_header,
    read_lifetime,
    read_ready,
)
from .base.errors import ArenaError
from .base.liveness import alive
from .catalog.shared.catalog import SharedCatalog
from .catalog.shared.format import (
    FREE,
    H_BLOCK_BYTES,
    H_FREE_BLOCKS,
    H_ITEMS,
    H_MAGIC,
    H_MAX_ITEMS,
    H_MAX_KEY,
    H_MAX_PINS,
    H_NUM_BLOCKS,
    H_READY_BLOCKS,
    H_READY_BYTES,
    H_READY_ITEMS,
    H_TICK,
    MUTEX_AT,
    P_COUNT,
    P_NEXT,
    P_PID,
    P_START,
    PIN_WORDS,
    READY,
    S_BLOCKS,
    S_EXT,
    S_KLEN,
    S_NBYTES,
    S_PID,
    S_PIN_HEAD,
    S_PINS,
    S_START,
    S_STATE,
    S_TICK,
    S_VERIFY,
    SLOT_WORDS,
    WRITING,
    Layout,
)
from .catalog.shared.format import (
    MAGIC as CATALOG_MAGIC,
)
from .catalog.shared.robust_mutex import init_mutex

STATE_NAMES = {WRITING: "writing", READY: "ready"}
_JANITOR_PROGRAM = os.path.abspath(janitor.__file__)  # its command line names this file


class ArenaNotFoundError(ArenaError):
    """No arena file by that name in that directory."""


@dataclass
class Holder:
    """A process that has an arena file open or mapped."""

    pid: int
    command: str


@dataclass
class ArenaSummary:
    """One arena file as :func:`summarize` reads it (the ``ecoffload arenas`` row)."""

    name: str
    path: str
    size_bytes: int
    block_bytes: int
    num_blocks: int
    layout_key: str
    format_version: int
    shared_lifetime: bool
    persistent: bool
    ready_fraction: float
    has_catalog: bool
    items: int | None  # every item, WRITING included (None: no catalog)
    items_ready: int | None
    bytes_used: int | None  # bytes of the READY items
    blocks_free: int | None
    creator_pid: int
    creator_alive: bool
    holders: list[Holder] = field(default_factory=list)
    janitor_pid: int | None = None  # waits to remove a non-persistent arena after its holders

    def to_dict(self) -> dict:
        return asdict(self)


def arena_paths(directory: str = DEFAULT_DIR) -> list[str]:
    """Regular files in ``directory`` that start with the arena magic, by name."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                with open(entry.path, "rb") as f:
                    if f.read(len(MAGIC)) == MAGIC:
                        found.append(entry.path)
            except OSError:
                continue  # another user's file, or gone meanwhile
    return sorted(found)


def arena_path(name: str, directory: str = DEFAULT_DIR) -> str:
    """The path of arena ``name`` in ``directory`` (ArenaNotFoundError if it is not one)."""
    path = os.path.join(directory, check_arena_name(name))
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
    except FileNotFoundError:
        raise ArenaNotFoundError(
            f"expected an arena file {path}, found none: list them with `ecoffload arenas "
            f"{directory}`"
        ) from None
    if magic != MAGIC:
        raise ArenaNotFoundError(f"expected an arena file at {path}, found another file")
    return path


def holders(path: str) -> list[Holder]:
    """Every live process that has ``path`` open or mapped (from ``/proc``), by pid; the
    arena's janitor (:mod:`.arena.janitor`, which only waits for the last holder) not included."""
    return [h for h in _openers(path) if not _is_janitor(h)]


def janitor_pid(path: str) -> int | None:
    """The pid of the janitor waiting to remove ``path`` (non-persistent arenas), if any."""
    return next((h.pid for h in _openers(path) if _is_janitor(h)), None)


def _openers(path: str) -> list[Holder]:
    st = os.stat(path)
    want_fd = (st.st_dev, st.st_ino)
    want_map = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        if _holds_fd(entry, want_fd) or _maps(entry, want_map):
            found.append(Holder(int(entry), _command(entry)))
    return found


def _is_janitor(holder: Holder) -> bool:
    return _JANITOR_PROGRAM in holder.command.split(" ")


def _holds_fd(pid: str, want: tuple[int, int]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == want:
            return True
    return False


def _maps(pid: str, want: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any(want in line for line in maps)
    except OSError:
        return False


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def summarize(path: str) -> ArenaSummary:
    """The header, the catalog's counters (no lock: a value may be one update old) and
    the holders of the arena file ``path``."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
        header = read_header(raw)
        lifetime = read_lifetime(raw)
        meta = f.read(8 * 32) if header.data_offset > HEADER_BYTES else b""
    data_bytes = header.block_bytes * header.num_blocks
    key = raw[KEY_OFFSET : KEY_OFFSET + header.key_len].decode(errors="replace")
    words = np.frombuffer(meta, dtype="<i8") if len(meta) == 8 * 32 else None
    if words is not None and int(words[H_MAGIC]) != CATALOG_MAGIC:
        words = None
    has_catalog = words is not None
    return ArenaSummary(
        name=os.path.basename(path),
        path=path,
        size_bytes=os.stat(path).st_size,
        block_bytes=header.block_bytes,
        num_blocks=header.num_blocks,
        layout_key=key,
        format_version=header.version,
        shared_lifetime=bool(lifetime & SHARED_LIFETIME),
        persistent=bool(lifetime & PERSISTENT),
        ready_fraction=read_ready(raw, data_bytes) / data_bytes if data_bytes else 1.0,
        has_catalog=has_catalog,
        items=int(words[H_ITEMS]) if words is not None else None,
        items_ready=int(words[H_READY_ITEMS]) if words is not None else None,
        bytes_used=int(words[H_READY_BYTES]) if words is not None else None,
        blocks_free=int(words[H_FREE_BLOCKS]) if words is not None else None,
        creator_pid=header.creator_pid,
        creator_alive=alive(header.creator_pid, header.creator_start),
        holders=holders(path),
        janitor_pid=janitor_pid(path),
    )


@dataclass
class Pin:
    """One process's pins of one item."""

    pid: int
    start_time: int
    count: int
    alive: bool


@dataclass
class ItemView:
    """One item of a catalog snapshot."""

    key: str
    state: str  # "writing" or "ready"
    nbytes: int
    blocks: int
    pins: int
    lru_age: int  # catalog operations since the item was last used (its LRU position)
    producer_pid: int
    producer_alive: bool
    pinned_by: list[Pin] = field(default_factory=list)


class CatalogSnapshot:
    """A copy of an arena's catalog region, taken without its lock; everything else is
    read from the copy."""

    def __init__(self, path: str, region: bytes, *, consistent: bool) -> None:
        self.path, self.region = path, region
        self.consistent = consistent  # two equal copies in a row: no update ran meanwhile
        words = np.frombuffer(region, dtype="<i8")
        self._words = words
        fields = (H_NUM_BLOCKS, H_BLOCK_BYTES, H_MAX_ITEMS, H_MAX_KEY, H_MAX_PINS)
        self.layout = Layout(*(int(words[i]) for i in fields))

    @classmethod
    def take(cls, path: str, *, timeout_s: float = 2.0) -> CatalogSnapshot:
        """Copy the catalog region of arena file ``path``, never taking its lock.

        Two consecutive copies that are byte for byte equal saw no update (every
        update moves a counter or the LRU tick), so the copy is consistent; an
        update stopped half-way (its process dead or stopped) leaves ``dirty``
        set in both, and opening the copy recovers it as the next locker would.
        On an arena that changes faster than a copy for ``timeout_s``, the last
        copy is kept and :attr:`consistent` is False (it may be torn).
        """
        with open(path, "rb") as f:
            header = read_header(f.read(HEADER_BYTES))
            size = header.data_offset - HEADER_BYTES
            if size <= 0:
                raise ArenaError(f"arena {path} has no catalog region (made by Arena.create)")
            mm = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ, offset=HEADER_BYTES)
        try:
            if np.frombuffer(mm, dtype="<i8", count=1)[0] != CATALOG_MAGIC:
                raise ArenaError(f"arena {path}: its catalog region is not formatted yet")
            deadline = time.monotonic() + timeout_s
            previous = mm[:size]
            while time.monotonic() < deadline:
                current = mm[:size]
                if current == previous:
                    return cls(path, current, consistent=True)
                previous = current
        finally:
            mm.close()
        return cls(path, previous, consistent=False)

    def items(self) -> list[ItemView]:
        """Every WRITING, READY or UNVERIFIED item (READY, not checked since a warm start),
        in slot order."""
        w, lay = self._words, self.layout
        sl, pn, keys_at = lay.slots_at // 8, lay.pins_at // 8, lay.keys_at
        tick, cache = int(w[H_TICK]), {}
        found = []
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            state = int(w[b + S_STATE])
            if state == FREE:
                continue
            at = keys_at + s * lay.max_key_bytes
            key = self.region[at : at + int(w[b + S_KLEN])].decode(errors="replace")
            pins, r = [], int(w[b + S_PIN_HEAD])
            while r >= 0 and len(pins) < lay.max_pins:  # bounded: a torn chain ends
                p = pn + r * PIN_WORDS
                pid, start = int(w[p + P_PID]), int(w[p + P_START])
                pins.append(Pin(pid, start, int(w[p + P_COUNT]), alive(pid, start, cache)))
                r = int(w[p + P_NEXT])
            pid, start = int(w[b + S_PID]), int(w[b + S_START])
            name = STATE_NAMES.get(state, str(state))
            if state == READY and w[b + S_VERIFY]:  # since a warm start: a miss until checked
                name = "unverified"
            found.append(ItemView(
                key=key, state=name, nbytes=int(w[b + S_NBYTES]),
                blocks=int(w[b + S_BLOCKS]), pins=int(w[b + S_PINS]),
                lru_age=tick - int(w[b + S_TICK]), producer_pid=pid,
                producer_alive=alive(pid, start, cache), pinned_by=pins,
            ))  # fmt: skip
        return found

    def free_extents(self) -> list[tuple[int, int]]:
        """(first block, blocks) of every free run below the ready watermark."""
        w, lay = self._words, self.layout
        n = lay.num_blocks
        per_block = np.frombuffer(self.region, dtype="<i4", count=2 * n, offset=lay.blocks_at)
        count, nxt = per_block[:n], per_block[n:]
        owned = np.zeros(n, dtype=bool)
        sl = lay.slots_at // 8
        for s in range(lay.max_items):
            b = sl + s * SLOT_WORDS
            if w[b + S_STATE] == FREE:
                continue
            e, hops = int(w[b + S_EXT]), 0
            while 0 <= e < n and hops < n:
                owned[e : e + int(count[e])] = True
                e, hops = int(nxt[e]), hops + 1
        free = ~owned[: int(w[H_READY_BLOCKS])]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0]))))
        return [(int(a), int(z - a)) for a, z in zip(edges[::2], edges[1::2], strict=True)]

    @contextlib.contextmanager
    def opened(self) -> Iterator[SharedCatalog]:
        """A :class:`SharedCatalog` over a private copy (a memfd) of the snapshot, opened
        as a restart opens one: a dirty catalog recovered, dead processes' reservations
        and pins released, in the copy only."""
        fd = os.memfd_create("ecoffload-snapshot", os.MFD_CLOEXEC)
        try:
            os.write(fd, self.region)
            with mmap.mmap(fd, len(self.region)) as mm:  # a fresh lock: the copy's was ours
                at = ctypes.c_char.from_buffer(mm, MUTEX_AT)
                init_mutex(ctypes.c_void_p(ctypes.addressof(at)), self.path + " (copy)")
                del at
            catalog = SharedCatalog(fd, 0, len(self.region), path=self.path + " (copy)")
            try:
                yield catalog
            finally:
                catalog.close()
        finally:
            os.close(fd)

    def check(self) -> str | None:
        """The catalog's ``check()`` (every invariant) once opened: None, or what fails."""
        with self.opened() as catalog:
            return _check(catalog)

    def verify(self) -> VerifyReport:
        """What a warm restart would do to this catalog (open, ``verify`` against the
        arena's data, ``check``), done to a private copy of it."""
        before = self.items()
        with self.opened() as catalog, _data_view(self.path) as data:
            after_open = {e.key for e in catalog.entries()}
            dropped = catalog.verify(data)
            kept = len(catalog)
            problem = _check(catalog)
        return VerifyReport(
            items_before=len(before),
            released_dead_reservations=sorted(i.key for i in before if i.key not in after_open),
            dropped_crc_mismatch=dropped,
            items_kept=kept,
            check_error=problem,
            consistent=self.consistent,
        )


def _check(catalog: SharedCatalog) -> str | None:
    try:
        catalog.check()
    except AssertionError as exc:
        return str(exc) or "an invariant does not hold"
    return None


@dataclass
class VerifyReport:
    """What :meth:`CatalogSnapshot.verify` found (nothing was changed in the arena)."""

    items_before: int
    released_dead_reservations: list[str]  # WRITING items of dead producers
    dropped_crc_mismatch: int
    items_kept: int
    check_error: str | None

    consistent: bool = True  # the copy was consistent (else the findings may be torn)

    @property
    def ok(self) -> bool:
        """Whether a warm restart would serve every READY item and the catalog is sound
        (on a consistent copy)."""
        return self.consistent and self.dropped_crc_mismatch == 0 and self.check_error is None


@contextlib.contextmanager
def _data_view(path: str) -> Iterator[memoryview]:
    """The arena's data area through a read-only mapping."""
    with open(path, "rb") as f:
        header = read_header(f.read(HEADER_BYTES))
        nbytes = header.block_bytes * header.num_blocks
        mm = mmap.mmap(f.fileno(), header.data_offset + nbytes, prot=mmap.PROT_READ)
    view = memoryview(mm)[header.data_offset :]
    try:
        yield view
    finally:
        view.release()
        mm.close()
