"""``ecoffload``: see and manage a host's arenas without writing Python.

::

    ecoffload arenas [DIR]            every arena in DIR (default /dev/shm)
    ecoffload inspect NAME [--dir D]  items by state, pins and owners, LRU, producers,
                                      free extents, the catalog's check()
    ecoffload verify NAME [--dir D]   what a warm restart verifies, without serving
                                      (exit 1 if it would drop items or check fails)
    ecoffload rm NAME [--dir D]       remove an arena no process holds
                                      (exit 1, naming them, while any does)
    ecoffload shm [--dir D]           every segment of /dev/shm: size, age, what made
                                      it, who holds it; LEAKED where no live process does
    ecoffload shm --remove [NAME ...] remove the leaked ones (never a held one; a
                                      persistent arena only when named; exit 1 if a
                                      named one is held or missing)
    ecoffload dashboard               the Grafana dashboard's JSON
    ecoffload cluster MASTER METADATA the cluster tier's store: reachable, answering
                                      (exit 1 if not); writes nothing to it

Each takes ``--json`` (one JSON object on stdout; the schema is in the
README). The read-only commands never change an arena nor take its lock: they
work on a copy of the catalog region (``engine/survey.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from ..engine.arena.arena import Arena
from ..engine.arena.format import DEFAULT_DIR
from ..engine.base.errors import ArenaError
from ..engine.base.sizes import format_bytes
from ..engine.cluster.master import reachable
from ..engine.shm_segments import SegmentError, removable, remove, survey
from ..engine.survey import (
    ArenaNotFoundError,
    CatalogSnapshot,
    arena_path,
    arena_paths,
    holders,
    summarize,
)
from . import dashboard

EXIT_OK, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2
TORN = "; the arena changed during every copy for 2 s: rerun when no instance writes to it"


def arenas_report(directory: str) -> dict[str, Any]:
    """``ecoffload arenas``: every arena file in ``directory``."""
    rows = [summarize(p).to_dict() for p in arena_paths(directory)]
    return {"directory": directory, "arenas": rows}


def inspect_report(name: str, directory: str) -> dict[str, Any]:
    """``ecoffload inspect``: the arena's summary and its catalog, from a snapshot."""
    path = arena_path(name, directory)
    report: dict[str, Any] = {"arena": summarize(path).to_dict()}
    if not report["arena"]["has_catalog"]:
        return report
    snapshot = CatalogSnapshot.take(path)
    report["consistent"] = snapshot.consistent
    items = sorted(snapshot.items(), key=lambda i: -i.lru_age)  # LRU first: evicted next
    extents = snapshot.free_extents()
    error = snapshot.check()
    report.update(
        items_by_state={
            s: sum(i.state == s for i in items) for s in ("writing", "ready", "unverified")
        },
        items=[asdict(i) for i in items],
        pins=[{"key": i.key, **asdict(p)} for i in items for p in i.pinned_by],
        producers=[
            {"key": i.key, "pid": i.producer_pid, "alive": i.producer_alive}
            for i in items
            if i.state == "writing"
        ],  # fmt: skip
        free_extents={
            "count": len(extents),
            "blocks": sum(n for _, n in extents),
            "largest": max((n for _, n in extents), default=0),
            "extents": [list(e) for e in extents],
        },
        check={"ok": error is None, "error": error},
    )
    return report


def verify_report(name: str, directory: str) -> dict[str, Any]:
    """``ecoffload verify``: a warm restart's checks on a copy of the catalog."""
    path = arena_path(name, directory)
    result = CatalogSnapshot.take(path).verify()
    return {"name": name, "path": path, "ok": result.ok, **asdict(result)}


def rm_report(name: str, directory: str) -> dict[str, Any]:
    """``ecoffload rm``: remove the arena's name unless a process holds the file."""
    path = arena_path(name, directory)
    held = holders(path)
    removed = False
    if not held:
        try:
            removed = Arena.remove_shared(name, directory=directory)
        except ArenaError:
            held = holders(path)  # a process opened it meanwhile: name it
    return {"name": name, "path": path, "removed": removed, "holders": [asdict(h) for h in held]}


def shm_report(directory: str, remove_names: list[str] | None) -> dict[str, Any]:
    """``ecoffload shm``: the directory's segments and their holders; with
    ``remove_names`` (a list, empty for every leaked one) removes the leaked ones."""
    segments = survey(directory)
    report: dict[str, Any] = {
        "directory": directory,
        "segments": [s.to_dict() for s in segments],
        "leaked_bytes": sum(s.allocated_bytes for s in segments if s.leaked and not s.persistent),
    }
    if remove_names is not None:
        removable(segments, remove_names)  # refuses a held or missing name before any removal
        report["removed"] = [s.name for s in remove(directory, remove_names)]
    return report


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _print_shm(report: dict[str, Any]) -> None:
    rows = report["segments"]
    if not rows:
        print(f"no segments in {report['directory']}")
    for s in rows:
        if s["persistent"] and s["leaked"]:
            state = "kept (a persistent arena nobody holds: remove it with --remove NAME)"
        elif s["leaked"]:
            state = "LEAKED (no live process maps it or holds it open)"
        elif s["holders"]:
            state = "held by pid " + ", ".join(map(str, s["holders"]))
        else:
            state = "maybe held (by a process this user cannot inspect)"
        print(f"{s['name']}: {format_bytes(s['allocated_bytes'])} in memory "
              f"({format_bytes(s['size_bytes'])} file), written {_age(s['age_s'])} ago, "
              f"{s['kind']}{': ' + s['creator'] if s['creator'] else ''}; {state}")  # fmt: skip
    print(f"leaked: {format_bytes(report['leaked_bytes'])}")
    for name in report.get("removed", ()):
        print(f"removed {os.path.join(report['directory'], name)}")


def _print_arenas(report: dict[str, Any]) -> None:
    rows = report["arenas"]
    if not rows:
        print(f"no arenas in {report['directory']}")
        return
    for a in rows:
        used = "-" if a["bytes_used"] is None else format_bytes(a["bytes_used"])
        print(f"{a['name']}: {format_bytes(a['size_bytes'])}, blocks {a['num_blocks']} x "
              f"{format_bytes(a['block_bytes'])}, format {a['format_version']}, "
              f"ready {a['ready_fraction']:.0%}, items {a['items']} ({used}), "
              f"{'persistent' if a['persistent'] else 'not persistent'}, "
              f"key {a['layout_key'] or '-'}")  # fmt: skip
        for h in a["holders"]:
            print(f"    held by pid {h['pid']}: {h['command'][:100]}")


def _print_inspect(report: dict[str, Any]) -> None:
    _print_arenas({"arenas": [report["arena"]], "directory": ""})
    if "items" not in report:
        print("    no catalog")
        return
    print(f"    items: {report['items_by_state']}")
    for i in report["items"]:
        print(f"    {i['state']:7} {i['key']}  {format_bytes(i['nbytes'])} in {i['blocks']} "
              f"blocks, lru age {i['lru_age']}, pins {i['pins']}")  # fmt: skip
    for p in report["pins"]:
        print(f"    pin {p['key']}: pid {p['pid']} x{p['count']} "
              f"({'alive' if p['alive'] else 'dead'})")  # fmt: skip
    for p in report["producers"]:
        print(f"    producer {p['key']}: pid {p['pid']} ({'alive' if p['alive'] else 'dead'})")
    f = report["free_extents"]
    print(f"    free: {f['blocks']} blocks in {f['count']} extents, largest {f['largest']}")
    print(f"    check: {'ok' if report['check']['ok'] else report['check']['error']}")
    if not report["consistent"]:
        print("    (the arena changed during every copy for 2 s: this view may be torn)")


def _print_verify(report: dict[str, Any]) -> None:
    print(f"{report['name']}: {'ok' if report['ok'] else 'NOT OK'}: {report['items_kept']} of "
          f"{report['items_before']} items kept, {report['dropped_crc_mismatch']} dropped "
          f"(CRC-32 mismatch), dead reservations released: "
          f"{report['released_dead_reservations'] or 'none'}; check: "
          f"{report['check_error'] or 'ok'}{'' if report['consistent'] else TORN}")  # fmt: skip


def _print_rm(report: dict[str, Any]) -> None:
    if report["removed"]:
        print(f"removed {report['path']}")
        return
    print(f"not removed: {report['path']} is held by "
          + ", ".join(f"pid {h['pid']} ({h['command'][:60]})" for h in report["holders"]),
          file=sys.stderr)  # fmt: skip


def cluster_report(master: str, metadata: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The cluster tier's store as an instance would see it: the master and the metadata
    server reachable, a client connecting (it contributes no segment) and the master
    answering an existence query. Nothing is written to the store."""
    from ..engine.cluster.store import StoreClient, StoreSettings, endpoint, store_missing
    from ..engine.remote.nixl_setup import outward_ip

    report: dict[str, Any] = {"master": master, "metadata": metadata,
                              "mooncake": store_missing() or "installed"}  # fmt: skip
    for what, address in (("master", master), ("metadata", metadata)):
        try:
            end = endpoint(address)
        except ValueError:
            end = None
        report[f"{what}_reachable"] = end is not None and reachable(*end, timeout_s=1.0)
    report["available"] = False
    if report["mooncake"] != "installed" or not (
        report["master_reachable"] and report["metadata_reachable"]
    ):
        return report
    client = StoreClient(StoreSettings(master, metadata, host=outward_ip(), segment_bytes=0))
    try:
        if client.wait_connected(timeout_s):
            codes = client.call("lookup", lambda s: s.batch_is_exist(["ecoffload/probe"]),
                                timeout_s)  # fmt: skip
            report["available"] = codes is not None and codes[0] in (0, 1)
    finally:
        client.close(timeout_s)
    return report


def _print_cluster(r: dict[str, Any]) -> None:
    print(f"mooncake: {r['mooncake']}")
    print(f"master {r['master']}: {'reachable' if r['master_reachable'] else 'NOT reachable'}")
    print(f"metadata {r['metadata']}: "
          f"{'reachable' if r['metadata_reachable'] else 'NOT reachable'}")  # fmt: skip
    print("cluster tier: " + ("available" if r["available"] else "UNAVAILABLE"))


def main(argv: list[str] | None = None) -> int:
    """The ``ecoffload`` console script."""
    parser = argparse.ArgumentParser(prog="ecoffload", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("arenas", help="every arena in a directory")
    cmd.add_argument("directory", nargs="?", default=DEFAULT_DIR)
    for name, text in (("inspect", "one arena's catalog"),
                       ("verify", "what a warm restart verifies, without serving"),
                       ("rm", "remove an arena no process holds")):  # fmt: skip
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("name")
        cmd.add_argument("--dir", dest="directory", default=DEFAULT_DIR)
    cmd = sub.add_parser("shm", help="a shared-memory directory's segments, leaked ones")
    cmd.add_argument("--dir", dest="directory", default=DEFAULT_DIR)
    cmd.add_argument("--remove", nargs="*", metavar="NAME",
                     help="remove the leaked segments (or the named ones)")  # fmt: skip
    sub.add_parser("dashboard", help="print the Grafana dashboard (JSON)")
    cmd = sub.add_parser("cluster", help="the cluster tier's Mooncake Store: reachable, answering")
    cmd.add_argument("master", help="host:port of mooncake_master (the cluster.master key)")
    cmd.add_argument("metadata", help="its metadata server URL (the cluster.metadata key)")
    cmd.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for answers")
    for cmd in sub.choices.values():
        cmd.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.command == "dashboard":
        print(json.dumps(dashboard.load(), indent=2))
        return EXIT_OK
    if args.command == "cluster":
        report = cluster_report(args.master, args.metadata, args.timeout)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_cluster(report)
        return EXIT_OK if report["available"] else EXIT_REFUSED
    try:
        if args.command == "arenas":
            report, show = arenas_report(args.directory), _print_arenas
        elif args.command == "inspect":
            report, show = inspect_report(args.name, args.directory), _print_inspect
        elif args.command == "verify":
            report, show = verify_report(args.name, args.directory), _print_verify
        elif args.command == "shm":
            report, show = shm_report(args.directory, args.remove), _print_shm
        else:
            report, show = rm_report(args.name, args.directory), _print_rm
    except ArenaNotFoundError as exc:
        print(f"ecoffload {args.command}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except SegmentError as exc:
        print(f"ecoffload {args.command}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)
    refused = (args.command == "verify" and not report["ok"]) or (
        args.command == "rm" and not report["removed"]
    )
    return EXIT_REFUSED if refused else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
