"""The catalog in the arena file (``SharedCatalog``): crash-consistent words under a
robust process-shared mutex, read by every process of a host.

``catalog.py`` the class and its updates (reserve, commit, abort, lookup, evict);
``state.py`` what its parts share; ``format.py`` the word layout; ``lock.py`` the one
lock protocol; ``region.py`` opening and formatting the region; ``reads.py``,
``pins.py``, ``lru.py``, ``extents.py`` (the free-extent allocator); ``recovery.py``
(recover, reap), ``verify.py`` (a warm start's checks) and ``check.py`` (invariants);
``native.py`` and ``native.c`` the hits, pins and unpins in C; ``robust_mutex.py``
the mutex; ``fault_points.py`` the test hooks inside updates.
"""
