"""The arena: one ``/dev/shm`` file of fixed-size blocks shared by a host's processes.

``arena.py`` (``Arena``: create, attach, close, the host tensor), ``format.py`` (the
header, the layout key, name rules; no torch), ``lifetime.py`` (a shared name lives
while any process holds it), ``populate.py`` (pre-faulting, the ready prefix),
``registration.py`` and ``cuda_host.py`` (CUDA host registration, the device alias),
``janitor.py`` (the process that removes a shared arena's name after its last holder).
Imports only :mod:`..base`.
"""
