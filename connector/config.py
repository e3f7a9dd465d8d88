"""The connector's ``ec_connector_extra_config``: keys, defaults, validation.

Every key is checked when the connector starts, so a typo or a bad value stops
vLLM at start-up with a message instead of failing a request later.

| key | default | meaning |
|---|---|---|
| ``arena_bytes`` | ``"4GiB"`` | arena size, a multiple of 4 KiB (rounded down to whole blocks) |
| ``block_bytes`` | ``"64KiB"`` | block size, a multiple of 4 KiB |
| ``arena_dir`` | ``"/dev/shm"`` | directory of the arena file (must exist) |
| ``arena_name`` | ``"ecoffload-<hash>"`` | file name; every instance (and DP rank) on the |
|  |  | host giving the same name shares one cache; the default hashes the model and |
|  |  | dtype, so instances of one model share and other models never meet |
| ``persistent`` | ``false`` | keep the arena file after the last instance exits: a restart |
|  |  | finds its items (validated) instead of starting cold |
| ``num_programs`` | kernel defaults (8 save, 16 load) | persistent programs per launch |
| ``populate`` | ``"background"`` | ``"background"``: serve at once, blocks usable as pre-faulted; |
|  |  | ``"eager"``: pre-fault (and register) all before start-up; ``"lazy"``: no pre-fault |
| ``nixl`` | ``None`` (off) | pull items between hosts' arenas (:mod:`.remote_pull`): a dict of |
|  |  | :data:`NIXL_DEFAULTS` keys; ``{}`` takes every default. Off: nixl is never imported |
| ``cluster`` | ``None`` (off) | the cluster tier on Mooncake Store (``engine/cluster/``): a |
|  |  | dict of :data:`CLUSTER_DEFAULTS` keys; ``master`` and ``metadata`` are required |

``nixl`` keys: ``host`` (this host's address on the network the other hosts
reach: NIXL's transport, UCX, uses only the interface that has it and listens
on that address alone; default: the outward interface; ``"*"``: every
interface), ``tcp_port_range`` (``[first, last]``: the port UCX's TCP listener
takes, for a firewall rule; default: any the OS picks), ``window_bytes``
(producer: the export window announced items are copied into, the only memory
consumers can read; an item that does not fit is not announced),
``backends`` (NIXL backends, ``["UCX"]``), ``lease_s`` (producer: how long an
announced item stays in the window without a consumer's notification),
``timeout_s`` (consumer: bound on one pull; past it the request's items are
encoded locally). No NIXL listener runs (the old ``listen_port`` is refused):
the producer's metadata travels inside ``ec_transfer_params``; README
"Security" says who can reach what.

``cluster`` keys: ``master`` (``"host:port"`` of the ``mooncake_master`` RPC
service), ``metadata`` (its metadata server, ``"http://host:port/metadata"``),
``host`` (this host's address, where other instances fetch the values its
segment holds; default: the outward interface), ``protocol`` (``"tcp"``: the
only transport that needs no registered memory, see README), ``segment_bytes``
(memory this instance gives the store, beside its arena), ``key_file`` (a file
holding the cluster key: values carry a MAC and only values that verify are
served; ``null``: no MAC, README says what that allows), ``fetch_timeout_s``
(bound on one fetch; past it the items are encoded locally), ``publish``
(publish saved items), ``publish_queue`` (items waiting to be published; more
are dropped and counted).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.arena.format import POPULATE_MODES, PopulateMode, check_arena_name
from ..engine.base.errors import ArenaError, ClusterError, ConfigError
from ..engine.base.sizes import parse_bytes
from ..engine.cluster.value import key_file_exposure, load_key

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "arena_bytes": "4GiB",
    "block_bytes": "64KiB",
    "arena_dir": "/dev/shm",
    "arena_name": None,
    "num_programs": None,
    "populate": "background",
    "persistent": False,
    "nixl": None,
    "cluster": None,
}
NIXL_DEFAULTS: dict[str, Any] = {
    "host": None,
    "tcp_port_range": None,
    "window_bytes": "256MiB",
    "backends": ["UCX"],
    "lease_s": 30.0,
    "timeout_s": 30.0,
}


@dataclass(frozen=True)
class NixlConfig:
    """The ``nixl`` key: see the module docstring."""

    host: str | None = None
    tcp_port_range: tuple[int, int] | None = None
    window_bytes: int = 256 << 20
    backends: tuple[str, ...] = ("UCX",)
    lease_s: float = 30.0
    timeout_s: float = 30.0

    @classmethod
    def from_value(cls, value: Any) -> NixlConfig | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"nixl must be a dict of {sorted(NIXL_DEFAULTS)} (or null to disable), "
                f"got {type(value).__name__} {value!r}"
            )
        if "listen_port" in value:
            raise ConfigError(
                "nixl.listen_port is gone: no NIXL listener runs any more (the producer's "
                "metadata travels inside ec_transfer_params); remove it, and open "
                'nixl.tcp_port_range on the producer instead (README "Security")'
            )
        unknown = sorted(set(value) - set(NIXL_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"unknown nixl key(s) {unknown}; nixl accepts {sorted(NIXL_DEFAULTS)}"
            )
        v = {**NIXL_DEFAULTS, **value}
        ports = v["tcp_port_range"]
        if ports is not None:
            if (
                not isinstance(ports, (list, tuple))
                or len(ports) != 2
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
                or not 1 <= ports[0] <= ports[1] <= 65535
            ):
                raise ConfigError(
                    f"nixl.tcp_port_range must be [first, last] with 1 <= first <= last <= "
                    f"65535, or null, got {ports!r}"
                )
            ports = (ports[0], ports[1])
        window = parse_bytes(v["window_bytes"], name="nixl.window_bytes")
        if window < 4096:
            raise ConfigError(f"nixl.window_bytes must be at least 4KiB, got {v['window_bytes']!r}")
        host = v["host"]
        if host is not None and (not isinstance(host, str) or not host):
            raise ConfigError(f"nixl.host must be a non-empty string or null, got {host!r}")
        backends = v["backends"]
        if (
            not isinstance(backends, (list, tuple))
            or not backends
            or not all(isinstance(b, str) and b for b in backends)
        ):
            raise ConfigError(
                f'nixl.backends must be a non-empty list of backend names (e.g. ["UCX"]), '
                f"got {backends!r}"
            )
        times = {}
        for key in ("lease_s", "timeout_s"):
            t = v[key]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
                raise ConfigError(f"nixl.{key} must be a positive number of seconds, got {t!r}")
            times[key] = float(t)
        return cls(host, ports, window, tuple(backends), **times)


CLUSTER_DEFAULTS: dict[str, Any] = {
    "master": None,
    "metadata": None,
    "host": None,
    "protocol": "tcp",
    "segment_bytes": "1GiB",
    "key_file": None,
    "fetch_timeout_s": 5.0,
    "publish": True,
    "publish_queue": 256,
}


def _host_port(value: Any, what: str) -> str:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f'{what} must be "host:port" (port 1-65535), got {value!r}')
    return value


@dataclass(frozen=True)
class ClusterConfig:
    """The ``cluster`` key: see the module docstring."""

    master: str
    metadata: str
    host: str | None = None
    protocol: str = "tcp"
    segment_bytes: int = 1 << 30
    key_file: str | None = None
    fetch_timeout_s: float = 5.0
    publish: bool = True
    publish_queue: int = 256

    @classmethod
    def from_value(cls, value: Any) -> ClusterConfig | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"cluster must be a dict of {sorted(CLUSTER_DEFAULTS)} (or null to disable), "
                f"got {type(value).__name__} {value!r}"
            )
        unknown = sorted(set(value) - set(CLUSTER_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"unknown cluster key(s) {unknown}; cluster accepts {sorted(CLUSTER_DEFAULTS)}"
            )
        v = {**CLUSTER_DEFAULTS, **value}
        master = _host_port(v["master"], "cluster.master (the mooncake_master RPC address)")
        metadata = v["metadata"]
        if not isinstance(metadata, str) or not metadata.startswith(("http://", "https://")):
            raise ConfigError(
                "cluster.metadata must be the URL of the master's metadata server, e.g. "
                f'"http://10.0.0.1:8080/metadata" (mooncake_master '
                f"--enable_http_metadata_server), got {metadata!r}"
            )
        _host_port(metadata.split("://", 1)[1].split("/", 1)[0], "cluster.metadata's host:port")
        host = v["host"]
        if host is not None and (not isinstance(host, str) or not host):
            raise ConfigError(f"cluster.host must be a non-empty string or null, got {host!r}")
        if v["protocol"] != "tcp":
            raise ConfigError(
                f'cluster.protocol must be "tcp", got {v["protocol"]!r}: other transports need '
                "the arena registered with the store, which would let any peer write into it "
                '(README "Beyond the host: the cluster tier")'
            )
        segment = parse_bytes(v["segment_bytes"], name="cluster.segment_bytes")
        key_file = v["key_file"]
        if key_file is not None:
            if not isinstance(key_file, str) or not os.path.isfile(key_file):
                raise ConfigError(
                    f"cluster.key_file must be the path of an existing file, got {key_file!r}"
                )
            try:
                load_key(key_file)
            except ClusterError as exc:
                raise ConfigError(f"cluster.key_file: {exc}") from None
            exposed = key_file_exposure(key_file)
            if exposed:
                log.warning("ecoffload: cluster.key_file: %s", exposed)
        t = v["fetch_timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
            raise ConfigError(f"cluster.fetch_timeout_s must be a positive number, got {t!r}")
        if not isinstance(v["publish"], bool):
            raise ConfigError(f"cluster.publish must be true or false, got {v['publish']!r}")
        q = v["publish_queue"]
        if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q <= 1 << 20:
            raise ConfigError(f"cluster.publish_queue must be an int in [0, 2**20], got {q!r}")
        return cls(master, metadata, host, "tcp", segment, key_file, float(t), v["publish"], q)


@dataclass(frozen=True)
class OffloadConfig:
    arena_bytes: int
    block_bytes: int
    arena_dir: str
    arena_name: str
    num_programs: int | None
    populate: PopulateMode = "background"
    persistent: bool = False
    nixl: NixlConfig | None = None
    cluster: ClusterConfig | None = None

    @property
    def num_blocks(self) -> int:
        return self.arena_bytes // self.block_bytes

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, default_name: str
    ) -> OffloadConfig:
        """Validate ``ec_connector_extra_config``; ``default_name`` names the arena
        when ``arena_name`` is not given."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ConfigError(
                f"unknown ec_connector_extra_config key(s) {unknown}; ecoffload accepts "
                f"{sorted(DEFAULTS)}"
            )
        values = {**DEFAULTS, **extra}
        block = parse_bytes(values["block_bytes"], name="block_bytes")
        if block % 4096:
            raise ConfigError(f"block_bytes must be a multiple of 4096 (4 KiB), got {block}")
        arena = parse_bytes(values["arena_bytes"], name="arena_bytes")
        if arena % 4096:
            raise ConfigError(
                f"arena_bytes must be a multiple of the page size (4096), got {arena}: "
                "use a value such as '512MiB' or '8GiB'"
            )
        if arena < block:
            raise ConfigError(
                f"arena_bytes ({arena}) is smaller than one block ({block}): raise arena_bytes"
            )
        if arena // block >= 1 << 31:
            raise ConfigError(
                f"arena_bytes / block_bytes is {arena // block} blocks, the catalog holds at "
                "most 2**31 - 1: raise block_bytes or lower arena_bytes"
            )
        arena_dir = values["arena_dir"]
        if not isinstance(arena_dir, str) or not os.path.isdir(arena_dir):
            raise ConfigError(f"arena_dir must be an existing directory, got {arena_dir!r}")
        name = values["arena_name"]
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"arena_name must be a string, got {type(name).__name__} {name!r}")
        name = name or default_name
        try:
            check_arena_name(name)
        except ArenaError as exc:
            raise ConfigError(f"arena_name: {exc}") from None
        programs = values["num_programs"]
        if programs is not None and (
            isinstance(programs, bool) or not isinstance(programs, int) or programs <= 0
        ):
            raise ConfigError(f"num_programs must be a positive int, got {programs!r}")
        populate = values["populate"]
        if populate not in POPULATE_MODES:
            raise ConfigError(f"populate must be one of {list(POPULATE_MODES)}, got {populate!r}")
        persistent = values["persistent"]
        if not isinstance(persistent, bool):
            raise ConfigError(f"persistent must be true or false, got {persistent!r}")
        nixl = NixlConfig.from_value(values["nixl"])
        cluster = ClusterConfig.from_value(values["cluster"])
        return cls(arena - arena % block, block, arena_dir, name, programs, populate, persistent,
                   nixl, cluster)  # fmt: skip
