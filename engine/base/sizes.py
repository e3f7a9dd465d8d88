"""Byte-size values: parse "8GiB"-style strings and validate sizes."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """An int number of bytes from an int or a string such as "8GiB", "512 MiB", "1.5GB".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB, TB, or K, M, G, T) powers of 1000. The result must be a positive int.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte count such as 8589934592 or '8GiB', got a bool")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise ConfigError(
                f"{name}: cannot read {value!r} as a byte size; write an integer number of "
                "bytes or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        exact = float(match.group(1)) * unit
        nbytes = int(exact)
        if nbytes != exact:
            raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
    else:
        raise ConfigError(
            f"{name}: expected an int or a string such as '8GiB', got {type(value).__name__}"
        )
    if nbytes <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size, e.g. 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
