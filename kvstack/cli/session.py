"""`kvstack session`: the saved sessions of a cache directory: list, show, rm, recover."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstack.cli.engine_args import ENGINE_DEFAULTS
from kvstack.units import parse_bytes

if TYPE_CHECKING:
    from kvstack.cache.disk import SavedSession


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    session = sub.add_parser("session", help="saved sessions: list, show, rm, recover")
    session.add_argument("action", choices=["list", "show", "rm", "recover"],
                         help="recover: lift an orphaned directory's mark once its manifest "
                              "is restored (nothing is deleted while it stands)")
    session.add_argument("name", nargs="?")
    session.add_argument("--discard", action="store_true",
                         help="recover: delete the block files no session names")
    session.add_argument("--resign", action="store_true",
                         help="recover: trust a manifest whose key was lost and sign its rows "
                              "with the current key")
    # The disk tier the engine commands write: their directory and budget by default.
    session.add_argument("--cache-dir", default=ENGINE_DEFAULTS["cache_dir"],
                         help="where the disk tier lives (default: %(default)s)")
    session.add_argument("--disk-budget", default=ENGINE_DEFAULTS["disk_budget"])
    session.add_argument("--json", action="store_true")
    session.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstack.cache.disk import MANIFEST, DamagedSession, DiskTier, SavedSession

    root = Path(args.cache_dir).expanduser()
    if args.action in ("list", "show", "recover") and not (root / MANIFEST).is_file():
        # Reading creates nothing: a mistyped --cache-dir is said, not made.
        if args.action == "show":
            raise ValueError(f"no session {args.name!r}: {root} holds no saved sessions")
        if args.action == "recover":
            raise ValueError(f"{root} has no {MANIFEST} to recover from: restore it from a "
                             "backup first")
        print("[]" if args.json else f"no saved sessions in {root}")
        return 0
    disk = DiskTier(args.cache_dir, parse_bytes(args.disk_budget, "disk_budget"))
    if args.action == "recover":
        report = disk.recover(discard=args.discard, resign=args.resign)
        if args.json:
            print(json.dumps(report))
        else:
            print(f"{disk.root}: {report['sessions']} sessions intact, "
                  f"{len(report['damaged_sessions'])} damaged, "
                  f"{report['block_rows_restored']} block records rebuilt, "
                  f"{report['files_discarded']} unnamed block files discarded; no longer "
                  "orphaned")
        return 0
    if disk.orphaned is not None:
        print(f"{_shown(str(disk.root))} is orphaned ({disk.orphaned}): no block file is "
              f"deleted until `kvstack session recover`", file=sys.stderr)
    if args.action == "list":
        # A damaged record is listed as such; every intact session still is.
        listing = disk.sessions()
        rows = [r for r in listing if isinstance(r, SavedSession)]
        damaged = {r.name: r.reason for r in listing if isinstance(r, DamagedSession)}
        if args.json:
            print(json.dumps([_session_dict(r) for r in rows]
                             + [{"name": n, "damaged": why} for n, why in damaged.items()],
                             ensure_ascii=True))
            return 0
        if not listing:
            print(f"no saved sessions in {disk.root}")
            return 0
        table = Table(box=box.SIMPLE_HEAD, title=f"saved sessions in {escape(str(disk.root))}")
        for column in ("name", "tokens", "disk bytes", "+ window rings", "saved"):
            table.add_column(column, justify="left" if column == "name" else "right")
        for r in rows:
            table.add_row(_shown(r.name), f"{len(r.token_ids):,}", f"{r.disk_bytes:,}",
                          f"{r.window_ring_bytes:,}", time.strftime(
                              "%Y-%m-%d %H:%M", time.localtime(r.saved_at)))
        for name in damaged:
            table.add_row(_shown(name), "[red]damaged[/red]", "", "", "")
        Console().print(table)
        for name, why in damaged.items():
            print(f"session {_shown(name)}: {why} (kvstack session rm removes it)",
                  file=sys.stderr)
        return 0
    if not args.name:
        raise ValueError(f"kvstack session {args.action} needs a session name")
    if args.action == "rm":
        disk.remove(args.name)
        print(f"removed session {args.name!r}")
        return 0
    info = _session_dict(disk.show(args.name))
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>28}: {value:,}" if isinstance(value, int) else f"{key:>28}: {value}")
    return 0


def _shown(name: str) -> str:
    """A session name as a terminal shows it: rich markup and control characters (ANSI
    escapes) made visible rather than acted on."""
    return escape("".join(c if c.isprintable() else repr(c)[1:-1] for c in name))


def _session_dict(saved: "SavedSession") -> dict[str, Any]:
    return {"name": saved.name, "tokens": len(saved.token_ids),
            "held_tokens": saved.held_tokens, "blocks": len(saved.blocks),
            "block_tokens": saved.block_tokens, "disk_bytes": saved.disk_bytes,
            "window_ring_bytes": saved.window_ring_bytes,
            "disk_bytes_with_window_rings": saved.disk_bytes + saved.window_ring_bytes,
            "model_fingerprint": saved.model_fingerprint,
            "format_version": saved.format_version,
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(saved.saved_at))}
