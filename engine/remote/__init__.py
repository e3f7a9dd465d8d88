"""Items between hosts: ``ArenaPeer`` (``peer.py``: NIXL reads between arenas, no
listener), where UCX listens (``nixl_setup.py``), the export window that is the only
memory a producer registers (``export_window.py``), extents cut into byte pieces.

Imports :mod:`..base` and :mod:`..catalog` (extents).
"""
