"""Which items an arena holds and where: the extent allocator, the in-process
``Catalog``, what every catalog promises (``protocol.py``), and in :mod:`.shared` the
catalog kept in the arena file for every process of a host.

Imports :mod:`..base` and, for the shared catalog's process lock, :mod:`..arena`.
"""
