"""The `kvstack` command."""

import argparse
import atexit
import contextlib
import importlib.metadata
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstack.config import (
    ATTENTION_BACKENDS,
    CPU_KERNELS,
    NUMERICS,
    PRESETS,
    ModelConfig,
    preset,
)
from kvstack.plan import make_plan

if TYPE_CHECKING:  # the engine pulls in the model; `kvstack plan` does not need it
    from kvstack.cache.disk import SavedSession
    from kvstack.engine import LLM, SamplingParams
    from kvstack.engine.session import Session

DEFAULT_CACHE_DIR = "~/.cache/kvstack"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


MIB = 1 << 20


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _params(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e8 else f"{n / 1e6:,.2f}M"


def print_plan(plan: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]kvstack plan: {plan['model']}[/bold]")
    console.print(f"[dim]{plan['basis']}[/dim]\n")

    layout = Table(
        title="Persistent cache layout (one row per stream)", title_justify="left",
        box=box.SIMPLE_HEAD, pad_edge=False,
    )
    for col in ("layer", "stream", "format", "width", "ratio", "B/entry", "B/token"):
        layout.add_column(col, justify="left" if col in ("stream", "format") else "right")
    for s in plan["streams"]:
        layout.add_row(
            str(s["layer"]), s["kind"], s["format"], str(s["width"]), str(s["ratio"]),
            str(s["bytes_per_entry"]), f"{s['bytes_per_token']:g}",
        )
    layout.add_section()
    layout.add_row("total", "", "", "", "", "", f"[bold]{plan['bytes_per_token']:g}[/bold]")
    console.print(layout)

    console.print(f"Persistent cache: [bold]{plan['bytes_per_token']:g} bytes/token[/bold]")
    layers = plan["layers"]
    enc = plan["n_encoder_layers"]
    if plan["arch"] == "dense":
        console.print(f"Layers: {len(layers)} dense attention layers, each keeping its own "
                      "keys and values for every token (the dense control)")
    else:
        w = plan["window"]
        console.print(
            f"Per sequence, never persisted: window rings {w['layers']} layers × "
            f"{w['slots']} × {w['format']}[{w['width']}] = "
            f"{plan['window_bytes_per_sequence']:,} B "
            f"({_bytes(plan['window_bytes_per_sequence'])}); partial compressor groups "
            f"{plan['partial_group_bytes_per_sequence']:,} B"
        )
        by_mode = {m: [x["layer"] for x in layers if x["mode"] == m]
                   for m in ("window", "full", "reindex", "reuse")}
        split = (f"encoder {_ranges(list(range(enc)))}, decoder "
                 f"{_ranges(list(range(enc, len(layers))))}" if enc else "decoder-only (no CED)")
        cand = [x["layer"] for x in layers if x["candidate_source"]]
        console.print(
            f"Layers: {split}; window-only {_ranges(by_mode['window'])}; Full "
            f"{_ranges(by_mode['full'])}; Reindex {_ranges(by_mode['reindex'])}; Reuse "
            f"{_ranges(by_mode['reuse'])}; candidate pool from layer "
            f"{cand[0] if cand else 'none'}"
        )
    drafts = plan["draft_layers_excluded"]
    console.print(
        f"Parameters: {_params(plan['params_total'])} total"
        + (f" (trunk; {drafts} draft layers not counted)" if drafts else "")
        + f", {_params(plan['params_active_decode'])} active per decoded token, "
        f"{_params(plan['params_active_prefill'])} per prefilled token"
        + (" under CED" if enc else "")
    )
    if "engram" in plan:
        e = plan["engram"]
        console.print(
            f"Engram tables (weights, apart from the cache): [bold]{_bytes(e['table_bytes'])}"
            f"[/bold] ({e['table_bytes'] / 1e9:,.1f} GB) at layers "
            f"{', '.join(map(str, e['layers']))} "
            f"({' + '.join(f'{r:,}' for r in e['rows'])} rows of {e['row_bytes']} B, FP8); "
            f"{e['rows_read_per_token_and_layer']} rows read per token and layer"
        )
    fit = (
        f"; {plan['hbm_gib']:g} GiB of cache memory holds [bold]{plan['sequences_fit']:,}"
        "[/bold] such sequences"
        if "sequences_fit" in plan
        else ""
    )
    console.print(
        f"At {plan['context']:,} tokens: {_bytes(plan['bytes_per_sequence'])} of cache per "
        f"sequence{fit}\n"
    )
    if "cpu_run" in plan:
        r = plan["cpu_run"]
        tables = (f"; with the Engram tables memory-mapped from it "
                  f"[bold]{_bytes(r['ram_bytes_tables_on_disk'])}[/bold]"
                  if r["engram_table_bytes"] else "")
        console.print(
            f"CPU run of the published checkpoint ({_bytes(r['disk_bytes'])} on disk), one "
            f"sequence at {plan['context']:,} tokens: RAM [bold]"
            f"{_bytes(r['ram_bytes_tables_in_ram'])}[/bold] with every weight in RAM{tables}. "
            f"A decoded token reads {r['decode_read_bytes_per_token'] / 1e9:.2f} GB of "
            f"weights: at most {r['floor_tokens_per_s_per_100gb_s']:.1f} tokens/s per 100 "
            "GB/s of memory bandwidth\n"
        )

    if "parallel" in plan:
        _print_parallel(plan, console)
    if len(plan["mechanisms"]) > 1:
        _print_mechanisms(plan, console)


def _gib_gb(n: int) -> str:
    return f"{_bytes(n)} ({n / 1e9:,.1f} GB)" if n >= 1e9 else _bytes(n)


def _print_parallel(plan: dict[str, Any], console: Console) -> None:
    p = plan["parallel"]
    n, context = p["tensor_parallel_size"], plan["context"]
    tables = p["engram_table_bytes_on_host"]
    experts = (f"{p['experts_per_rank']} whole experts" if p["expert_parallel"] else
               f"a {p['expert_inter_per_rank']:,}-wide slice of every expert")
    console.print(
        f"[bold]Tensor parallel over {n} devices"
        + (", expert parallel" if p["expert_parallel"] else "") + "[/bold]: each holds "
        f"query heads {p['heads_per_rank']}, output groups {p['output_groups_per_rank']}, "
        f"index heads {p['index_heads_per_rank']}, {experts}, vocabulary rows "
        f"{p['vocab_rows_per_rank']:,}"
    )
    console.print(
        "Weights as DeepSeek publishes V4.1 (FP8 dense projections, FP4 experts"
        + (", FP8 Engram tables" if tables else "")
        + f"): {_gib_gb(p['weight_bytes_one_process'])} in one process; per device "
        + (f"{_bytes(p['engram_table_bytes_per_device'])} of Engram table rows and "
           if tables else "")
        + f"{_bytes(p['replicated_bytes_per_device'])} that every device holds whole "
        "(norms, hyper-connections, wq_a, wkv, compressors, router)"
    )
    console.print(
        f"Cache: each device keeps every token's whole record, so [bold]"
        f"{p['cache_bytes_per_token_per_device']:g} bytes/token per device[/bold] (the "
        f"single-process figure; {n} × that over the devices), "
        f"{_bytes(p['cache_bytes_per_sequence_per_device'])} per sequence of {context:,} tokens"
    )
    fit = p.get("fit")
    if fit:
        console.print(f"Of each device's {p['hbm_gib_per_device']:g} GiB: the weights, a "
                      f"{p['reserve_fraction']:.0%} reserve ({_bytes(p['reserve_bytes'])}) for "
                      "activations and workspaces, the rest for the cache")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("Engram tables" if tables else "")
    table.add_column("weights/device", justify="right")
    table.add_column(f"all {n} devices", justify="right")
    if fit:
        table.add_column("cache/device", justify="right")
        table.add_column(f"seqs of {context:,}", justify="right")
    rows = [("on the devices" if tables else "all weights", "tables_on_device",
             p["weight_bytes_per_device"], p["weight_bytes_all_devices"])]
    if tables:
        rows.append(("on the host", "tables_on_host",
                     p["weight_bytes_per_device_tables_on_host"],
                     p["weight_bytes_all_devices"] - tables))
    for label, key, per_device, all_devices in rows:
        cells = [label, _bytes(per_device), _bytes(all_devices)]
        if fit:
            f = fit[key]
            cells.append(_bytes(f["cache_bytes"]))
            cells.append(f"{f['sequences_fit']:,}" if f["sequences_fit"] else
                         "[bold red]none[/bold red]")
        table.add_row(*cells)
    console.print(table)
    if tables:
        console.print(f"Engram tables on the host: it holds them whole, {_gib_gb(tables)}; "
                      "each device the rest")
    if fit:
        for label, key, _, _ in rows:
            f = fit[key]
            where = f"Engram tables {label}: the" if tables else "The"
            if f["weights_exceed_hbm"]:
                console.print(f"[bold red]{where} weights alone ({_bytes(f['weight_bytes'])}) "
                              f"exceed the device's {p['hbm_gib_per_device']:g} GiB[/bold red]")
            elif not f["sequences_fit"]:
                console.print(f"[bold red]{where} weights ({_bytes(f['weight_bytes'])}) and "
                              "the reserve leave no room for a sequence of "
                              f"{context:,} tokens[/bold red]")
        console.print(
            f"[dim]Every device holds the same sequences, so that is what the {n} serve "
            f"together. The capacity line above gives all {p['hbm_gib_per_device']:g} GiB "
            "to the cache.[/dim]"
        )
    console.print()


def _print_mechanisms(plan: dict[str, Any], console: Console) -> None:
    title = f"What each mechanism buys (at {plan['context']:,} tokens"
    title += f", {plan['hbm_gib']:g} GiB)" if "hbm_gib" in plan else ")"
    mech = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    mech.add_column("variant", no_wrap=True)
    for col in ("HBM B/tok", "disk B/tok", "window MiB", "MiB/seq"):
        mech.add_column(col, justify="right", no_wrap=True)
    if "hbm_gib" in plan:
        mech.add_column("seqs fit", justify="right")
    mech.add_column("×HBM", justify="right")
    mech.add_column("×disk", justify="right")
    for row in plan["mechanisms"]:
        cells = [
            row["variant"],
            f"{row['hbm_bytes_per_token']:,g}",
            f"{row['persistent_bytes_per_token']:,g}",
            f"{row['window_bytes_per_sequence'] / MIB:,.2f}",
            f"{row['bytes_per_sequence'] / MIB:,.1f}",
        ]
        if "hbm_gib" in plan:
            cells.append(f"{row['sequences_fit']:,}")
        cells.append(f"{row['hbm_ratio']:.2f}")
        cells.append("-" if row["persistent_ratio"] is None else f"{row['persistent_ratio']:.2f}")
        mech.add_row(*cells)
    console.print(mech)
    console.print(
        "[dim]bf16 cache: every cache in bf16 instead of FP4/FP8. no sharing: every "
        "compressed layer its own kv source (Full), the CED decoder stream aside. no CED: "
        "every compressed decoder layer its own kv source. window persisted: no bounded "
        "replay, so the disk tier keeps every token's window entry in every layer. dense "
        "control: the same model as a plain transformer with per-layer GQA keys and values "
        "in bf16. "
        "HBM B/tok: stream bytes per token; MiB/seq adds one sequence's window rings "
        "and partial groups; disk B/tok: what a saved session keeps per token.[/dim]"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.config:
        config, name = ModelConfig.from_json(args.config), args.config
    else:
        config, name = preset(args.preset), args.preset
    plan = make_plan(config, name, context=args.context, hbm_gib=args.hbm_gib,
                     tensor_parallel_size=args.tensor_parallel_size,
                     expert_parallel=args.expert_parallel)
    if args.json:
        print(json.dumps(plan))
    else:
        # The mechanism table needs about 100 columns; narrower consoles would fold it.
        print_plan(plan, Console(width=max(Console().width, 100)))
    return 0


# ---- generate and chat ----------------------------------------------------------------


def _load_llm(args: argparse.Namespace, **settings: Any) -> "LLM":
    """The engine the command runs. Under torchrun with --tensor-parallel-size, rank 0
    returns it and every other rank serves as a worker until rank 0 stops, then exits."""
    from kvstack.engine import LLM, EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = EngineConfig(
        kv_budget=args.kv_budget, replay=args.replay, device=args.device,
        cache_dir=args.cache_dir, host_budget=args.host_budget or 0,
        disk_prefix_cache=args.disk_prefix_cache, numerics=args.numerics,
        threads=args.threads, max_model_len=args.max_model_len, compile_decode=args.compile,
        attention=args.attention, cpu_kernels=args.cpu_kernels,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel,
        parallel_timeout_s=args.parallel_timeout, **settings)
    rank = int(os.environ.get("RANK", "0"))
    if config.tensor_parallel_size > 1 and rank > 0:
        from kvstack.engine.workers import ModelSource, serve_worker

        serve_worker(rank, config.tensor_parallel_size, None, None,
                     ModelSource(args.model, args.random_init, args.init_seed), config)
        raise SystemExit(0)
    llm = LLM(args.model, config, random_init=args.random_init, seed=args.init_seed)
    atexit.register(llm.close)  # a sharded engine's workers stop with the command
    return llm


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstack.engine.async_llm import AsyncLLM
    try:
        from kvstack.serve.app import ServeConfig, bind, build_app, serve_app
    except ImportError as e:
        raise ValueError(f"kvstack serve needs its extra ({e.name} is missing): pip install "
                         "-e '.[serve]'") from None

    from kvstack.units import parse_bytes

    name = args.served_model_name or (
        "kvstack-default" if args.model == "default" else Path(args.model).name)
    keys = list(args.api_key or [])
    if args.api_key_file:
        text = Path(args.api_key_file).expanduser().read_text()
        keys += [line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
    if not keys and os.environ.get("KVSTACK_API_KEY"):
        keys = [os.environ["KVSTACK_API_KEY"]]
    config = ServeConfig(
        name, tuple(dict.fromkeys(keys)), args.share_prefix_cache, args.max_waiting,
        host=args.host, port=args.port, grace_period_s=args.grace_period,
        max_body_bytes=parse_bytes(args.max_body_size, "--max-body-size"),
        request_timeout_s=args.request_timeout, max_connections=args.max_connections,
        default_max_tokens=args.default_max_tokens)
    # A port in use is said before the model loads (by rank 0 alone: under torchrun the
    # other ranks serve as workers inside _load_llm and never listen).
    sock = bind(config) if int(os.environ.get("RANK", "0")) == 0 else None
    engine = AsyncLLM(_load_llm(args, max_num_seqs=args.max_num_seqs))
    logging.getLogger("kvstack").info("kvstack serve: %s on http://%s:%d/v1", name,
                                      args.host, args.port)
    serve_app(build_app(engine, config), config, sock)
    return 0


def _sampling(args: argparse.Namespace) -> "SamplingParams":
    from kvstack.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text()
        except OSError as e:
            raise ValueError(f"prompt file {args.prompt_file}: cannot read ({e.strerror})") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {args.prompt_file}: not UTF-8 text (byte "
                             f"{e.start}: {e.reason})") from None
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise ValueError("no prompt: pass --prompt, --prompt-file, or pipe text on stdin")


def _cache_line(llm: "LLM") -> str:
    report = llm.memory_report()
    tokens, per_token = report["tokens_in_use"], report["in_use_bytes_per_token"] or 0
    held = tokens * per_token + report["window_bytes_per_sequence"]
    return (f"cache {_bytes(held)} for {tokens:,} tokens ({report['bytes_per_token']:g} "
            f"B/token measured, plan {report['planned_bytes_per_token']:g})")


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    llm = _load_llm(args)
    params = _sampling(args)
    if args.truncate == "left":  # the prompt's last tokens, leaving room for the reply
        prompt = llm.encode(prompt)[-max(1, llm.core.max_model_len - params.max_tokens):]
    start = time.perf_counter()
    if args.json:
        out = llm.generate(prompt, params)[0]
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids,
            "prompt_token_ids": out.prompt_token_ids, "finish_reason": out.finish_reason,
            "error": out.error, "num_cached_tokens": out.num_cached_tokens,
            "timings": {**out.metrics, "total_s": time.perf_counter() - start},
            "memory": llm.memory_report(),
        }))
        return 0
    shown, out = "", None
    for out in llm.stream(prompt, params, keep_cache=True):
        print(out.text[len(shown):], end="", flush=True)
        shown = out.text
    if out.finish_reason == "error":
        print(f"\nkvstack generate: the engine failed on the request: {out.error}",
              file=sys.stderr)
        return 1
    rate = out.metrics.get("decode_tokens_per_s", 0.0)
    print(f"\n[{len(out.token_ids)} tokens, {out.finish_reason}; first token after "
          f"{out.metrics['time_to_first_token_s']:.2f} s; {rate:.1f} tokens/s; "
          f"{_cache_line(llm)}]", file=sys.stderr)
    return 0


CHAT_HELP = ("/reset starts a new conversation, /stats shows the cache (/stats --json: all "
             "of it), /exit or Ctrl-D leaves; Ctrl-C stops a reply")


def _cmd_chat(args: argparse.Namespace) -> int:
    import readline  # noqa: F401  (input() gains line editing and history)

    from kvstack.engine.core import EngineError

    llm = _load_llm(args)
    params = _sampling(args)
    console = Console(stderr=True)
    console.print(f"[dim]kvstack chat · {CHAT_HELP}[/dim]")
    session = _open_session(llm, args.session, console)
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
        if command.startswith("/"):
            console.print(f"[red]unknown command {command}[/red]; {CHAT_HELP}")
            continue
        shown, out = "", None
        try:
            session.append(line + "\n")
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
        console.print(f"\n[dim][{rate:.1f} tokens/s · {_cache_line(llm)}{saved}][/dim]")


def _print_stats(report: dict[str, Any], console: Console) -> None:
    s, prefix = report["session"], report["prefix_cache"]
    table = Table(box=box.SIMPLE_HEAD, show_header=False)
    for key, value in (
            ("conversation", f"{s['tokens']:,} tokens"),
            ("its cache on the device", _bytes(s["device_bytes"])),
            ("saved on disk", _bytes(s["disk_bytes"]) if s["disk_bytes"] else "not saved"),
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


def _shown(name: str) -> str:
    """A session name as a terminal shows it: rich markup and control characters (ANSI
    escapes) made visible rather than acted on."""
    return escape("".join(c if c.isprintable() else repr(c)[1:-1] for c in name))


def _cmd_session(args: argparse.Namespace) -> int:
    from kvstack.cache.disk import MANIFEST, DamagedSession, DiskTier, SavedSession
    from kvstack.units import parse_bytes

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


def _session_dict(saved: "SavedSession") -> dict[str, Any]:
    return {"name": saved.name, "tokens": len(saved.token_ids),
            "held_tokens": saved.held_tokens, "blocks": len(saved.blocks),
            "block_tokens": saved.block_tokens, "disk_bytes": saved.disk_bytes,
            "window_ring_bytes": saved.window_ring_bytes,
            "disk_bytes_with_window_rings": saved.disk_bytes + saved.window_ring_bytes,
            "model_fingerprint": saved.model_fingerprint,
            "format_version": saved.format_version,
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(saved.saved_at))}


def _layer_factor(text: str) -> tuple[int, float]:
    layer, sep, factor = text.partition("=")
    try:
        pair = int(layer), float(factor)
    except ValueError:
        pair = None
    if not sep or pair is None or not pair[1] > 0:
        raise argparse.ArgumentTypeError(f"expected LAYER=FACTOR with a positive factor, "
                                         f"got {text!r}")
    return pair


def _config_setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string such as kv_format=bf16


def _cmd_train(args: argparse.Namespace) -> int:
    from kvstack.train.trainer import TrainConfig, Trainer

    tc = TrainConfig(preset=args.preset, steps=args.steps, seq_len=args.seq_len,
                     batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                     min_lr=args.min_lr,
                     warmup_steps=args.warmup_steps, dense_warmup_steps=args.dense_warmup_steps,
                     dense_warmup_indexer_only=args.dense_warmup_indexer_only,
                     index_target_rows=args.index_target_rows,
                     eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                     seed=args.seed, vocab_size=args.vocab_size, corpus=args.corpus or "",
                     heldout_percent=args.heldout_percent, retrieval_rate=args.retrieval_rate,
                     retrieval_keys=args.retrieval_keys,
                     retrieval_families=args.retrieval_families,
                     retrieval_define_loss=not args.no_define_loss,
                     answer_loss_weight=args.answer_loss_weight,
                     model_overrides=dict(args.set or []), init_from=args.init_from or "")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    terminal = sys.stderr.isatty()
    Trainer(tc, args.out, device=device).run(progress=terminal, lines=not terminal)
    return 0


def _eval_data(args: argparse.Namespace):
    import hashlib

    from kvstack.eval.quality import heldout_tokens, load_eval_model

    model, tokenizer = load_eval_model(args.model)
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    cache = Path.home() / ".cache" / "kvstack" / "eval" / f"heldout-{digest}.npy"
    return model, tokenizer, heldout_tokens(tokenizer, cache, args.heldout_percent)


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import perplexity

    model, _, data = _eval_data(args)
    result = perplexity(model, data, args.seq_len, args.windows,
                        short_context=args.short_context)
    if args.json:
        print(json.dumps(result))
    else:
        Console().print(
            f"held-out perplexity {result['ppl']:.3f} with {model.config.kv_format} caches, "
            f"{result['ppl_bf16']:.3f} with bf16 caches ({result['ppl_increase']:+.2%}); "
            f"KL {result['kl_vs_bf16']:.2e}, top-1 agreement {result['top1_agreement']:.1%} "
            f"over {args.windows} windows of {args.seq_len} tokens")
        table = Table(box=box.SIMPLE_HEAD, title="perplexity by position in the window")
        for bucket in result["ppl_by_position"]:
            table.add_column(bucket, justify="right")
        table.add_row(*(f"{v:.2f}" for v in result["ppl_by_position"].values()))
        if args.short_context:
            table.add_row(*(f"{v:.2f}" for v in
                            result["ppl_by_position_short_context"].values()))
            table.caption = (f"first row: the whole window before each token; second: the "
                             f"same tokens through windows of {args.short_context} "
                             f"(perplexity {result['ppl_short_context']:.3f})")
        Console().print(table)
    return 0


def _cmd_eval_retrieval(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import heat_map, retrieval

    model, tokenizer, data = _eval_data(args)
    result = retrieval(model, tokenizer, data, args.lengths, args.depths, args.samples,
                       replay=args.replay, seed=args.seed, forms=args.families)
    if args.plot:
        heat_map(result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"retrieval accuracy ({args.samples} samples per cell, {args.replay} "
                  f"replay, keys written as {', '.join(result['families'])}; rows: context "
                  "tokens, columns: depth of the key)")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("tokens", justify="right")
    for d in args.depths:
        table.add_column(f"{d:.0%}", justify="right")
    for n, row in zip(args.lengths, result["accuracy"], strict=True):
        table.add_row(str(n), *(f"{a:.0%}" for a in row))
    console.print(table)
    if len(result["families"]) > 1:
        console.print("answered / asked, by the family the key was written in")
        by_family = Table(box=box.SIMPLE_HEAD)
        by_family.add_column("tokens", justify="right")
        for name in result["families"]:
            by_family.add_column(name, justify="right")
        for n, tally in zip(args.lengths, result["by_family"], strict=True):
            by_family.add_row(str(n), *(f"{hit} / {asked}" for hit, asked in tally.values()))
        console.print(by_family)
    for n, missed in zip(args.lengths, result["misses"], strict=True):
        if missed:
            first = sum(m["at"] == 0 for m in missed)
            shown = "; ".join(f"{m['answer']!r}: {m['chose']!r} for {m['expected']!r}"
                              for m in missed[:3])
            console.print(f"{n} tokens: {len(missed)} wrong, {first} from the answer's "
                          f"first token, {len(missed) - first} later; chosen for expected: "
                          f"{shown}")
    return 0


def _cmd_eval_planted(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import planted_starts

    model, tokenizer, data = _eval_data(args)
    result = planted_starts(model, tokenizer, data, args.samples, args.context, args.new_tokens)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, what in (("code", f"greedy continuations of held-out code ({args.context} "
                                 "tokens each)"), ("chat", "greedy chat replies")):
        r = result[name]
        print(f"{r['planted_share']:.1%} of {r['prompts']} {what} open with a key definition")
        for line in r["examples"]:
            print(f"  {line}")
    return 0


def _cmd_eval_knockout(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import knockout

    model, tokenizer, data = _eval_data(args)
    result = knockout(model, tokenizer, data, args.length, args.depths, args.samples)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"retrieval at {args.length} tokens (depths "
                  f"{', '.join(f'{d:.0%}' for d in args.depths)}, {args.samples} questions "
                  "each) with one layer's compressed entries left out of its attention")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("left out", "mode", "ratio", "answer NLL", "accuracy"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for row in result["layers"]:
        name = "none" if row["layer"] is None else f"layer {row['layer']}"
        table.add_row(name, row.get("mode", ""), str(row.get("ratio", "")),
                      f"{row['answer_nll']:.3f}", f"{row['accuracy']:.0%}")
    console.print(table)
    return 0


def _cmd_eval_selection(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import selection

    model, tokenizer, data = _eval_data(args)
    result = selection(model, tokenizer, data, args.lengths, args.depths, args.samples,
                       forms=args.families, trunk_picks=args.trunk_picks,
                       logit_scale=dict(args.logit_scale or []))
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    picks = f"top-{result['index_topk']}" + (" by each layer's own attention logits"
                                              if args.trunk_picks else "")
    picks += "".join(f"; layer {k}'s logits x{v}" for k, v in result["logit_scale"].items())
    console.print(f"the definition's compressed entries at the query before the answer "
                  f"({len(args.depths) * args.samples} questions per length, keys written as "
                  f"{', '.join(result['families'])}; {picks}): the share "
                  "of them each picking layer selects and its compressed attention on them, "
                  "for the whole definition and for the value's tokens, and exact answers "
                  "where it selected some value entry (found) and where none (missed)")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("tokens", "exact", "layer", "whole", "mass", "value", "mass",
                 "found", "missed"):
        table.add_column(name, justify="right")
    for row in result["lengths"]:
        for i, layer in enumerate(row["layers"]):
            head = (str(row["length"]), f"{row['exact']:.0%}") if i == 0 else ("", "")
            table.add_row(*head, f"{layer['layer']} {layer['mode']}",
                          *(f"{layer[k]:.0%}" for k in ("selected", "mass",
                                                         "value_selected", "value_mass")),
                          *(f"{hit} / {n}" for hit, n in (layer["found"], layer["missed"])))
    console.print(table)
    return 0


def _cmd_eval_attention(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import attention_mass

    model, _, data = _eval_data(args)
    from_position = args.seq_len // 2 if args.from_position is None else args.from_position
    result = attention_mass(model, data, args.seq_len, args.windows, from_position)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"where attention goes: queries at positions {from_position}.."
                  f"{args.seq_len - 1} of {args.windows} held-out windows, averaged over heads "
                  f"(window {result['window_size']}; near: compressed entries the window also "
                  "holds raw; far: entries beyond it)")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("layer", "mode", "ratio", "window", "near", "far", "sink",
                 "top-k picks near"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for row in result["layers"]:
        near = row["selected_near"]
        table.add_row(str(row["layer"]), row["mode"], str(row["ratio"]),
                      *(f"{row[k]:.1%}" for k in ("window", "near", "far", "sink")),
                      "-" if near is None else f"{near:.0%}")
    console.print(table)
    return 0


def _cmd_eval_replay(args: argparse.Namespace) -> int:
    from kvstack.eval.replay import LENGTHS, replay

    model, _, data = _eval_data(args)
    result = replay(model, data, args.lengths or LENGTHS, args.replay, args.decode_tokens,
                    args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"resuming a paused session: the window state rebuilt by replay from the "
                  f"streams (window {result['window_size']}) against a prefill of the whole "
                  f"context (a cache miss), best of {args.repeats} runs; KL and top-1 "
                  f"agreement with the uninterrupted session over the next "
                  f"{args.decode_tokens + 1} positions")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("replay", no_wrap=True)
    for name in ("enc/dec", "rebuild\nms", "prefill\nms", "prefill/\nrebuild",
                 "KL\nmean", "KL\nmax", "top-1"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in result["results"]:
        for mode, r in row["replay"].items():
            table.add_row(str(row["tokens"]), mode,
                          f"{r['encoder_tokens']}/{r['decoder_tokens']}",
                          f"{r['rebuild_s'] * 1e3:.1f}", f"{row['reprefill_s'] * 1e3:.1f}",
                          f"{r['reprefill_over_rebuild']:.1f}x", f"{r['kl_mean']:.1e}",
                          f"{r['kl_max']:.1e}", f"{r['top1_agreement']:.0%}")
    console.print(table)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvstack.demo import demo

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    result = demo(args.model, args.control, context=args.context, max_tokens=args.max_tokens,
                  console=Console(stderr=args.json))
    if args.json:
        print(json.dumps(result))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from kvstack.engine.llm import bundled_model
    from kvstack.engine.tokenizer import byte_level_tokenizer_json
    from kvstack.model import Model
    from kvstack.model.checkpoint import INDEX_FILE, export_v41, save_kvstack
    from kvstack.units import parse_bytes

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: export writes a new directory")
    shard_bytes = parse_bytes(args.shard_size, "shard-size")
    if args.random_init:
        if not args.preset:
            raise ValueError("--random-init needs --preset")
        torch.manual_seed(args.init_seed)
        model = Model(preset(args.preset))
        tokenizer_json = byte_level_tokenizer_json()
    else:
        if args.preset:
            raise ValueError("--preset goes with --random-init; a model comes from --model")
        source = bundled_model() if args.model == "default" else Path(args.model)
        if not (source / "tokenizer.json").is_file():
            raise ValueError(f"model {source}: tokenizer.json is missing (an export ships it)")
        model = Model.from_pretrained(source)
        tokenizer_json = (source / "tokenizer.json").read_text()
    if args.format == "v41":
        files = export_v41(model, out, shard_bytes)
        written = f"{len(files)} shards + {INDEX_FILE}"
    else:
        save_kvstack(model, out)
        written = "model.safetensors"
    (out / "tokenizer.json").write_text(tokenizer_json)
    print(f"wrote {out}: config.json, {written}, tokenizer.json")
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="a model directory, or a preset name with --random-init "
                        "(default: the bundled model)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights and a byte tokenizer (tests, benchmarks)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of --random-init")
    p.add_argument("--kv-budget", default="1GiB", help="bytes for the cache, e.g. 4GiB")
    p.add_argument("--host-budget",
                   help="host memory that keeps prefix blocks the device pool hands out "
                        "again, e.g. 2GiB (default: none)")
    p.add_argument("--disk-prefix-cache", action="store_true",
                   help="write the blocks the prefix cache names through to disk "
                        "(--cache-dir), where a later run finds them")
    p.add_argument("--replay", choices=("bounded", "exact"), default="bounded",
                   help="decoder replay span of CED prefill")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=_positive_int,
                   help="torch threads (default: half the cores, at most 8: all of them "
                        "collapse on a busy machine)")
    p.add_argument("--compile", action="store_true",
                   help="run decode steps through torch.compile, one graph per batch-size "
                        "bucket: minutes to compile on a bucket's first step on a small CPU, "
                        "faster after")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                   help="a decode step's attention: the Triton kernel over the packed rows "
                        "(CUDA), torch, or auto (torch: the kernel is slower on an H200 so far)")
    p.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="a CPU step's packed-row reads, index scoring, expert matmuls and "
                        "packed-weight matmuls: C kernels built on first use (c: or fail), "
                        "torch, or auto (C where the system's C compiler builds them)")
    p.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="tokens a sequence may hold, below the model's max_seq_len")
    p.add_argument("--numerics", choices=NUMERICS, default="default",
                   help="reference: round activations to FP8 before FP8/FP4 weights and form "
                        "RoPE angles in float32, as DeepSeek's code does (parity checks)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                   help="where the disk tier and saved sessions live (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                   help="split the model over N processes, one device each (gloo on CPUs, "
                        "NCCL on GPUs); under torchrun, over its ranks (default: 1)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: whole routed experts by rank instead "
                        "of a slice of every expert")
    p.add_argument("--parallel-timeout", type=float, default=120.0, metavar="S",
                   help="with --tensor-parallel-size: seconds a rank may take to answer "
                        "before the engine counts it lost (idle ranks are kept alive by a "
                        "heartbeat) (default: %(default)s)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    # The command's sampling defaults suit reading a model's text; SamplingParams() keeps
    # vLLM's library defaults (temperature 1, top-p 1).
    p.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens; 0 = all (default: %(default)s)")
    p.add_argument("--seed", type=int, help="sampling seed (default: none)")
    p.add_argument("--stop", action="append", default=[],
                   help="end the text before this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    p.add_argument("--truncate", choices=("error", "left"), default="error",
                   help="a prompt (chat: a conversation) longer than the model takes: refuse "
                        "it (error, the default), or keep its last tokens (left), leaving "
                        "room for --max-tokens")


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
    plan = sub.add_parser(
        "plan",
        help="cache layout, bytes/token, parameters and capacity of a model (from its config)",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=PRESETS, help="a named model config")
    source.add_argument("--config", metavar="FILE", help="a config.json")
    plan.add_argument(
        "--context", type=_positive_int, help="tokens per sequence (default: max_seq_len)"
    )
    plan.add_argument(
        "--hbm-gib", type=_positive_float, metavar="G",
        help="GiB of memory of one device: how many sequences fit (all of it given to the "
             "cache; with --tensor-parallel-size, what the weights and a reserve leave)",
    )
    plan.add_argument(
        "--tensor-parallel-size", type=_positive_int, metavar="N",
        help="what each of N devices holds: weights (as V4.1 is published), Engram tables "
             "and cache, and with --hbm-gib the sequences each fits",
    )
    plan.add_argument(
        "--expert-parallel", action="store_true",
        help="with --tensor-parallel-size: whole routed experts per device, not a slice of "
             "every expert",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=_cmd_plan)

    generate = sub.add_parser("generate", help="generate a continuation of a prompt")
    _add_engine_args(generate)
    _add_sampling_args(generate)
    prompt = generate.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a file")
    generate.add_argument("--json", action="store_true",
                          help="print text, token ids, timings and the memory report as JSON")
    generate.set_defaults(run=_cmd_generate)

    chat = sub.add_parser("chat", help="a conversation kept in the cache across turns")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--session", metavar="NAME",
                      help="resume this saved session if it exists; save it after each turn")
    chat.set_defaults(run=_cmd_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, "
                           "chat, streaming, sessions, /metrics)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model name requests give (default: the model directory's "
                            "name, or kvstack-default for the bundled model)")
    serve.add_argument("--api-key", action="append",
                       help="require 'Authorization: Bearer KEY' on /v1; repeat it (or use "
                            "--api-key-file) for several tenants, each seeing only its own "
                            "sessions and prefix cache (default: $KVSTACK_API_KEY, else none)")
    serve.add_argument("--api-key-file", metavar="FILE",
                       help="API keys, one per line ('#' starts a comment)")
    serve.add_argument("--share-prefix-cache", action="store_true",
                       help="with several API keys: let their requests hit each other's "
                            "cached prompt blocks (faster, but a hit tells one tenant that "
                            "another sent that prefix)")
    serve.add_argument("--max-num-seqs", type=_positive_int, default=32,
                       help="sequences decoded together at most (default: %(default)s)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests queued beyond the running batch before 429 "
                            "(default: %(default)s)")
    serve.add_argument("--grace-period", type=float, default=30.0,
                       help="seconds a shutdown (SIGTERM) lets running requests finish "
                            "(default: %(default)s)")
    serve.add_argument("--default-max-tokens", type=int, default=1024,
                       help="max_tokens of a request that sets none; 0: the rest of the "
                            "context (default: %(default)s)")
    serve.add_argument("--max-body-size", default="16MiB",
                       help="a request body past this is refused (413) before it is read, "
                            "as is one without the API key (401) (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=30.0,
                       help="seconds a request has to arrive whole, headers and body; a "
                            "slower client is disconnected (default: %(default)s)")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open connections at most; past it a new one replaces the "
                            "oldest that is still waiting for a request (default: "
                            "%(default)s)")
    serve.set_defaults(run=_cmd_serve)

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
    session.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                         help="where the disk tier lives (default: %(default)s)")
    session.add_argument("--disk-budget", default="16GiB")
    session.add_argument("--json", action="store_true")
    session.set_defaults(run=_cmd_session)

    train = sub.add_parser("train", help="train a model of the family from scratch")
    train.add_argument("--preset", choices=PRESETS, required=True)
    train.add_argument("--out", required=True, help="the run directory (resumes if present)")
    train.add_argument("--steps", type=_positive_int, default=200)
    train.add_argument("--seq-len", type=_positive_int, default=256)
    train.add_argument("--batch-size", type=_positive_int, default=8)
    train.add_argument("--grad-accum", type=_positive_int, default=1)
    train.add_argument("--lr", type=_positive_float, default=3e-3)
    train.add_argument("--min-lr", type=float, default=3e-4,
                       help="where the cosine schedule ends")
    train.add_argument("--warmup-steps", type=int, default=20)
    train.add_argument("--dense-warmup-steps", type=int, default=50)
    train.add_argument("--dense-warmup-indexer-only", action="store_true",
                       help="the dense warm-up trains the indexers alone on the KL to dense "
                            "attention, every other weight frozen")
    train.add_argument("--index-target-rows", type=int, default=0,
                       help="with --dense-warmup-indexer-only: dense indexer targets at this "
                            "many query positions per row (up to half where an answer is "
                            "predicted), attention sparse: for rows too long for dense attention "
                            "(0: dense at every position)")
    train.add_argument("--eval-every", type=_positive_int, default=50)
    train.add_argument("--checkpoint-every", type=_positive_int, default=50)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--vocab-size", type=int, default=0, help="0: the preset's")
    train.add_argument("--corpus", help="a directory of .py files (default: the stdlib)")
    train.add_argument("--heldout-percent", type=_positive_float, default=2.0,
                       help="share of files held out for evaluation")
    train.add_argument("--retrieval-rate", type=float, default=0.0,
                       help="share of rows replaced by synthetic key-retrieval samples")
    train.add_argument("--retrieval-keys", type=_positive_int, default=1,
                       help="keys defined and asked in each retrieval sample")
    train.add_argument("--retrieval-families", default="key",
                       help="how retrieval samples write their keys: key (the bundled "
                            "model's first form), six (the forms of its first long-context "
                            "stages), trained (the forms of its later stages), crossed "
                            "(those and the same definitions asked in another spelling of "
                            "the name), indirect (those and values stated through a call or "
                            "a second name), or family names "
                            "(default: %(default)s)")
    train.add_argument("--no-define-loss", action="store_true",
                       help="no loss on the planted definitions: only the answers teach")
    train.add_argument("--answer-loss-weight", type=_positive_float, default=1.0,
                       help="weigh the loss where a retrieval answer token is predicted by "
                            "this factor, every other position 1 (default: %(default)s)")
    train.add_argument("--set", action="append", type=_config_setting, metavar="KEY=VALUE",
                       help="change one key of the preset's model config (a JSON value: "
                            "--set window_size=128 --set 'compress_ratios=[0,2,2,2,1,1,1,1]'); "
                            "repeatable")
    train.add_argument("--init-from", metavar="MODEL_DIR",
                       help="start from this model's weights and tokenizer instead of a "
                            "fresh initialisation (fine-tuning; e.g. kvstack/data/default); "
                            "its parameter shapes must be the run's")
    train.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    train.set_defaults(run=_cmd_train)

    demo = sub.add_parser("demo", help="ingest a long file, continue it, and compare the "
                          "cache with the dense control's")
    demo.add_argument("--model", help="model directory (default: the bundled model)")
    demo.add_argument("--control", help="dense control directory (default: the repository's)")
    demo.add_argument("--context", type=_positive_int, default=3072)
    demo.add_argument("--max-tokens", type=_positive_int, default=48)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(run=_cmd_demo)

    export = sub.add_parser("export", help="write a model in DeepSeek's published V4.1 "
                            "layout (FP8/FP4, sharded) or in kvstack's own (float)")
    export.add_argument("out", metavar="DIR", help="the new model directory")
    export.add_argument("--format", choices=("v41", "kvstack"), required=True)
    export.add_argument("--model", default="default",
                        help="a model directory, kvstack's or V4.1's (default: the bundled "
                             "model)")
    export.add_argument("--preset", choices=PRESETS, help="with --random-init: its config")
    export.add_argument("--random-init", action="store_true",
                        help="random weights of --preset (a tiny V4.1-format checkpoint)")
    export.add_argument("--init-seed", type=int, default=0)
    export.add_argument("--shard-size", default="4GiB", help="bytes per shard (v41)")
    export.set_defaults(run=_cmd_export)

    evaluate = sub.add_parser("eval", help="evaluate a trained model")
    kinds = evaluate.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("ppl", help="held-out perplexity, FP4 caches against bf16")
    ppl.add_argument("--seq-len", type=_positive_int, default=512)
    ppl.add_argument("--windows", type=_positive_int, default=16)
    ppl.add_argument("--short-context", type=_positive_int, metavar="N",
                     help="also score the same tokens through windows of N tokens sliding "
                          "by N/2: what the long context does, apart from the text")
    ppl.set_defaults(run=_cmd_eval_ppl)
    ret = kinds.add_parser("retrieval", help="key retrieval by context length and depth")
    ret.add_argument("--lengths", type=_positive_int, nargs="+", default=[512, 1024, 2048])
    ret.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ret.add_argument("--samples", type=_positive_int, default=8)
    ret.add_argument("--replay", choices=("bounded", "exact"), default="exact")
    ret.add_argument("--seed", type=int, default=0,
                     help="draws the questions: another seed, another set (default: 0)")
    ret.add_argument("--plot", help="write the heat map to this PNG")
    ret.add_argument("--families", default="key",
                     help="how the keys are written: key (KEY_0042 = \"...\", the bundled "
                          "model's first form), six, trained, crossed, indirect, held-out "
                          "(forms no training run samples), or family names (default: "
                          "%(default)s)")
    ret.set_defaults(run=_cmd_eval_retrieval)
    planted = kinds.add_parser("planted", help="how often free generation opens with a key "
                               "definition as retrieval samples write them")
    planted.add_argument("--samples", type=_positive_int, default=50)
    planted.add_argument("--context", type=_positive_int, default=256,
                         help="tokens of held-out code before each continuation")
    planted.add_argument("--new-tokens", type=_positive_int, default=24)
    planted.set_defaults(run=_cmd_eval_planted)
    rep = kinds.add_parser("replay", help="resume cost and fidelity: the window rebuilt by "
                           "replay against a re-prefill and the uninterrupted session")
    rep.add_argument("--lengths", type=_positive_int, nargs="+",
                     help="context lengths (default: 512 1024 2048 4000)")
    rep.add_argument("--replay", choices=("bounded", "exact"), nargs="+",
                     default=["bounded", "exact"])
    rep.add_argument("--decode-tokens", type=_positive_int, default=8,
                     help="tokens decoded after the resume (KL over these + 1 positions)")
    rep.add_argument("--repeats", type=_positive_int, default=3,
                     help="timed runs of each rebuild and re-prefill; the best is kept")
    rep.set_defaults(run=_cmd_eval_replay)
    att = kinds.add_parser("attention", help="where each layer's attention goes: window, "
                           "compressed entries near and beyond it, sink")
    att.add_argument("--seq-len", type=_positive_int, default=512)
    att.add_argument("--windows", type=_positive_int, default=8)
    att.add_argument("--from-position", type=int,
                     help="probe queries from this position on (default: half of --seq-len)")
    att.set_defaults(run=_cmd_eval_attention)
    knock = kinds.add_parser("knockout", help="which layers' compressed attention "
                             "retrieval needs: one layer at a time left to its window")
    knock.add_argument("--length", type=_positive_int, default=512)
    knock.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    knock.add_argument("--samples", type=_positive_int, default=8)
    knock.set_defaults(run=_cmd_eval_knockout)
    sel = kinds.add_parser("selection", help="whether a retrieval miss is the indexer's "
                           "choice or the read: the definition's entries in each top-k")
    sel.add_argument("--lengths", type=_positive_int, nargs="+", default=[512, 2048, 8192])
    sel.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    sel.add_argument("--samples", type=_positive_int, default=4)
    sel.add_argument("--trunk-picks", action="store_true",
                     help="each picking layer selects by its own attention logits instead of "
                          "its indexer: what a perfect indexer would buy")
    sel.add_argument("--logit-scale", type=_layer_factor, action="append", metavar="LAYER=F",
                     help="multiply a layer's attention logits by F (repeatable): what a "
                          "sharper read would buy")
    sel.add_argument("--families", default="held-out",
                     help="how the keys are written, as for retrieval (default: %(default)s)")
    sel.set_defaults(run=_cmd_eval_selection)
    for p in (ppl, ret, planted, rep, att, knock, sel):
        p.add_argument("--model", required=True, help="a model directory")
        p.add_argument("--heldout-percent", type=_positive_float, default=2.0)
        p.add_argument("--json", action="store_true")
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


if __name__ == "__main__":
    sys.exit(main())
