"""A step's block tables as two int64 arrays: what the planner's C pass reads directly.

Layout (the way vLLM's kv_offload passes block ids: numpy, not Python objects)::

    extents [E, 2]   int64 (start, count) of every item's extents, item after item,
                     each item's in stream order
    bounds  [N + 1]  int64 item i's extents are extents[bounds[i] : bounds[i + 1]];
                     bounds[0] == 0, bounds[N] == E

The planner's C pass reads both through the buffer protocol (no Python object
per extent); without it, the numpy pass plans the same arrays. A step table
pickles as two buffers, which is how the connector's metadata carries it
from the scheduler to the workers.

It is the one block-table type past the catalogs: the engine hands its mover a step
table for every step. A step of a few extents, or one planned once in this process (a
save's fresh reservations), may keep its per-item pairs instead
(:meth:`StepTable.of_pairs`): the C pass reads them in less time than making arrays
of them takes, and the arrays are made on first use, from pairs of integers only.

It is also a read-only sequence of per-item tables (``table[i]``: a list of
``(start, count)`` tuples), so code that walks tables one item at a time (the
reference copy, the loop planner naming a fault, a CRC) takes it unchanged.

Whatever makes one (the constructor, :meth:`StepTable._made`, unpickling) checks
the arrays (:func:`step_arrays`), and the planner checks them again (they are
mutable): a table whose bounds do not cut its extents into items, one after
another, is refused with :class:`PlanError`, never planned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, chain
from operator import index
from typing import Any

import numpy as np

from . import native


class PlanError(ValueError):
    """A block table or item layout cannot be copied as given (``plan.PlanError``)."""


def step_arrays(extents: object, bounds: object) -> tuple[np.ndarray, np.ndarray]:
    """``extents`` and ``bounds`` as int64 arrays of a step table, read through the buffer
    protocol by the rules of the planner's C pass (so both passes accept the same
    arrays): C-contiguous native int64, extents ``[E, 2]``, bounds ``[N + 1]`` running
    from 0 to E without going down. Raises PlanError naming what is wrong."""
    c_pass = native.planner()  # the same rules in C, for the usual arrays:
    if (
        c_pass is not None and type(extents) is np.ndarray and type(bounds) is np.ndarray
        and c_pass.check_step(extents, bounds) == -1
    ):  # fmt: skip
        return extents, bounds
    views: list[np.ndarray] = []
    for name, array, ndim in (("extents", extents, 2), ("bounds", bounds, 1)):
        try:
            view = memoryview(array)  # pyright: ignore[reportArgumentType]  (refused below)
        except TypeError:
            view = None
        fmt = "" if view is None else view.format
        fmt = fmt[1:] if fmt[:1] in ("@", "=") else fmt
        shaped = (
            view is not None
            and view.ndim == ndim
            and (ndim == 1 or tuple(view.shape or ())[1:] == (2,))
        )
        if (
            view is None or not shaped or view.itemsize != 8 or fmt not in ("q", "l")
            or not view.c_contiguous
        ):  # fmt: skip
            raise PlanError(
                f"a step table's {name} must be a C-contiguous native int64 array of shape "
                f"{'[E, 2]' if ndim == 2 else '[N + 1]'}, got {type(array).__name__} "
                + ("" if view is None else f"{view.format!r} {view.shape}")
                + ": make it with StepTable(extents, bounds) or StepTable.from_tables"
            )
        views.append(array if type(array) is np.ndarray else np.asarray(view, np.int64))
    extents, bounds = views
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(extents):
        raise PlanError(
            f"bounds must run from 0 to the {len(extents)} extents given, one entry per "
            f"item plus one; got {bounds[:3].tolist()}...{bounds[-3:].tolist()}"
        )
    if len(bounds) > 2 and (bounds[1:] < bounds[:-1]).any():
        at = int(np.flatnonzero(bounds[1:] < bounds[:-1])[0])
        raise PlanError(
            f"bounds must not go down (item i's extents are extents[bounds[i]:bounds[i + 1]]); "
            f"got bounds[{at}] = {bounds[at]} > bounds[{at + 1}] = {bounds[at + 1]}"
        )
    return extents, bounds


def pair_of_integers(item: int, extent: Any) -> tuple[int, int]:  # Any: whatever a table holds
    """``extent`` as a ``(start, count)`` pair of Python ints (anything ``operator.index``
    takes: ints, numpy integers); PlanError naming the item and the extent otherwise."""
    try:
        start, count = map(index, extent)
    except (TypeError, ValueError):  # not a pair, or not of integers
        raise PlanError(
            f"item {item}: extent {extent!r} is not a (start, count) pair of integers; "
            "block tables must come from this arena's allocator"
        ) from None
    return start, count


class StepTable(Sequence):
    """Block tables of the items of one step (see the module docstring).

    Made from arrays (the constructor, :meth:`from_tables`, :meth:`of_entries`,
    unpickling), or over per-item tables of pairs kept as given (:meth:`of_pairs`):
    the planner's C pass reads those pairs directly, and the arrays are made only when
    something asks for them (``extents``, ``bounds``, pickling, :meth:`check`).
    """

    __slots__ = ("_bounds", "_extents", "pairs")

    # Per-item tables of pairs, for a table made by of_pairs until its arrays are made;
    # None once the arrays are what the table holds.
    pairs: Sequence[Extents] | None

    def __init__(self, extents: np.ndarray, bounds: np.ndarray) -> None:
        extents = np.ascontiguousarray(extents, dtype=np.int64).reshape(-1, 2)
        bounds = np.ascontiguousarray(bounds, dtype=np.int64).reshape(-1)
        step_arrays(extents, bounds)
        self._extents, self._bounds, self.pairs = extents, bounds, None

    @classmethod
    def of_pairs(cls, tables: Sequence[Extents]) -> StepTable:
        """The step table of per-item tables of ``(start, count)`` pairs, kept as given
        (not copied, not checked until planned: the planner checks every pair). For a
        step planned once in this process, such as a save's fresh reservations: the C
        pass reads a few pairs in less time than making arrays of them takes."""
        if type(tables) is not list:
            try:
                tables = list(tables)
            except TypeError:
                raise PlanError(
                    f"block tables must be a sequence of per-item tables of (start, count) "
                    f"pairs, got {type(tables).__name__}"
                ) from None
        table = _new(cls)  # object.__new__ itself: of_pairs runs on every small step
        table._extents = table._bounds = None
        table.pairs = tables
        return table

    @classmethod
    def from_tables(cls, tables: Iterable[Sequence[tuple[int, int]]]) -> StepTable:
        """The step table of per-item tables of ``(start, count)`` pairs, as arrays made
        now (at the boundary with code that holds extents as pairs: one pass, no
        intermediate list)."""
        tables = tables if isinstance(tables, list | tuple) else list(tables)
        if not tables:
            return cls._made(_NO_EXTENTS, _NO_BOUNDS)
        bounds = [0, *accumulate(map(len, tables))]
        flat = chain.from_iterable(chain.from_iterable(tables))
        # fromiter with its count: one allocation, no list of Python ints in between.
        try:
            extents = np.fromiter(flat, np.int64, count=2 * bounds[-1]).reshape(-1, 2)
        except (OverflowError, TypeError, ValueError) as e:
            raise PlanError(f"block tables must hold (start, count) pairs of int64s: {e}") from e
        return cls._made(extents, np.array(bounds, np.int64))

    @classmethod
    def _made(cls, extents: np.ndarray, bounds: np.ndarray) -> StepTable:
        """One from arrays made here (checked all the same: a few microseconds)."""
        step_arrays(extents, bounds)
        table = cls.__new__(cls)
        table._extents, table._bounds, table.pairs = extents, bounds, None
        return table

    @classmethod
    def of_entries(cls, entries: Sequence) -> StepTable:
        """The step table of catalog entries (anything with an int64 [k, 2]
        ``extent_array``: each entry makes its array once, so a step costs one
        concatenation, whatever its extents)."""
        if not entries:
            return cls._made(_NO_EXTENTS, _NO_BOUNDS)
        arrays = [e.extent_array for e in entries]
        bounds = np.array([0, *accumulate(map(len, arrays))], np.int64)
        return cls._made(np.concatenate(arrays), bounds)

    @classmethod
    def concat(cls, tables: Sequence[StepTable]) -> StepTable:
        """One step table holding the items of ``tables``, in order."""
        if not tables:
            return cls(np.empty((0, 2), np.int64), np.zeros(1, np.int64))
        starts = np.cumsum([0] + [len(t.extents) for t in tables[:-1]])
        bounds = np.concatenate(
            [[0]] + [t.bounds[1:] + at for t, at in zip(tables, starts, strict=True)]
        )
        return cls(np.concatenate([t.extents for t in tables]), bounds)

    @property
    def extents(self) -> np.ndarray:
        """int64 [E, 2]: every item's extents, item after item."""
        if self.pairs is not None:
            self._make_arrays()
        return self._extents  # pyright: ignore[reportReturnType]  (made above)

    @extents.setter
    def extents(self, extents: np.ndarray) -> None:
        self._hold_arrays()
        self._extents = extents

    @property
    def bounds(self) -> np.ndarray:
        """int64 [N + 1]: item i's extents are ``extents[bounds[i] : bounds[i + 1]]``."""
        if self.pairs is not None:
            self._make_arrays()
        return self._bounds  # pyright: ignore[reportReturnType]  (made above)

    @bounds.setter
    def bounds(self, bounds: np.ndarray) -> None:
        self._hold_arrays()
        self._bounds = bounds

    def _hold_arrays(self) -> None:
        """Before one array is set: the table holds arrays from now on (a table of pairs
        makes both first, so the other stays its items'; one made by ``__new__`` has
        neither yet)."""
        if getattr(self, "pairs", None) is not None:
            self._make_arrays()
        self.pairs = None

    def _make_arrays(self) -> None:
        """The pairs as arrays, which the table holds from now on. Each pair is read as
        two integers first (pairs given to :meth:`of_pairs` may come from anywhere: a
        float or a string is not truncated or parsed, a triple not re-cut into pairs);
        PlanError names the first that is not."""
        assert self.pairs is not None, "a table of pairs"
        checked = []
        for item, table in enumerate(self.pairs):
            try:
                extents = iter(table)
            except TypeError:
                raise PlanError(
                    f"item {item}: its block table is a {type(table).__name__}, not a "
                    "sequence of (start, count) pairs"
                ) from None
            checked.append([pair_of_integers(item, extent) for extent in extents])
        made = StepTable.from_tables(checked)
        self._extents, self._bounds, self.pairs = made._extents, made._bounds, None

    def select(self, items: Sequence[int]) -> StepTable:
        """The step table of the given items, in the given order (array slices, or the
        items' pairs, no Python object per extent)."""
        if list(items) == list(range(len(self))):
            return self
        if self.pairs is not None:
            pairs = self.pairs
            return StepTable.of_pairs([pairs[i] for i in items])
        lo, hi = self.bounds[:-1], self.bounds[1:]
        picked = [self.extents[lo[i] : hi[i]] for i in items]
        bounds = np.zeros(len(picked) + 1, np.int64)
        np.cumsum([len(p) for p in picked], out=bounds[1:])
        extents = np.concatenate(picked) if picked else np.empty((0, 2), np.int64)
        return StepTable._made(extents, bounds)

    def check(self, num_blocks: int) -> None:
        """Raise PlanError unless the arrays are a step table's and every extent lies inside
        an arena of ``num_blocks`` blocks: what a worker checks of the tables it receives,
        before any copy (one pass over the arrays, in the planner's C pass where built)."""
        c_pass = native.planner()
        bad = c_pass.check_step(self.extents, self.bounds, num_blocks) if c_pass else None
        if bad is None:  # no C pass, or arrays it cannot read: numpy, naming what is wrong
            extents, _ = step_arrays(self.extents, self.bounds)
            starts, counts = extents[:, 0], extents[:, 1]
            outside = (starts < 0) | (starts >= num_blocks) | (counts <= 0)
            outside |= counts > num_blocks - starts
            bad = int(np.argmax(outside)) if outside.any() else -1
        if bad >= 0:
            raise PlanError(
                f"extent {bad} {tuple(self.extents[bad].tolist())} of a step table is not "
                f"inside the arena's blocks [0, {num_blocks}): block tables must come from "
                "this arena's catalog"
            )

    def extents_of(self, item: int) -> np.ndarray:
        """int64 [k, 2]: item ``item``'s extents (a view; a table of pairs makes its
        arrays first: read ``pairs[item]`` to keep them)."""
        return self.extents[self.bounds[item] : self.bounds[item + 1]]

    @property
    def num_extents(self) -> int:
        if self.pairs is not None:
            return sum(map(len, self.pairs))
        return len(self.extents)

    def __len__(self) -> int:
        if self.pairs is not None:
            return len(self.pairs)
        return len(self.bounds) - 1

    def __getitem__(self, item):
        if isinstance(item, slice):
            return [self[i] for i in range(*item.indices(len(self)))]
        if item < 0:
            item += len(self)
        if not 0 <= item < len(self):
            raise IndexError(f"item {item} of a step table of {len(self)} items")
        if self.pairs is not None:  # as given: the planner checks each pair it plans
            return list(self.pairs[item])
        return list(map(tuple, self.extents_of(item).tolist()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepTable):
            return NotImplemented
        try:
            return np.array_equal(self.extents, other.extents) and np.array_equal(
                self.bounds, other.bounds
            )
        except PlanError:  # pairs that are no table equal no table
            return False

    __hash__ = None  # pyright: ignore[reportAssignmentType]  (mutable arrays inside)

    def __getstate__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.extents, self.bounds

    def __setstate__(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        # A pickle is data from another process (the scheduler's metadata): checked.
        try:
            extents, bounds = state
        except (TypeError, ValueError):
            raise PlanError(
                f"a pickled StepTable holds (extents, bounds), got {type(state).__name__}"
            ) from None
        self._extents, self._bounds = step_arrays(extents, bounds)
        self.pairs = None

    def __repr__(self) -> str:
        try:
            extents = f"{self.num_extents} extents"
        except TypeError:  # pairs that are no table
            extents = "pairs that are no table"
        return f"StepTable({len(self)} items, {extents})"


_new = object.__new__
_NO_EXTENTS = np.empty((0, 2), np.int64)
_NO_BOUNDS = np.zeros(1, np.int64)
_NO_EXTENTS.flags.writeable = _NO_BOUNDS.flags.writeable = False  # shared by every empty table


Extents = Sequence[tuple[int, int]]  # one item's block table: (start block, count) runs
Tables = Sequence[Extents] | StepTable  # a step's tables: one per item, or one StepTable
