"""`kvstack plan`: a model's cache layout, bytes per token, parameters and capacity, from
its config alone (no weights, no torch), as tables or as JSON."""

import argparse
import json
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kvstack.config import PRESETS, ModelConfig, preset
from kvstack.plan import DEFAULT_IMAGE_SIZE, make_plan
from kvstack.units import format_bytes, positive_float, positive_int


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    plan = sub.add_parser(
        "plan",
        help="cache layout, bytes/token, parameters and capacity of a model (from its config)",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=PRESETS, help="a named model config")
    source.add_argument("--config", metavar="FILE", help="a config.json")
    plan.add_argument(
        "--context", type=positive_int, help="tokens per sequence (default: max_seq_len)"
    )
    plan.add_argument(
        "--hbm-gib", type=positive_float, metavar="G",
        help="GiB of memory of one device: how many sequences fit (all of it given to the "
             "cache; with --tensor-parallel-size, what the weights and a reserve leave)",
    )
    plan.add_argument(
        "--tensor-parallel-size", type=positive_int, metavar="N",
        help="what each of N devices holds: weights (as V4.1 is published), Engram tables "
             "and cache, and with --hbm-gib the sequences each fits",
    )
    plan.add_argument(
        "--expert-parallel", action="store_true",
        help="with --tensor-parallel-size: whole routed experts per device, not a slice of "
             "every expert",
    )
    plan.add_argument(
        "--image", type=image_size, metavar="WxH", default=DEFAULT_IMAGE_SIZE,
        help="for a model with a vision tower: what one picture of W x H pixels costs in "
             "prompt positions and cache bytes (default %(default)s)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=run)


def image_size(text: str) -> tuple[int, int]:
    """'1024x768' -> (1024, 768)."""
    width, x, height = text.lower().partition("x")
    if not x or not width.isdigit() or not height.isdigit() or not int(width) or \
            not int(height):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 1024x768, "
                                         f"got {text!r}")
    return int(width), int(height)


def run(args: argparse.Namespace) -> int:
    if args.config:
        config, name = ModelConfig.from_json(args.config), args.config
    else:
        config, name = preset(args.preset), args.preset
    plan = make_plan(config, name, context=args.context, hbm_gib=args.hbm_gib,
                     tensor_parallel_size=args.tensor_parallel_size,
                     expert_parallel=args.expert_parallel, image_size=args.image)
    if args.json:
        print(json.dumps(plan))
    else:
        # The mechanism table needs about 100 columns; narrower consoles would fold it.
        print_plan(plan, Console(width=max(Console().width, 100)))
    return 0


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
            f"({format_bytes(plan['window_bytes_per_sequence'])}); partial compressor groups "
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
    drafts = plan["draft_layers"]
    console.print(
        f"Parameters: {_params(plan['params_total'])} total"
        + (" (trunk)" if drafts else "")
        + f", {_params(plan['params_active_decode'])} active per decoded token, "
        f"{_params(plan['params_active_prefill'])} per prefilled token"
        + (" under CED" if enc else "")
        + (f"; DSpark draft apart: {drafts} stages, {_params(plan['params_draft'])} "
           f"({format_bytes(plan['draft_weight_bytes'])} packed)" if drafts else "")
    )
    if "vision" in plan:
        v, image = plan["vision"], plan["vision"]["image"]
        console.print(
            f"Vision tower (apart from the trunk): {v['layers']} layers, "
            f"{_params(v['params'])} ({format_bytes(v['weight_bytes'])} as published); a "
            f"{image['width']} x {image['height']} picture is {image['grid'][0]} x "
            f"{image['grid'][1]} tokens, {image['positions']:,} prompt positions: "
            f"[bold]{image['cache_bytes']:,} B[/bold] of cache "
            f"({format_bytes(image['cache_bytes'])})"
        )
    if "engram" in plan:
        e = plan["engram"]
        console.print(
            f"Engram tables (weights, apart from the cache): [bold]{format_bytes(e['table_bytes'])}"
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
        f"At {plan['context']:,} tokens: {format_bytes(plan['bytes_per_sequence'])} of cache per "
        f"sequence{fit}\n"
    )
    if "cpu_run" in plan:
        r = plan["cpu_run"]
        tables = (f"; with the Engram tables memory-mapped from it "
                  f"[bold]{format_bytes(r['ram_bytes_tables_on_disk'])}[/bold]"
                  if r["engram_table_bytes"] else "")
        console.print(
            f"CPU run of the published checkpoint ({format_bytes(r['disk_bytes'])} on disk), one "
            f"sequence at {plan['context']:,} tokens: RAM [bold]"
            f"{format_bytes(r['ram_bytes_tables_in_ram'])}[/bold] with every weight in "
            f"RAM{tables}. "
            f"A decoded token reads {r['decode_read_bytes_per_token'] / 1e9:.2f} GB of "
            f"weights: at most {r['floor_tokens_per_s_per_100gb_s']:.1f} tokens/s per 100 "
            "GB/s of memory bandwidth\n"
        )

    if "parallel" in plan:
        _print_parallel(plan, console)
    if len(plan["mechanisms"]) > 1:
        _print_mechanisms(plan, console)


def _gib_gb(n: int) -> str:
    return f"{format_bytes(n)} ({n / 1e9:,.1f} GB)" if n >= 1e9 else format_bytes(n)


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
        + (f"{format_bytes(p['engram_table_bytes_per_device'])} of Engram table rows and "
           if tables else "")
        + f"{format_bytes(p['replicated_bytes_per_device'])} that every device holds whole "
        "(norms, hyper-connections, wq_a, wkv, compressors, router"
        + (", vision tower)" if "vision" in plan else ")")
    )
    console.print(
        f"Cache: each device keeps every token's whole record, so [bold]"
        f"{p['cache_bytes_per_token_per_device']:g} bytes/token per device[/bold] (the "
        f"single-process figure; {n} × that over the devices), "
        f"{format_bytes(p['cache_bytes_per_sequence_per_device'])} per sequence of "
        f"{context:,} tokens"
    )
    fit = p.get("fit")
    if fit:
        console.print(f"Of each device's {p['hbm_gib_per_device']:g} GiB: the weights, a "
                      f"{p['reserve_fraction']:.0%} reserve "
                      f"({format_bytes(p['reserve_bytes'])}) for activations and workspaces, "
                      "the rest for the cache")
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
        cells = [label, format_bytes(per_device), format_bytes(all_devices)]
        if fit:
            f = fit[key]
            cells.append(format_bytes(f["cache_bytes"]))
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
                console.print(f"[bold red]{where} weights alone "
                              f"({format_bytes(f['weight_bytes'])}) "
                              f"exceed the device's {p['hbm_gib_per_device']:g} GiB[/bold red]")
            elif not f["sequences_fit"]:
                console.print(f"[bold red]{where} weights ({format_bytes(f['weight_bytes'])}) and "
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
