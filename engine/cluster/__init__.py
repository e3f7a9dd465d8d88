"""The cluster tier: a second tier behind the arena on Mooncake Store, so any
instance finds any item encoded anywhere, without a coordinator.

* :mod:`.value`: an item's bytes in the store (header: dtype, shape, MAC).
* :mod:`.store`: one Mooncake Store client, connected in the background, every
  call bounded by a timeout.
* :mod:`.tier`: :class:`~.tier.ClusterTier` over an arena and its catalog:
  batched lookup, fetch into reserved extents, asynchronous publish.
* :mod:`.master`: starting a ``mooncake_master`` for tests and trials.

Mooncake is an optional dependency (``pip install ecoffload[cluster]``):
importing this package works without it; creating a client raises
:class:`~ecoffload.engine.base.errors.ClusterNotInstalledError`.
"""
