"""The `kvstack` command: the top-level parser and the exit codes every sub-command shares.
Each sub-command is a module that adds its parser (`add_parser`) and runs it (`run`); the
eval sub-commands live with the evaluation (`kvstack.eval.commands`). Parsing loads neither
torch nor the engine: a command imports what it runs when it runs."""

import argparse
import importlib.metadata
import sqlite3
import sys

from kvstack.cli import chat, demo, export, generate, plan, serve, session, train, train_draft
from kvstack.eval import commands as eval_commands

# In the order `kvstack --help` lists them.
COMMANDS = (plan, generate, chat, serve, session, train, train_draft, demo, export,
            eval_commands)


def _version() -> str:
    """The installed version; a source tree run with PYTHONPATH (no install) has none."""
    try:
        return importlib.metadata.version("kvstack")
    except importlib.metadata.PackageNotFoundError:
        return "(source tree, not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstack",
        description="The DeepSeek-V4.1 compressed KV-cache stack.",
    )
    parser.add_argument("--version", action="version",
                        version=f"kvstack {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"kvstack {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the engine's own failures (EngineError) and torch's
        print(f"kvstack {args.command}: engine error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk: full, unreadable, not ours
        where = f" ({e.filename})" if e.filename else ""
        print(f"kvstack {args.command}: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except sqlite3.Error as e:  # a manifest damaged or locked while in use
        print(f"kvstack {args.command}: the session manifest: {e}", file=sys.stderr)
        return 1
