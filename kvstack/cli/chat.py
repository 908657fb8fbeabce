"""`kvstack chat`: a conversation kept in the cache across turns, saved as a session with
--session."""

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstack.cli.engine_args import (
    add_engine_args,
    add_sampling_args,
    cache_line,
    load_llm,
    sampling,
)
from kvstack.units import format_bytes

if TYPE_CHECKING:  # the engine pulls in the model; parsing the command does not need it
    from kvstack.engine import LLM
    from kvstack.engine.session import Session


CHAT_HELP = ("/image FILE adds a picture to your next message (a model with a vision tower), "
             "/reset starts a new conversation, /stats shows the cache (/stats --json: all "
             "of it), /exit or Ctrl-D leaves; Ctrl-C stops a reply")


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    chat = sub.add_parser("chat", help="a conversation kept in the cache across turns")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--session", metavar="NAME",
                      help="resume this saved session if it exists; save it after each turn")
    chat.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import readline  # noqa: F401  (input() gains line editing and history)

    from kvstack.engine.core import EngineError

    llm = load_llm(args)
    params = sampling(args)
    console = Console(stderr=True)
    console.print(f"[dim]kvstack chat · {CHAT_HELP}[/dim]")
    session = _open_session(llm, args.session, console)
    pictures: list[Any] = []  # for the next message
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            session.close()
            session = llm.session(args.session or "chat")
            if args.session and llm.disk.has(args.session):
                llm.disk.remove(args.session)  # a resume must not bring the old one back
                console.print(f"[dim]new conversation; saved session {args.session!r} "
                              "removed[/dim]")
            else:
                console.print("[dim]new conversation[/dim]")
            continue
        if command in ("/stats", "/stats --json"):
            report = llm.memory_report() | {"session": session.report()}
            if command.endswith("--json"):
                console.print_json(json.dumps(report))
            else:
                _print_stats(report, console)
            continue
        if command.startswith("/image "):
            from kvstack.engine.images import image_input

            path = command.removeprefix("/image ").strip()
            try:  # decoded now, so that a bad file is said at once
                pictures.append(image_input(path, llm.config, llm.engine_config.image_bytes))
            except ValueError as e:
                console.print(f"[red]{escape(str(e))}[/red]")
                continue
            console.print(f"[dim]picture {len(pictures)} added to your next message "
                          f"({pictures[-1].n_positions} positions)[/dim]")
            continue
        if command.startswith("/"):
            console.print(f"[red]unknown command {command}[/red]; {CHAT_HELP}")
            continue
        shown, out = "", None
        try:
            session.append(line + "\n", images=pictures)
            pictures = []
            if args.truncate == "left":  # room for the reply under the model's length
                session.keep_last(max(1, llm.core.max_model_len - params.max_tokens))
            turn = session.stream(params)
            try:
                with typing_hidden(sys.stdin):
                    for out in turn:
                        print(out.text[len(shown):], end="", flush=True)
                        shown = out.text
            except KeyboardInterrupt:  # stop this reply (the conversation keeps what
                turn.close()           # was shown), keep the chat
                console.print("\n(reply stopped)", style="dim")
                out = None
            if args.session:
                try:
                    session.save()
                except OSError as e:  # the turn stays in the conversation; a later save
                    console.print(f"[red]not saved: {escape(str(e))}[/red]")  # may succeed
            if out is None:
                continue
        except (ValueError, EngineError) as e:  # a turn refused or failed: say so, go on
            console.print(f"[red]{escape(str(e))}[/red]")
            if "leaves no room" in str(e):
                console.print(f"[dim]the conversation holds {len(session.token_ids):,} tokens "
                              f"and the model takes {llm.core.max_model_len:,}: /reset "
                              "starts over, or run chat with --truncate left to keep the "
                              "last tokens[/dim]")
            continue
        rate = out.metrics.get("decode_tokens_per_s", 0.0)
        saved = f" · saved as {args.session!r}" if args.session else ""
        console.print(f"\n[dim][{rate:.1f} tokens/s · {cache_line(llm)}{saved}][/dim]")


def _print_stats(report: dict[str, Any], console: Console) -> None:
    s, prefix = report["session"], report["prefix_cache"]
    table = Table(box=box.SIMPLE_HEAD, show_header=False)
    for key, value in (
            ("conversation", f"{s['tokens']:,} tokens"),
            ("its cache on the device", format_bytes(s["device_bytes"])),
            ("saved on disk", format_bytes(s["disk_bytes"]) if s["disk_bytes"] else "not saved"),
            ("bytes per token", f"{report['bytes_per_token']:g} measured "
                                f"(plan {report['planned_bytes_per_token']:g})"),
            ("pool", f"{report['blocks_in_use']:,} of {report['blocks_total']:,} blocks "
                     f"in use, {report['capacity_tokens']:,} tokens in all"),
            ("prefix cache", f"{prefix['hit_tokens']:,} of {prefix['queried_tokens']:,} "
                             "prompt tokens found")):
        table.add_row(key, value)
    console.print(table)


def _open_session(llm: "LLM", name: str | None, console: Console) -> "Session":
    """The named session, resumed if it was saved before; an unsaved one without a name."""
    if name and llm.disk.has(name):
        session = llm.resume(name)
        tail = llm.tokenizer.decode(session.token_ids[-48:]).strip()
        console.print(f"[dim]resumed session {escape(name)!r}: {len(session.token_ids):,} "
                      f"tokens, ending …{escape(tail[-160:])}[/dim]", highlight=False)
        return session
    return llm.session(name or "chat")


@contextlib.contextmanager
def typing_hidden(stream: Any) -> Iterator[None]:
    """While a reply prints: keys typed meanwhile are neither echoed into it nor kept for
    the next prompt (a terminal's echo is off, its pending input dropped at the end). Not a
    terminal: nothing to do."""
    try:
        import termios
    except ImportError:  # not a POSIX system
        yield
        return
    try:
        fd = stream.fileno()
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError, AttributeError):  # a pipe or a file
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflags
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)
