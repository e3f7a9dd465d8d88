"""Exception types of the engine.

Every message says what was expected, what was found and what to do about it.
All inherit from :class:`ECOffloadError`, so callers can catch the family.
"""

from __future__ import annotations


class ECOffloadError(Exception):
    """Base class of every error ecoffload raises on purpose."""


class ConfigError(ECOffloadError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class ArenaError(ECOffloadError):
    """The shared-memory arena could not be created, attached or used."""


class ArenaExistsError(ArenaError, FileExistsError):
    """`create` found a file already at the arena's path."""


class ArenaAttachTimeout(ArenaError, TimeoutError):
    """`attach` gave up waiting for the creator to publish a valid header."""


class ArenaStaleError(ArenaError):
    """The arena file's creator died before every process attached: nobody owns it."""

    def __init__(self, path: str, inode: int, pid: int) -> None:
        self.path, self.inode, self.pid = path, inode, pid
        super().__init__(
            f"arena {path} was created by process {pid}, which is gone: the file is stale. "
            "Remove it (Arena.create_or_attach and the vLLM connector reclaim it themselves)"
        )


class ArenaLayoutMismatch(ArenaError):
    """An existing arena's header disagrees with what this process expects."""

    def __init__(self, path: str, field: str, expected: object, found: object) -> None:
        self.path, self.field, self.expected, self.found = path, field, expected, found
        super().__init__(
            f"arena {path}: header field {field!r} is {found!r}, expected {expected!r}. "
            "Another model, dtype, block size or ecoffload version created it: use another "
            "arena name, or stop the processes using it and remove the file."
        )


class CatalogLockError(ArenaError):
    """The shared catalog's lock cannot be taken: left unrecoverable, taken twice by
    one thread, or not available from the C library. Not a :class:`CatalogError`:
    it is no race with another process, and retrying does not help."""


class CatalogError(ECOffloadError):
    """A catalog operation was asked of a key in the wrong state."""


class InvalidSizeError(CatalogError, ValueError):
    """A byte size is zero, negative or not an integer."""


class ItemTooLargeError(CatalogError, ValueError):
    """An item needs more blocks than the whole arena has."""


class CatalogCapacityError(CatalogError, ValueError):
    """A fixed-size table of the shared catalog (key length, dims, pin records) is too small."""


class DuplicateItemError(CatalogError, KeyError):
    """`reserve` was asked for a key that the catalog already holds."""


class UnknownItemError(CatalogError, KeyError):
    """An operation named a key that the catalog does not hold."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ItemStateError(CatalogError):
    """An operation is not allowed in the item's current state or pin count."""


class CatalogCorruptError(CatalogError):
    """A shared catalog word read under the lock is impossible (an index past its table,
    a list that cycles): never followed; the catalog was rebuilt from its slot table
    before this was raised, so the operation can be retried."""


class RemoteError(ECOffloadError):
    """A transfer between hosts' arenas (NIXL) could not be set up or asked for."""


class NixlNotInstalledError(RemoteError, ImportError):
    """The NIXL Python package is not importable."""


class RemotePeerError(RemoteError):
    """A remote arena peer is unknown, unreachable or sent unusable metadata."""


class RemoteExtentError(RemoteError, ValueError):
    """Extents given to a remote read do not fit the arenas or the item sizes."""


class ClusterError(ECOffloadError):
    """The cluster tier (Mooncake Store) is missing, misconfigured or refused a value."""


class ClusterNotInstalledError(ClusterError, ImportError):
    """The cluster tier's store client (Mooncake) cannot be imported."""
